// Quantized-weight linear kernels for CPU (the wquant ops' fast path; see ops/quant_cpu.py).
//
// One weight layout serves every format (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, group-wise
// GPTQ/AWQ/RTN codes): unsigned codes q (4 or 8 bits) in blocks of BLOCK input columns with
// one scale s and one offset m per (row, block), w = s * q + m. Codes of a row are grouped
// 64 at a time ("a register"): 8-bit codes are stored in column order; 4-bit codes of the
// two blocks b, b+1 of a register share bytes (byte j = code(b, j) | code(b + 1, j) << 4),
// so one 32-byte load expands to the register's 64 codes in column order.
//
// q_linear quantizes each activation row to int8 per block (d = max|x| / 127, q = round-
// half-even(x * (1 / d))), then per (row, block): y += s * d * dot(q_w, q_x) + m * d *
// sum(q_x), the integer dot products with VNNI vpdpbusd (an exact AVX-512 BW madd sequence
// without VNNI). Rounding: that of the activation int8 rounding, then float32 sums.
// i8_linear is W8A8 with a per-token scale, summed exactly in int32 and scaled in double,
// which reproduces wquant.int8_linear_reference bit for bit.
//
// Vector path only: compiled when the build targets AVX-512 F/BW/VL (the Python side uses
// the reference elsewhere; quant_isa() reports what was compiled).

#include <torch/extension.h>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_Q_AVX512 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace pagoda_quant {

constexpr int64_t kRowsPerTask = 16;  // output rows per OpenMP task: their codes stay in L1

std::vector<std::string> quant_isa() {
  std::vector<std::string> isa;
#if defined(PAGODA_Q_AVX512)
  isa.insert(isa.end(), {"avx512f", "avx512bw", "avx512vl"});
#if defined(__AVX512VNNI__)
  isa.push_back("avx512_vnni");
#endif
#endif
  return isa;
}

#if defined(PAGODA_Q_AVX512)

// Activations quantized to int8 per block: q [m, kp], d and d * sum(q) per [m, nb].
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dsum;
};

template <typename T>
void quantize_acts(const T* x, int64_t m, int64_t k, int64_t kp, int64_t block, QuantActs& a) {
  const int64_t nb = kp / block;
  a.q.assign(m * kp, 0);
  a.d.assign(m * nb, 0.f);
  a.dsum.assign(m * nb, 0.f);
#pragma omp parallel for schedule(static) if (m > 4)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * block, k1 = std::min(k, k0 + block);
      float amax = 0.f;
      for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[r * k + i])));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t i = k0; i < k1; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[r * k + i]) * id));
        a.q[r * kp + i] = static_cast<int8_t>(q);
        sum += q;
      }
      a.d[r * nb + b] = d;
      a.dsum[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// Sum over each 4 bytes of u8 a times s8 b, per int32 lane (exact either way).
inline __m512i dot_u8s8(__m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
#else
  // NOTE: vpmaddubsw saturates (255 * 127 * 2 > 32767), so split bytes into 16-bit halves.
  const __m512i lo8 = _mm512_set1_epi16(0x00FF);
  const __m512i a_even = _mm512_and_si512(a, lo8), a_odd = _mm512_srli_epi16(a, 8);
  const __m512i b_even = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
  const __m512i b_odd = _mm512_srai_epi16(b, 8);
  return _mm512_add_epi32(_mm512_madd_epi16(a_even, b_even), _mm512_madd_epi16(a_odd, b_odd));
#endif
}

template <int BITS>
inline __m512i load_codes(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(p);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

template <typename S>
inline __m512 load_scales(const S* p, __mmask16 m) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
}

// Lane i of register r of a 16-block chunk belongs to block r * (64 / BLOCK) + i / (BLOCK / 4).
template <int BLOCK>
struct LaneBlocks {
  __m512i idx[BLOCK / 4];
  LaneBlocks() {
    alignas(64) int32_t lanes[16];
    for (int r = 0; r < BLOCK / 4; ++r) {
      for (int i = 0; i < 16; ++i) lanes[i] = r * (64 / BLOCK) + i / (BLOCK / 4);
      idx[r] = _mm512_load_si512(lanes);
    }
  }
};

// R outputs of one weight row (R activation rows at stride kp): per block, s * d * dot +
// m * d * sum(q_x); each register of codes is decoded once for the R rows.
template <int BITS, int BLOCK, typename S, int R>
inline void dot_rows(const uint8_t* w, const S* sc, const S* off, const int8_t* xq,
                     const float* d, const float* dsum, int64_t nb, int64_t kp,
                     const LaneBlocks<BLOCK>& lb, float* y) {
  constexpr int kRegBlocks = 64 / BLOCK;
  constexpr int kRegBytes = 8 * BITS;
  __m512 acc[R], acc_off[R], sd[R];
  for (int i = 0; i < R; ++i) acc[i] = acc_off[i] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, nb - b0));
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1);
    const __m512 sv = load_scales(sc + b0, mask), ov = load_scales(off + b0, mask);
    for (int i = 0; i < R; ++i) {
      sd[i] = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(mask, d + i * nb + b0));
      acc_off[i] = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(mask, dsum + i * nb + b0), acc_off[i]);
    }
    const uint8_t* wp = w + (b0 / kRegBlocks) * kRegBytes;
    const int8_t* xp = xq + b0 * BLOCK;
    for (int r = 0; r < cnt / kRegBlocks; ++r) {
      const __m512i codes = load_codes<BITS>(wp + r * kRegBytes);
      for (int i = 0; i < R; ++i) {
        const __m512i dot = dot_u8s8(codes, _mm512_loadu_si512(xp + i * kp + r * 64));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lb.idx[r], sd[i]), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc_off[i]));
}

