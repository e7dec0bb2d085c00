// fp8 (e4m3fn) weight linears for CPU: the fp8_linear op's fast path (ops/quant_cpu.py).
//
// Codes are the checkpoint's e4m3fn bytes [N, K], row-major, untouched; scales float32
// [N, KB], one per (output row, block of `kblock` input columns), KB = ceil(K / kblock)
// (per-tensor and per-channel scales: KB = 1, kblock = K; vLLM's 128 x 128 blocks: the
// block rows expanded to N by the preparer).
//
// The code -> float step is exact and needs no table: e4m3fn's bits s.eeee.mmm, shifted
// into a float16 as s.0eeee.mmm0000000, are the code's value times 2^-8, subnormal codes
// included (they land on float16 subnormals, which vcvtph2ps widens exactly whatever
// MXCSR's denormals-are-zero says); the 2^8 goes into the scale. e4m3fn's NaN (s.1111.111)
// reads as 480 (no checkpoint stores it).
//
// fp8_gemv: few activation rows (decode). Activations widened to float32 once; per output
// row, codes widened 16 at a time and FMA'd against up to kRows activation rows (one code
// decode serves them all), four accumulators per row to cover the FMA latency; a block's
// sum times its scale. Weight rows split statically over the threads, so each streams one
// contiguous range. Rounding: float32 sums in another order than the reference's GEMM.
// fp8_dequant: the weight times its scales into a bf16 [N, K] buffer (round to nearest
// even), for many rows, where a bf16 GEMM (oneDNN) beats widening every code per row.
//
// Vector paths: AVX-512 F/BW/VL where the build targets them, else AVX2 with FMA and F16C
// (x86-64-v3). The AVX2 path holds each 16-lane vector of the AVX-512 one as two 8-lane
// halves and does per lane the same operations in the same order, and both reduce a row's
// 16 lanes in vec_lanes_cpu.h's written-out order (sum16), so the two give the same bits.

#include <torch/extension.h>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_FP8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_FP8_AVX2 1
#endif
#if defined(PAGODA_FP8_AVX512) || defined(PAGODA_FP8_AVX2)
#define PAGODA_FP8_VEC 1
#include <immintrin.h>

#include "vec_lanes_cpu.h"
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace pagoda_quant {

namespace {

constexpr int kRows = 4;  // activation rows sharing one decode of a weight row's codes
constexpr float kCodeScale = 256.0f;  // the codes widen to their value times 2^-8

void check_args(const at::Tensor& codes, const at::Tensor& scales, int64_t kblock) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "fp8 codes must be contiguous uint8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(kblock > 0 && (kblock % 16 == 0 || kblock >= k),
              "fp8 kblock must be a multiple of 16 or cover K");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == n && scales.size(1) == (k + kblock - 1) / kblock,
              "fp8 scales must be contiguous float32 [N, ceil(K / kblock)]");
}

