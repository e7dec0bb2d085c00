// Float32 vectors over bf16 / fp16 memory for the fused element-wise ops (fused_ops_cpu.cpp),
// one set of primitives per vector path, so that the ops' loops are written once:
//
//   PAGODA_FUSED_AVX512  AVX512F + BW + VL: VecF = __m512, 16 lanes, masked 16-bit loads and
//                        stores for tails
//   PAGODA_FUSED_AVX2    AVX2 + FMA + F16C (and no AVX-512 BW/VL): VecF = __m256, 8 lanes,
//                        tails through a zeroed stack buffer
//
// The float32 arithmetic is vec_lanes_cpu.h's wrappers, shared with the attention kernels.
// The two give the same bits: every lane does the same float32 operations in the same order
// (vexp's final 2^n scaling, vscale2, is scalef on AVX-512 and an exact double product
// rounded once to float32 on AVX2: both are p * 2^n rounded once), and `vsum16` reduces 16
// partial sums (one AVX-512 vector, two AVX2 halves) in one fixed tree (sum16). One
// exception, bf16 only: with AVX512_BF16 the AVX-512 rounding to bf16 is vcvtneps2bf16,
// which flushes float32 subnormal values to zero and keeps a NaN's sign and payload; the
// rounding by hand (AVX2, and AVX-512 without AVX512_BF16) keeps subnormals and writes the
// canonical NaN 0x7FC0, as c10 does.
//
// The including file compiles with fp-contract=off: no multiply-add is fused unless written
// as vfmadd.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec_lanes_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_FUSED_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_FUSED_AVX2 1
#endif

#if defined(PAGODA_FUSED_AVX512) || defined(PAGODA_FUSED_AVX2)
#define PAGODA_FUSED_VEC 1
#include <immintrin.h>

namespace pagoda_fused {

template <typename T>
constexpr bool kVec = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// The lane-width wrappers (vec_lanes_cpu.h) of this file's width.
using pagoda_vec::sum16;
using pagoda_vec::vadd;
using pagoda_vec::vdiv;
using pagoda_vec::vfmadd;
using pagoda_vec::vmax;
using pagoda_vec::vmul;
using pagoda_vec::vrint;
using pagoda_vec::vscale2;
using pagoda_vec::vset1;
using pagoda_vec::vsub;

#if defined(PAGODA_FUSED_AVX512)
using VecF = __m512;
constexpr int64_t kLanes = 16;

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The first min(n, 16) values at p widened to float32; the lanes past n are 0.
template <typename T>
inline VecF vload(const T* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return pagoda_vec::vwiden_bf16(raw);
  } else {
    return _mm512_cvtph_ps(raw);
  }
}

template <typename T>
inline __m256i to_half_bits(VecF x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
    // Round to nearest even by hand; NaN becomes the canonical quiet NaN as in c10.
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
#endif
  } else {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// x rounded to T, the first min(n, 16) values stored at p.
template <typename T>
inline void vstore(T* p, VecF x, int64_t n) {
  _mm256_mask_storeu_epi16(p, tail_mask(n), to_half_bits<T>(x));
}

template <typename T>
inline VecF widen(__m256i h) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return pagoda_vec::vwiden_bf16(h);
  } else {
    return _mm512_cvtph_ps(h);
  }
}

inline float vsum16(const VecF* acc) { return sum16(acc[0]); }

#else  // PAGODA_FUSED_AVX2
using VecF = __m256;
constexpr int64_t kLanes = 8;

template <typename T>
inline VecF widen(__m128i h) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return pagoda_vec::vwiden_bf16(h);
  } else {
    return _mm256_cvtph_ps(h);
  }
}

// The first min(n, 8) values at p widened to float32; the lanes past n are 0.
template <typename T>
inline VecF vload(const T* p, int64_t n) {
  __m128i raw;
  if (n >= 8) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    uint16_t buf[8] = {};
    std::memcpy(buf, p, n * sizeof(T));
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return widen<T>(raw);
}

template <typename T>
inline __m128i to_half_bits(VecF x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // Round to nearest even by hand; NaN becomes the canonical quiet NaN as in c10.
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // NOTE: every lane holds at most 0xFFFF, so the unsigned saturating pack is exact.
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// x rounded to T, the first min(n, 8) values stored at p.
template <typename T>
inline void vstore(T* p, VecF x, int64_t n) {
  const __m128i h = to_half_bits<T>(x);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    uint16_t buf[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), h);
    std::memcpy(p, buf, n * sizeof(T));
  }
}

inline float vsum16(const VecF* acc) { return sum16(acc[0], acc[1]); }
#endif

// The number of VecF accumulators that hold vsum16's 16 partial sums.
constexpr int64_t kSumParts = 16 / kLanes;

// x rounded to T and widened back: the value a PyTorch op in T would hand on.
template <typename T>
inline VecF vround(VecF x) {
  return widen<T>(to_half_bits<T>(x));
}

// e^x to about 1 float ulp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split).
inline VecF vexp(VecF x) {
  const VecF n = vrint(vmul(x, vset1<VecF>(1.44269504088896341f)));
  VecF r = vsub(x, vmul(n, vset1<VecF>(0.693359375f)));
  r = vsub(r, vmul(n, vset1<VecF>(-2.12194440e-4f)));
  VecF p = vset1<VecF>(1.9875691500e-4f);
  p = vfmadd(p, r, vset1<VecF>(1.3981999507e-3f));
  p = vfmadd(p, r, vset1<VecF>(8.3334519073e-3f));
  p = vfmadd(p, r, vset1<VecF>(4.1665795894e-2f));
  p = vfmadd(p, r, vset1<VecF>(1.6666665459e-1f));
  p = vfmadd(p, r, vset1<VecF>(5.0000001201e-1f));
  p = vfmadd(p, vmul(r, r), vadd(r, vset1<VecF>(1.0f)));
  return vscale2(p, n);
}

}  // namespace pagoda_fused

#else
namespace pagoda_fused {
template <typename T>
constexpr bool kVec = false;
}  // namespace pagoda_fused
#endif