constexpr int kRowTile = 4;  // activation rows sharing one decode of the weight codes

template <int BITS, int BLOCK, typename S, typename T>
void q_linear_impl(const QuantActs& a, int64_t m, const uint8_t* codes, const S* sc, const S* off,
                   int64_t n, int64_t kp, const float* bias, T* out) {
  const int64_t nb = kp / BLOCK, row_bytes = kp * BITS / 8;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  const LaneBlocks<BLOCK> lb;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
    for (int64_t r = 0; r < m; r += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, m - r));
      const int8_t* xq = a.q.data() + r * kp;
      const float* d = a.d.data() + r * nb;
      const float* dsum = a.dsum.data() + r * nb;
      for (int64_t j = n0; j < n1; ++j) {
        float y[kRowTile];
        const uint8_t* w = codes + j * row_bytes;
        if (rows == kRowTile) {
          dot_rows<BITS, BLOCK, S, kRowTile>(w, sc + j * nb, off + j * nb, xq, d, dsum, nb, kp, lb, y);
        } else {
          for (int i = 0; i < rows; ++i) {
            dot_rows<BITS, BLOCK, S, 1>(w, sc + j * nb, off + j * nb, xq + i * kp, d + i * nb,
                                        dsum + i * nb, nb, kp, lb, y + i);
          }
        }
        for (int i = 0; i < rows; ++i) {
          out[(r + i) * n + j] = static_cast<T>(bias != nullptr ? y[i] + bias[j] : y[i]);
        }
      }
    }
  }
}

template <int BITS, int BLOCK, typename T>
void q_linear_dispatch_scales(const QuantActs& a, int64_t m, const at::Tensor& codes,
                              const at::Tensor& sc, const at::Tensor& off, int64_t n, int64_t kp,
                              const float* bias, T* out) {
  if (sc.scalar_type() == at::kFloat) {
    q_linear_impl<BITS, BLOCK, float, T>(a, m, codes.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                                         off.data_ptr<float>(), n, kp, bias, out);
  } else {
    q_linear_impl<BITS, BLOCK, at::Half, T>(a, m, codes.data_ptr<uint8_t>(),
                                            sc.data_ptr<at::Half>(), off.data_ptr<at::Half>(), n,
                                            kp, bias, out);
  }
}

#endif  // PAGODA_Q_AVX512

void check_layout(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                  const at::Tensor& off, int64_t bits, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK((bits == 4 && block == 32) || (bits == 8 && (block == 32 || block == 16)),
              "unsupported (bits, block) = (", bits, ", ", block, ")");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be a contiguous uint8 [N, bytes]");
  const int64_t kp = codes.size(1) * 8 / bits;
  TORCH_CHECK(kp % 64 == 0 && x.size(1) <= kp, "codes cover ", kp, " columns, x has ", x.size(1));
  TORCH_CHECK(sc.sizes() == off.sizes() && sc.dim() == 2 && sc.size(0) == codes.size(0) &&
                  sc.size(1) == kp / block && sc.is_contiguous() && off.is_contiguous(),
              "scales and offsets must be contiguous [N, padded K / block]");
  TORCH_CHECK(sc.scalar_type() == off.scalar_type() &&
                  (sc.scalar_type() == at::kFloat || sc.scalar_type() == at::kHalf),
              "scales and offsets must both be float32 or both float16");
}

// y[M, N] = x[M, K] @ w.T (+ bias), w decoded from the layout above; out has x's dtype.
at::Tensor q_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                    const at::Tensor& off, int64_t bits, int64_t block,
                    const c10::optional<at::Tensor>& bias) {
  check_layout(x, codes, sc, off, bits, block);
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), kp = codes.size(1) * 8 / bits;
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(PAGODA_Q_AVX512)
  QuantActs a;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(x.scalar_type(), "q_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      quantize_acts(x.data_ptr<float>(), m, k, kp, block, a);
      if (bits == 4) q_linear_dispatch_scales<4, 32>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<float>());
      else if (block == 32) q_linear_dispatch_scales<8, 32>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<float>());
      else q_linear_dispatch_scales<8, 16>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<float>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = at::BFloat16;
      quantize_acts(x.data_ptr<T>(), m, k, kp, block, a);
      if (bits == 4) q_linear_dispatch_scales<4, 32>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<T>());
      else if (block == 32) q_linear_dispatch_scales<8, 32>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<T>());
      else q_linear_dispatch_scales<8, 16>(a, m, codes, sc, off, n, kp, bp, out.data_ptr<T>());
    }));
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512");
#endif
  return out;
}

