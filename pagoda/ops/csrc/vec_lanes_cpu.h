// Float32 lane vectors of the CPU kernels' vector paths: one set of wrappers per width, so
// that a loop is written once over a vector type V:
//
//   __m256   8 lanes   where the build targets AVX2 + FMA   (PAGODA_VEC8)
//   __m512  16 lanes   where it targets AVX512F             (PAGODA_VEC16)
//
// An AVX-512 build has both. Each user picks its width under its own guard, which may ask
// for more than these (fused_vec_cpu.h: AVX512BW + VL for 16 lanes, F16C for 8; the
// attention kernels, attention_cpu.h: nothing more). Ops with a vector operand are
// overloads (vadd(a, b)); those without one name the width (vset1<V>(x), vload<V>(p)).
//
// Per lane every op is the same IEEE float32 operation on both widths, so a loop written
// over them gives the same bits on both. The one op AVX2 has no instruction for, scalef's
// p * 2^n (vscale2), is formed exactly in double there and rounded once to float32, which
// is scalef's rounding (a subnormal result too). sum16 reduces 16 partial sums (one 16-lane
// vector, or two 8-lane halves) in one fixed tree.
//
// NOTE: the kernels that need identical bits across widths compile without FMA contraction
// (#pragma GCC optimize("fp-contract=off")): a multiply-add is fused only where written as
// vfmadd / vfnmadd.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace pagoda_vec {

template <typename V>
inline V vzero();
template <typename V>
inline V vset1(float x);
// kLanes floats from p (unaligned).
template <typename V>
inline V vload(const float* p);
// kLanes int8 codes from p, sign-extended and converted (exact).
template <typename V>
inline V vload_i8(const int8_t* p);
// kLanes fp8 e4m3fn codes from p as value * 2^-120 (kv_quant_cpu.h: kFp8Unit): the
// sign-extended byte shifted left by 20 has the sign in bits 31..27 and exponent / mantissa
// in bits 26..20; keeping bit 31 and bits 26..20 is the float32. Subnormal codes give
// float32 denormals, which the FMAs take exactly (nothing here sets denormals-are-zero).
template <typename V>
inline V vload_fp8(const uint8_t* p);
// kLanes bf16 values from p widened to float32, natural order.
template <typename V>
inline V vload_bf16(const uint16_t* p);
// 2 * kLanes bf16 values from p widened: even elements into even, odd ones into odd.
template <typename V>
inline void vload_bf16_pairs(const uint16_t* p, V& even, V& odd);

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// 16 partial sums (lo: lanes 0-7, hi: lanes 8-15) added in one fixed tree:
// ((h0 + h2) + (h1 + h3)) of h = (hi + lo)[4:8] + (hi + lo)[0:4] (GCC's _mm512_reduce_add_ps,
// written out so that neither width depends on a compiler's reduction order).
inline float sum16(__m256 lo, __m256 hi) {
  const __m256 t8 = _mm256_add_ps(hi, lo);
  const __m128 t4 = _mm_add_ps(_mm256_extractf128_ps(t8, 1), _mm256_castps256_ps128(t8));
  const __m128 t2 = _mm_add_ps(t4, _mm_shuffle_ps(t4, t4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_VEC8 1

template <>
inline __m256 vzero<__m256>() { return _mm256_setzero_ps(); }
template <>
inline __m256 vset1<__m256>(float x) { return _mm256_set1_ps(x); }
template <>
inline __m256 vload<__m256>(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 vsub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 vdiv(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
inline __m256 vmax(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
// a * b + c and c - a * b, one rounding.
inline __m256 vfmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vfnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
// x rounded to an integral value, ties to even.
inline __m256 vrint(__m256 x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// 2^n as 4 doubles, n (integral, in [-1022, 1023]) from 4 int32 lanes.
inline __m256d pow2_pd(__m128i n) {
  const __m256i e = _mm256_add_epi64(_mm256_cvtepi32_epi64(n), _mm256_set1_epi64x(1023));
  return _mm256_castsi256_pd(_mm256_slli_epi64(e, 52));
}

// p * 2^n (n integral, |n| <= 300) formed exactly in double (a normal double for every
// nonzero float p) and rounded once to float32: scalef's result wherever it is in range.
inline __m256 vscale2_in_range(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256d lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(p)),
                                   pow2_pd(_mm256_castsi256_si128(ni)));
  const __m256d hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)),
                                   pow2_pd(_mm256_extracti128_si256(ni, 1)));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

// scalef's result without AVX-512, for the (p, n) that an exp forms: p * 2^n rounded once.
// NOTE: beyond +-300 every nonzero finite p gives inf / 0 either way, so n is clamped there;
// an infinite n (x * log2(e) overflowed) comes with a NaN p, for which scalef's special case
// gives +inf (n = +inf) or +0 (n = -inf); a NaN n (x NaN) comes with a NaN p too, which
// passes through.
inline __m256 vscale2(__m256 p, __m256 n) {
  const __m256 nc = _mm256_min_ps(_mm256_max_ps(n, vset1<__m256>(-300.0f)),
                                  vset1<__m256>(300.0f));
  const __m256 scaled = vscale2_in_range(p, nc);
  const __m256 abs_n = _mm256_andnot_ps(vset1<__m256>(-0.0f), n);
  const __m256 inf_n = _mm256_cmp_ps(abs_n, vset1<__m256>(INFINITY), _CMP_EQ_OQ);
  return _mm256_blendv_ps(scaled, _mm256_max_ps(n, vset1<__m256>(0.0f)), inf_n);
}

template <>
inline __m256 vload_i8<__m256>(const int8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
}

template <>
inline __m256 vload_fp8<__m256>(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepi8_epi32(x), 20);
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  return _mm256_castsi256_ps(_mm256_and_si256(w, keep));
}

// bf16 bits widened: the 16-bit value shifted into the high half of a float32.
inline __m256 vwiden_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <>
inline __m256 vload_bf16<__m256>(const uint16_t* p) {
  return vwiden_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <>
inline void vload_bf16_pairs<__m256>(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, hi_mask));
}
#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#define PAGODA_VEC16 1

template <>
inline __m512 vzero<__m512>() { return _mm512_setzero_ps(); }
template <>
inline __m512 vset1<__m512>(float x) { return _mm512_set1_ps(x); }
template <>
inline __m512 vload<__m512>(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 vsub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 vdiv(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
inline __m512 vmax(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 vfmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vfnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512 vrint(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n (n integral), rounded once; saturates to inf / 0 outside float range.
inline __m512 vscale2(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
inline __m512 vscale2_in_range(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }

inline float sum16(__m512 x) {
  return sum16(_mm512_castps512_ps256(x),
               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

template <>
inline __m512 vload_i8<__m512>(const int8_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
}

template <>
inline __m512 vload_fp8<__m512>(const uint8_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepi8_epi32(x), 20);
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  return _mm512_castsi512_ps(_mm512_and_si512(w, keep));
}

inline __m512 vwiden_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <>
inline __m512 vload_bf16<__m512>(const uint16_t* p) {
  return vwiden_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <>
inline void vload_bf16_pairs<__m512>(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
}
#endif  // __AVX512F__

}  // namespace pagoda_vec