#if defined(PAGODA_FP8_VEC)
// 16 float lanes: one AVX-512 register, or two AVX2 halves (lanes 0-7, 8-15).
#if defined(PAGODA_FP8_AVX512)
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load16f(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 fmadd16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline __m256 low8(V16 a) { return _mm512_castps512_ps256(a.v); }
inline __m256 high8(V16 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
}
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load16f(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 fmadd16(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 low8(V16 a) { return a.lo; }
inline __m256 high8(V16 a) { return a.hi; }
#endif

// The sum of 16 lanes: vec_lanes_cpu.h's one written-out tree, on either path.
inline float hsum16(V16 a) { return pagoda_vec::sum16(low8(a), high8(a)); }

// 16 bytes at p, zero past `left` (which may be under 16).
inline __m128i load_bytes16(const uint8_t* p, int64_t left) {
  if (left >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint8_t buf[16] = {};
  for (int64_t i = 0; i < left; ++i) buf[i] = p[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}

#if defined(PAGODA_FP8_AVX2)
// 8 e4m3fn codes (8 bytes of b's low half) -> their values times 2^-8 (exact), as the
// float16 bits s.0eeee.mmm0000000.
inline __m128i fp8_as_half8(__m128i b) {
  const __m128i v = _mm_cvtepu8_epi16(b);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7f)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
  return _mm_or_si128(mag, sign);
}
#endif

// 16 e4m3fn codes -> their values times 2^-8 (exact).
inline V16 widen16(__m128i b) {
#if defined(PAGODA_FP8_AVX512)
  const __m256i v = _mm256_cvtepu8_epi16(b);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
  return {_mm512_cvtph_ps(_mm256_or_si256(mag, sign))};
#else
  return {_mm256_cvtph_ps(fp8_as_half8(b)), _mm256_cvtph_ps(fp8_as_half8(_mm_unpackhi_epi64(b, b)))};
#endif
}

// 16 floats -> bf16, round to nearest even (no NaN here), without AVX512_BF16, into out[0,
// count).
inline void store_bf16x16(V16 v, uint16_t* out, int64_t count) {
#if defined(PAGODA_FP8_AVX512)
  const __m512i bits = _mm512_castps_si512(v.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
  if (count >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  else _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << count) - 1), h);
#else
  const auto round8 = [](__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  };
  // NOTE: packus interleaves 128-bit lanes (lo0 hi0 lo1 hi1); the permute restores order.
  const __m256i h = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(round8(v.lo), round8(v.hi)), _MM_SHUFFLE(3, 1, 2, 0));
  if (count >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  } else {
    alignas(32) uint16_t buf[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
    for (int64_t i = 0; i < count; ++i) out[i] = buf[i];
  }
#endif
}

// One weight row against `rows` (<= kRows) activation rows xf (float32, row stride kp, zero
// past K): y[r] = sum over blocks of scale[b] * dot(codes in block b, x_r in block b).
template <int R>
void row_dot(const uint8_t* w, const float* s, const float* xf, int64_t kp, int64_t k,
             int64_t kblock, float* y) {
  V16 total[R];
  for (int r = 0; r < R; ++r) total[r] = zero16();
  for (int64_t b0 = 0, bi = 0; b0 < k; b0 += kblock, ++bi) {
    const int64_t b1 = std::min(k, b0 + kblock);
    V16 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < 4; ++a) acc[r][a] = zero16();
    int64_t c = b0;
    for (; c + 64 <= b1; c += 64) {
      for (int a = 0; a < 4; ++a) {
        const V16 wv = widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c + 16 * a)));
        for (int r = 0; r < R; ++r)
          acc[r][a] = fmadd16(wv, load16f(xf + r * kp + c + 16 * a), acc[r][a]);
      }
    }
    for (; c < b1; c += 16) {
      // NOTE: past K the activations are zero, so a partial tail needs only the codes' zeros.
      const V16 wv = widen16(load_bytes16(w + c, b1 - c));
      for (int r = 0; r < R; ++r) acc[r][0] = fmadd16(wv, load16f(xf + r * kp + c), acc[r][0]);
    }
    const V16 sv = set16(s[bi] * kCodeScale);
    for (int r = 0; r < R; ++r) {
      const V16 sum = add16(add16(acc[r][0], acc[r][1]), add16(acc[r][2], acc[r][3]));
      total[r] = fmadd16(sum, sv, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum16(total[r]);
}
#endif

}  // namespace

std::vector<std::string> fp8_isa() {
#if defined(PAGODA_FP8_AVX512)
  return {"avx512f", "avx512bw", "avx512vl"};
#elif defined(PAGODA_FP8_AVX2)
  return {"avx2", "fma", "f16c"};
#else
  return {};
#endif
}

at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    int64_t kblock, const c10::optional<at::Tensor>& bias) {
  check_args(codes, scales, kblock);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == codes.size(1), "x must be [M, K]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  const int64_t kp = (k + 15) / 16 * 16;
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#if defined(PAGODA_FP8_VEC)
  at::Tensor xf = at::zeros({m, kp}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, k).copy_(x);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t kb = scales.size(1);
#pragma omp parallel for schedule(static) if (n * k * m >= (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    float y[kRows];
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
      const float* xr = xp + r0 * kp;
      switch (rows) {
        case 4: row_dot<4>(cp + j * k, sp + j * kb, xr, kp, k, kblock, y); break;
        case 3: row_dot<3>(cp + j * k, sp + j * kb, xr, kp, k, kblock, y); break;
        case 2: row_dot<2>(cp + j * k, sp + j * kb, xr, kp, k, kblock, y); break;
        default: row_dot<1>(cp + j * k, sp + j * kb, xr, kp, k, kblock, y); break;
      }
      for (int r = 0; r < rows; ++r) op[(r0 + r) * n + j] = y[r] + (bp != nullptr ? bp[j] : 0.0f);
    }
  }
#else
  TORCH_CHECK(false, "pagoda fp8 kernels were built without AVX-512 or AVX2");
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

void fp8_dequant(const at::Tensor& codes, const at::Tensor& scales, int64_t kblock,
                 at::Tensor& out) {
  check_args(codes, scales, kblock);
  const int64_t n = codes.size(0), k = codes.size(1), kb = scales.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == n &&
                  out.size(1) == k, "fp8_dequant's out must be contiguous bf16 [N, K]");
#if defined(PAGODA_FP8_VEC)
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t b0 = 0, bi = 0; b0 < k; b0 += kblock, ++bi) {
      const V16 sv = set16(sp[j * kb + bi] * kCodeScale);
      const int64_t b1 = std::min(k, b0 + kblock);
      for (int64_t c = b0; c < b1; c += 16) {
        const int64_t left = std::min<int64_t>(16, b1 - c);
        store_bf16x16(mul16(widen16(load_bytes16(cp + j * k + c, left)), sv), op + j * k + c, left);
      }
    }
  }
#else
  TORCH_CHECK(false, "pagoda fp8 kernels were built without AVX-512 or AVX2");
#endif
}

}  // namespace pagoda_quant