#if defined(PAGODA_Q_AVX512)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  // Round to nearest even (finite values: the weights are finite).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

// Rows of the dense weight, padded to kp columns: each 64-column register decoded once.
template <int BITS, int BLOCK, typename T>
void dequantize_rows(const uint8_t* codes, const float* sc, const float* off, int64_t n,
                     int64_t kp, T* out) {
  const int64_t nb = kp / BLOCK, row_bytes = kp * BITS / 8;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < kp; c += 64) {
      const __m512i q = load_codes<BITS>(codes + r * row_bytes + c * BITS / 8);
      for (int i = 0; i < 4; ++i) {
        const int64_t g = r * nb + (c + 16 * i) / BLOCK;
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, i)));
        store16(out + r * kp + c + 16 * i,
                _mm512_fmadd_ps(_mm512_set1_ps(sc[g]), qf, _mm512_set1_ps(off[g])));
      }
    }
  }
}
#endif

// The weight [N, K] in `dtype` (float32 or bfloat16): w = s * q + m (the GEMM path); a
// view of a [N, padded K] buffer when K is not a multiple of 64.
at::Tensor q_dequantize(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& off,
                        int64_t bits, int64_t block, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const at::Tensor scf = sc.to(at::kFloat).contiguous(), offf = off.to(at::kFloat).contiguous();
  const int64_t n = codes.size(0), kp = codes.size(1) * 8 / bits;
  TORCH_CHECK(kp % 64 == 0 && k <= kp && scf.size(1) == kp / block, "layout does not cover K = ", k);
  at::Tensor w = at::empty({n, kp}, codes.options().dtype(dtype));
#if defined(PAGODA_Q_AVX512)
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scf.data_ptr<float>(), *op = offf.data_ptr<float>();
  auto run = [&](auto* out) {
    if (bits == 4) dequantize_rows<4, 32>(cp, sp, op, n, kp, out);
    else if (block == 32) dequantize_rows<8, 32>(cp, sp, op, n, kp, out);
    else dequantize_rows<8, 16>(cp, sp, op, n, kp, out);
  };
  if (dtype == at::kFloat) run(w.data_ptr<float>());
  else run(w.data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512");
#endif
  return k == kp ? w : w.narrow(1, 0, k);
}

// W8A8: codes = int8 weight + 128 as uint8 [N, kp]; per-token scale s_t = max|x| / 127 (in
// double, at least 1e-12), x_q = round(x / s_t) in [-127, 127]; y = acc * s_t * scale[n].
at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) % 64 == 0 &&
                  x.size(1) <= codes.size(1), "codes must be uint8 [N, K padded to 64]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), kp = codes.size(1);
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  const at::Tensor sf = scales.to(at::kDouble).contiguous();
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#if defined(PAGODA_Q_AVX512)
  std::vector<int8_t> xq(m * kp, 0);
  std::vector<double> st(m);
  std::vector<int32_t> qsum(m, 0);
  const double* xp = xd.data_ptr<double>();
  for (int64_t r = 0; r < m; ++r) {
    double amax = 0.0;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(xp[r * k + i]));
    st[r] = std::max(amax / 127.0, 1e-12);
    for (int64_t i = 0; i < k; ++i) {
      const double q = std::clamp(std::nearbyint(xp[r * k + i] / st[r]), -127.0, 127.0);
      xq[r * kp + i] = static_cast<int8_t>(q);
      qsum[r] += static_cast<int32_t>(q);
    }
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const double* sp = sf.data_ptr<double>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      __m512i acc = _mm512_setzero_si512();
      for (int64_t c = 0; c < kp; c += 64) {
        acc = _mm512_add_epi32(acc, dot_u8s8(_mm512_loadu_si512(cp + j * kp + c),
                                             _mm512_loadu_si512(xq.data() + r * kp + c)));
      }
      const int64_t dot = static_cast<int64_t>(_mm512_reduce_add_epi32(acc)) - 128 * qsum[r];
      float y = static_cast<float>(static_cast<double>(dot) * st[r] * sp[j]);
      if (bp != nullptr) y += bp[j];
      op[r * n + j] = y;
    }
  }
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512");
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace pagoda_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q_linear", &pagoda_quant::q_linear, "x @ w.T for block-quantized codes (int8 activations)");
  m.def("q_dequantize", &pagoda_quant::q_dequantize, "the block-quantized weight as a dense matrix");
  m.def("i8_linear", &pagoda_quant::i8_linear, "W8A8 with a dynamic per-token activation scale");
  m.def("kernel_isa", [] { return std::map<std::string, std::vector<std::string>>{
      {"quant", pagoda_quant::quant_isa()}}; }, "op -> the /proc/cpuinfo flags its vector path uses");
}
