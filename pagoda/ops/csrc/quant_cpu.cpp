// Quantized-weight linear kernels for CPU (the wquant ops' fast path; see ops/quant_cpu.py
// and ops/quant_layouts.py, which builds the layout).
//
// One weight layout serves every format (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, group-wise
// GPTQ/AWQ/RTN codes): unsigned codes q (4 or 8 bits), one scale s and one offset per (row,
// group of `group` input columns): w = s * (q - z) ("zero form") or w = s * q + m. Rows are
// held in panels of 16 (N padded to a multiple of 16, K to a multiple of 64 with code 0):
// per panel and per 8 input columns c..c+7, 16 * BITS bytes in which byte 4 * r + j holds
// row r's codes of columns c + j (8-bit: the first 64 bytes; then c + 4 + j in the next 64)
// and, 4-bit, code(c + j) | code(c + 4 + j) << 4. So one 64-byte load gives, per int32 lane
// (= output row), four codes of consecutive columns: vpdpbusd against four activation
// bytes broadcast computes 16 output rows at once. Scales and offsets are [panels, G, 16]
// (panel by panel, as the codes: each thread's scales are one stream) or [G, padded N] (a
// loaded GPTQ/AWQ tensor kept as it is); 16 consecutive values are a panel's rows, float32
// or float16; zeros also uint8.
//
// q_linear quantizes each activation row to int8 per block of BLOCK columns (d = max|x| /
// 127, q = round-half-even(x * (1 / d))), then per (activation row, weight row, block):
// y += s * d * dot(q_w, q_x) + m * d * sum(q_x), m = -s * z in the zero form; the integer
// dot products with VNNI vpdpbusd (an exact AVX-512 BW madd sequence without VNNI). One
// decode of a weight register serves up to 4 activation rows; 2 panels (32 output rows)
// per task. One activation row (decode) instead: each thread an equal share of the panels,
// walked as two streams side by side (AVX-512; one on AVX2), each panel's halves in two
// accumulators, 4-bit codes prefetched ahead.
// Rounding: that of the activation int8 rounding, then float32 sums.
// i8_linear is W8A8 with a per-token scale, summed exactly in int32 and scaled in double,
// which reproduces wquant.int8_linear_reference bit for bit.
//
// Vector paths only: AVX-512 F/BW/VL where the build targets them, else AVX2 with FMA and
// F16C (the same arithmetic on 8-lane halves of each panel: the same bits); the Python side
// uses the reference elsewhere; quant_isa() reports what was compiled.

#include <torch/extension.h>
#include <torch/library.h>

#include <omp.h>

#include "q_gemv_abi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_Q_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_Q_AVX2 1
#endif
#if defined(PAGODA_Q_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define PAGODA_Q_AMX 1
#include "amx_tiles_cpu.h"
#endif
#if defined(PAGODA_Q_AVX512) || defined(PAGODA_Q_AVX2)
#define PAGODA_Q_VEC 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <limits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace pagoda_quant {

constexpr int64_t kPanel = 16;  // output rows per panel: one int32 lane each
constexpr int kRowTile = 4;     // activation rows sharing one decode of the weight codes
// NOTE: bytes ahead of each panel's 4-bit codes to prefetch: one core's few panel streams
// do not keep enough cache-line reads in flight on their own (the tied Q4_1 576 x 49152
// from DRAM on one core: 0.72 ms without, 0.62 ms at 2 KiB). 8-bit codes (two loads per
// 8 columns) ran no faster with it at any distance tried (512 B to 2 KiB): none there.
constexpr int kPrefetch4 = 2048;
constexpr int64_t kChunkBytes = 256 << 10;  // at most this many bytes of int8 rows a chunk
constexpr int64_t kScaleAhead = 4;  // panels ahead of a single row's scale prefetch

enum Kind : int { kF32 = 0, kF16 = 1, kU8 = 2 };

inline int64_t kind_bytes(int kind) { return kind == kF32 ? 4 : kind == kF16 ? 2 : 1; }

struct Weights {
  const uint8_t* codes;
  int64_t panel_bytes;
  const void* sc;
  const void* off;
  int sc_kind;
  int off_kind;
  bool zero_form;
  int64_t np;      // padded N
  int64_t groups;  // G
  int64_t bpg;     // activation blocks per group (all of them when G == 1)
  int64_t sg;      // scale / offset elements from one group to the next: 16 or padded N
  int64_t sp;      // ... from one panel to the next: 16 * G or 16
};

// Where the scale (and offset) of group g, row `row` is: a panel's 16 rows are always
// side by side, the panels and groups in either order (see checked_weights).
inline int64_t sc_at(const Weights& w, int64_t g, int64_t row) {
  return g * w.sg + (row / kPanel) * w.sp + row % kPanel;
}

std::vector<std::string> quant_isa() {
  std::vector<std::string> isa;
#if defined(PAGODA_Q_AVX512)
  isa.insert(isa.end(), {"avx512f", "avx512bw", "avx512vl"});
#if defined(__AVX512VNNI__)
  isa.push_back("avx512_vnni");
#endif
#elif defined(PAGODA_Q_AVX2)
  isa.insert(isa.end(), {"avx2", "fma", "f16c"});
#if defined(__AVXVNNI__)
  isa.push_back("avx_vnni");
#endif
#endif
  return isa;
}

#if defined(PAGODA_Q_VEC)

// row(r) for r in [0, m): in parallel for a large batch only. NOTE: a parallel region costs
// more than quantizing a few rows (tens of microseconds a wake-up when the cores are
// shared), and a single row is quantized inside the caller's region (q_gemv_part), where a
// nested region of one thread would still cost its set-up.
template <typename Fn>
inline void for_rows(int64_t m, int64_t kp, Fn&& row) {
  if (m * kp >= (1 << 17)) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) row(r);
  } else {
    for (int64_t r = 0; r < m; ++r) row(r);
  }
}

// Activations quantized to int8 per block: q [m, kp] (zero past K), d and d * sum(q) [m, nb].
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dsum;
  int64_t kp = 0;
  int64_t nb = 0;
};

// One value of a scale or offset tensor (index: sc_at), as float32.
inline float load1(const void* base, int kind, int64_t idx) {
  if (kind == kF32) return static_cast<const float*>(base)[idx];
  if (kind == kF16) return _cvtsh_ss(static_cast<const uint16_t*>(base)[idx]);
  return static_cast<float>(static_cast<const uint8_t*>(base)[idx]);
}

// The code of column c of row `lane` of a panel (the panel layout above).
template <int BITS>
inline int code_at(const uint8_t* panel, int64_t lane, int64_t c) {
  const int64_t j = c % 8;
  if constexpr (BITS == 8) return panel[(c / 8) * 128 + (j >= 4 ? 64 : 0) + 4 * lane + j % 4];
  const uint8_t b = panel[(c / 8) * 64 + 4 * lane + j % 4];
  return j >= 4 ? b >> 4 : b & 0x0F;
}

#endif  // PAGODA_Q_VEC

#if defined(PAGODA_Q_AVX512)

// The drivers' tiling below, in panels: 2 per task of a many-row product, 1 per tile of a
// single-row one.
// NOTE (measured, SmolLM2's 120 Q4_1 layer GEMVs from DRAM, 2-core Zen 4, paired in one
// process): one panel at a time is one sequential stream of codes per thread, which the
// hardware prefetcher follows, and took 0.93x the time of four panels side by side (four
// short streams: a panel is ~4.6 KiB at K = 576); with the next panels' scales prefetched
// (below) 0.77-0.86x.
constexpr int64_t kTileRows = kPanel;
constexpr int kTaskTiles = 2;
constexpr int kGemvTiles = 1;

inline __m512 load_x16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load_x16(const at::BFloat16* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __mmask16 first_lanes(int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

template <typename T>
void quantize_acts(const T* x, int64_t m, int64_t k, int64_t kp, int64_t block, QuantActs& a) {
  const int64_t nb = kp / block;
  a.kp = kp;
  a.nb = nb;
  a.q.assign(m * kp, 0);
  a.d.assign(m * nb, 0.f);
  a.dsum.assign(m * nb, 0.f);
  const int nv = static_cast<int>(block / 16);
  auto row = [&](int64_t r) {
    for (int64_t b = 0; b < nb && b * block < k; ++b) {
      const int64_t k0 = b * block;
      __m512 v[2];
      __m512 vmax = _mm512_setzero_ps();
      for (int j = 0; j < nv; ++j) {
        v[j] = load_x16(x + r * k + k0 + 16 * j, first_lanes(k - k0 - 16 * j));
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[j]));
      }
      const float d = _mm512_reduce_max_ps(vmax) / 127.f;
      const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < nv; ++j) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], id));  // MXCSR: half-even
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + r * kp + k0 + 16 * j),
                         _mm512_cvtepi32_epi8(q));
      }
      a.d[r * nb + b] = d;
      a.dsum[r * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  };
  for_rows(m, kp, row);
}

// acc + per int32 lane the sum over its 4 bytes of u8 a times s8 b (exact either way).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  // NOTE: vpmaddubsw saturates (255 * 127 * 2 > 32767), so split bytes into 16-bit halves.
  const __m512i lo8 = _mm512_set1_epi16(0x00FF);
  const __m512i a_even = _mm512_and_si512(a, lo8), a_odd = _mm512_srli_epi16(a, 8);
  const __m512i b_even = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
  const __m512i b_odd = _mm512_srai_epi16(b, 8);
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(a_even, b_even),
                                                _mm512_madd_epi16(a_odd, b_odd)));
#endif
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 consecutive values of a scale or offset tensor (a panel's rows), as float32.
inline __m512 load16(const void* base, int kind, int64_t idx) {
  if (kind == kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + idx);
  if (kind == kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + idx)));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + idx))));
}


// Group g's scales s and offsets m (w = s * q + m; m = -s * z in the zero form) of the 16
// rows of the panel that starts at output row `row`.
inline void panel_scale_offset(const Weights& w, int64_t g, int64_t row, __m512& s, __m512& m) {
  const int64_t idx = sc_at(w, g, row);
  s = load16(w.sc, w.sc_kind, idx);
  const __m512 o = load16(w.off, w.off_kind, idx);
  m = w.zero_form ? _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), s), o) : o;
}

// The two code registers of 8 columns of one panel: columns c..c+3 and c+4..c+7.
template <int BITS>
inline void decode8(const uint8_t* p, __m512i& w0, __m512i& w1) {
  if constexpr (BITS == 4) {
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    w0 = _mm512_and_si512(v, mask);
    w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  } else {
    w0 = _mm512_loadu_si512(p);
    w1 = _mm512_loadu_si512(p + 64);
  }
}

// acc[i][p]: activation row row0 + i times the 16 rows of panel panel0 + p.
// Its panels are panel0 + p * stride: adjacent (1), or one in each of P streams (a single
// row's share walked side by side, q_gemv_share). Each panel's arithmetic is its own, in the
// same order whatever P and stride: the same bits.
template <int BITS, int BLOCK, int R, int P>
inline void tile(const Weights& w, int64_t panel0, const QuantActs& a, int64_t row0,
                 __m512 (&acc)[R][P], int64_t stride = 1) {
  // NOTE: one activation row leaves only P chains of dependent vpdpbusd (latency-bound):
  // the columns c..c+3 and c+4..c+7 then sum into two accumulators, added per block.
  constexpr bool kSplit = R == 1;
  const uint8_t* cp[P];
  for (int p = 0; p < P; ++p) {
    cp[p] = w.codes + (panel0 + p * stride) * w.panel_bytes;
    for (int i = 0; i < R; ++i) acc[i][p] = _mm512_setzero_ps();
  }
  const int64_t nb = a.nb, kp = a.kp;
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 s[P], m[P];
    for (int p = 0; p < P; ++p) {
      panel_scale_offset(w, g, (panel0 + p * stride) * kPanel, s[p], m[p]);
    }
    const int64_t b1 = g + 1 == w.groups ? nb : std::min(nb, (g + 1) * w.bpg);
    if constexpr (R == 1) {
      // NOTE: a single row streams its codes faster than [G, N] scales' rows arrive on
      // demand (one line per group, N values apart, ahead of any hardware prefetch): ask
      // for this group's scales and offsets of the panels kScaleAhead further on (in each
      // stream). Scales stored panel by panel are a stream of their own, which the
      // prefetcher follows.
      // Adjacent panels are one stream of P panels; strided ones, P streams of one.
      const int streams = stride == 1 ? 1 : P;
      const int64_t span = stride == 1 ? P : 1;
      for (int p = 0; w.sp == kPanel && p < streams; ++p) {
        const int64_t ahead_panel = panel0 + p * stride + span + kScaleAhead - 1;
        if (ahead_panel < w.np / kPanel) {
          const int64_t ahead = sc_at(w, g, ahead_panel * kPanel);
          _mm_prefetch(static_cast<const char*>(w.sc) + ahead * kind_bytes(w.sc_kind), _MM_HINT_T0);
          _mm_prefetch(static_cast<const char*>(w.off) + ahead * kind_bytes(w.off_kind), _MM_HINT_T0);
        }
      }
    }
    for (int64_t b = g * w.bpg; b < b1; ++b) {
      __m512i iacc[R][P], jacc[R][P];
      for (int i = 0; i < R; ++i)
        for (int p = 0; p < P; ++p) iacc[i][p] = jacc[i][p] = _mm512_setzero_si512();
      for (int c = 0; c < BLOCK; c += 8) {
        const int64_t col = b * BLOCK + c;
        __m512i w0[P], w1[P];
        // NOTE: single rows only: a tile of several rows is compute-bound, and there the
        // prefetches only cost time (docs/quantization.md).
        if constexpr (BITS == 4 && R == 1) {
          for (int p = 0; p < P; ++p) {
            const char* ahead = reinterpret_cast<const char*>(cp[p] + col * 8) + kPrefetch4;
            _mm_prefetch(ahead, _MM_HINT_T0);
          }
        }
        for (int p = 0; p < P; ++p) decode8<BITS>(cp[p] + col * 2 * BITS, w0[p], w1[p]);
        for (int i = 0; i < R; ++i) {
          const int8_t* xp = a.q.data() + (row0 + i) * kp + col;
          const __m512i x0 = bcast4(xp), x1 = bcast4(xp + 4);
          for (int p = 0; p < P; ++p) {
            iacc[i][p] = dpbusd(iacc[i][p], w0[p], x0);
            if constexpr (kSplit) jacc[i][p] = dpbusd(jacc[i][p], w1[p], x1);
            else iacc[i][p] = dpbusd(iacc[i][p], w1[p], x1);
          }
        }
      }
      if constexpr (kSplit) {
        for (int p = 0; p < P; ++p) iacc[0][p] = _mm512_add_epi32(iacc[0][p], jacc[0][p]);
      }
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(a.d[(row0 + i) * nb + b]);
        const __m512 ds = _mm512_set1_ps(a.dsum[(row0 + i) * nb + b]);
        for (int p = 0; p < P; ++p) {
          acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][p]), _mm512_mul_ps(s[p], d), acc[i][p]);
          acc[i][p] = _mm512_fmadd_ps(m[p], ds, acc[i][p]);
        }
      }
    }
  }
}

inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  // Round to nearest even (finite values).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  return _mm512_cvtepi32_epi16(r);
#endif
}

struct Output {
  void* data;
  bool bf16;
  int64_t n;
  const float* bias;
};

template <int BITS, int BLOCK, int R, int P>
void run_tile(const Weights& w, const QuantActs& a, int64_t row0, int64_t panel0, const Output& o,
              int64_t stride = 1) {
  __m512 acc[R][P];
  tile<BITS, BLOCK, R, P>(w, panel0, a, row0, acc, stride);
  for (int p = 0; p < P; ++p) {
    const int64_t col0 = (panel0 + p * stride) * kPanel;
    const __mmask16 mask = first_lanes(o.n - col0);
    if (mask == 0) continue;
    const __m512 bias = o.bias != nullptr ? _mm512_maskz_loadu_ps(mask, o.bias + col0) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 y = _mm512_add_ps(acc[i][p], bias);
      const int64_t at = (row0 + i) * o.n + col0;
      if (o.bf16) {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.data) + at, mask, to_bf16(y));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(o.data) + at, mask, y);
      }
    }
  }
}

// Rows [t0, t0 + tn) of the layout (t0 a multiple of 16) dequantized and transposed into
// wt [K, tn] bf16: w = s * q + m in float32 (m = -s * z), rounded once to bf16.
template <int BITS>
void dequant_t(const Weights& w, int64_t group, int64_t k, int64_t t0, int64_t tn, uint16_t* wt) {
  const __m512i lo8 = _mm512_set1_epi32(0xFF);
#pragma omp parallel for schedule(static)
  for (int64_t p = t0 / kPanel; p < (t0 + tn + kPanel - 1) / kPanel; ++p) {
    const uint8_t* cp = w.codes + p * w.panel_bytes;
    const int64_t col0 = p * kPanel - t0;
    const __mmask16 mask = first_lanes(tn - col0);
    __m512 s = _mm512_setzero_ps(), m = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 8) {
      if (c % group == 0) panel_scale_offset(w, w.groups == 1 ? 0 : c / group, p * kPanel, s, m);
      __m512i v[2];
      decode8<BITS>(cp + c * 2 * BITS, v[0], v[1]);
      for (int j = 0; j < 8 && c + j < k; ++j) {
        const __m512i q = _mm512_and_si512(
            _mm512_srlv_epi32(v[j >> 2], _mm512_set1_epi32(8 * (j & 3))), lo8);
        const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, m);
        _mm256_mask_storeu_epi16(wt + (c + j) * tn + col0, mask, to_bf16(y));
      }
    }
  }
}

// Row `row` of the weight into out (k values): 16 columns at a time, each operation rounded
// on its own (explicit-rounding intrinsics: never contracted into an FMA), as the layout's
// reference computes it.
template <int BITS>
void dequant_row(const Weights& w, int64_t group, int64_t k, int64_t row, void* out, bool bf16) {
  const uint8_t* panel = w.codes + (row / kPanel) * w.panel_bytes;
  const int64_t lane = row % kPanel;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t c0 = 0; c0 < k; c0 += 16) {
    alignas(64) float q[16] = {}, s[16] = {}, o[16] = {};
    for (int64_t j = 0; j < 16 && c0 + j < k; ++j) {
      const int64_t idx = sc_at(w, w.groups == 1 ? 0 : (c0 + j) / group, row);
      q[j] = static_cast<float>(code_at<BITS>(panel, lane, c0 + j));
      s[j] = load1(w.sc, w.sc_kind, idx);
      o[j] = load1(w.off, w.off_kind, idx);
    }
    const __m512 vq = _mm512_load_ps(q), vs = _mm512_load_ps(s), vo = _mm512_load_ps(o);
    const __m512 y = w.zero_form
        ? _mm512_mul_round_ps(_mm512_sub_round_ps(vq, vo, kRound), vs, kRound)
        : _mm512_add_round_ps(_mm512_mul_round_ps(vs, vq, kRound), vo, kRound);
    const __mmask16 mask = first_lanes(k - c0);
    if (bf16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + c0, mask, to_bf16(y));
    else _mm512_mask_storeu_ps(static_cast<float*>(out) + c0, mask, y);
  }
}

// u8 codes times s8 activations, summed exactly per int32 lane (kp a multiple of 64).
inline int32_t i8_dot(const uint8_t* w, const int8_t* x, int64_t kp) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t c = 0; c < kp; c += 64) {
    acc = dpbusd(acc, _mm512_loadu_si512(w + c), _mm512_loadu_si512(x + c));
  }
  return _mm512_reduce_add_epi32(acc);
}

#elif defined(PAGODA_Q_AVX2)

// The same kernels in 256-bit registers. A panel's 16 rows are two units of 8 (its int32
// lanes 0-7 and 8-15: the low and high 32 bytes of each 64-byte group), and each unit does
// per lane what the AVX-512 path does per lane, in the same order: the integer dot products
// are exact either way, and the float steps are the same operations, so both paths give the
// same bits.

constexpr int kUnit = 8;  // output rows per unit: one int32 lane each
// The drivers' tiling below: a task of a many-row product is one panel (2 units); a
// single-row tile is one panel too (2 units: one sequential stream of codes, as on AVX-512,
// and few enough live registers for AVX2's 16; 4 units spilled its accumulators).
constexpr int64_t kTileRows = kUnit;
constexpr int kTaskTiles = 2;
constexpr int kGemvTiles = 2;

inline __m256 load_x8(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  if (count > 0) std::memcpy(t, p, count * sizeof(float));
  return _mm256_load_ps(t);
}

inline __m256 load_x8(const at::BFloat16* p, int64_t count) {
  __m128i raw;
  if (count >= 8) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {};
    if (count > 0) std::memcpy(t, p, count * sizeof(uint16_t));
    raw = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <typename T>
void quantize_acts(const T* x, int64_t m, int64_t k, int64_t kp, int64_t block, QuantActs& a) {
  const int64_t nb = kp / block;
  a.kp = kp;
  a.nb = nb;
  a.q.assign(m * kp, 0);
  a.d.assign(m * nb, 0.f);
  a.dsum.assign(m * nb, 0.f);
  const int nv = static_cast<int>(block / 8);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  auto row = [&](int64_t r) {
    for (int64_t b = 0; b < nb && b * block < k; ++b) {
      const int64_t k0 = b * block;
      __m256 v[4];
      __m256 vmax = _mm256_setzero_ps();
      for (int j = 0; j < nv; ++j) {
        v[j] = load_x8(x + r * k + k0 + 8 * j, k - k0 - 8 * j);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[j], abs_mask));
      }
      const float d = hmax8(vmax) / 127.f;
      const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < nv; ++j) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // MXCSR: half-even
        sum = _mm256_add_epi32(sum, q);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(a.q.data() + r * kp + k0 + 8 * j),
                         _mm_packs_epi16(q16, q16));
      }
      a.d[r * nb + b] = d;
      a.dsum[r * nb + b] = d * static_cast<float>(hsum8(sum));
    }
  };
  for_rows(m, kp, row);
}

// acc + per int32 lane the sum over its 4 bytes of u8 a times s8 b (exact, no saturation).
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  const __m256i lo8 = _mm256_set1_epi16(0x00FF);
  const __m256i a_even = _mm256_and_si256(a, lo8), a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
  const __m256i b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even),
                                                _mm256_madd_epi16(a_odd, b_odd)));
#endif
}

// 8 consecutive values of a scale or offset tensor (a unit's rows), as float32.
inline __m256 load8(const void* base, int kind, int64_t idx) {
  if (kind == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
  if (kind == kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx)));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + idx))));
}

// The first code byte of unit `unit` (8 rows): its panel's bytes, the high half for odd units.
inline const uint8_t* unit_codes(const Weights& w, int64_t unit) {
  return w.codes + (unit >> 1) * w.panel_bytes + 32 * (unit & 1);
}

// acc[i][u]: activation row row0 + i times the 8 rows of unit unit0 + u.
template <int BITS, int BLOCK, int R, int U>
inline void tile(const Weights& w, int64_t unit0, const QuantActs& a, int64_t row0,
                 __m256 (&acc)[R][U]) {
  const uint8_t* cp[U];
  for (int u = 0; u < U; ++u) {
    cp[u] = unit_codes(w, unit0 + u);
    for (int i = 0; i < R; ++i) acc[i][u] = _mm256_setzero_ps();
  }
  const int64_t nb = a.nb, kp = a.kp;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 s[U], m[U];
    for (int u = 0; u < U; ++u) {
      const int64_t idx = sc_at(w, g, (unit0 + u) * kUnit);
      s[u] = load8(w.sc, w.sc_kind, idx);
      const __m256 o = load8(w.off, w.off_kind, idx);
      m[u] = w.zero_form ? _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), s[u]), o) : o;
    }
    const int64_t b1 = g + 1 == w.groups ? nb : std::min(nb, (g + 1) * w.bpg);
    for (int64_t b = g * w.bpg; b < b1; ++b) {
      // NOTE: 4-bit codes times int8 activations are at most 15 * 127 per byte pair, so
      // vpmaddubsw cannot saturate, and a whole block (8 of its pair sums, <= 30,480) adds up
      // in 16-bit lanes before one vpmaddwd widens it: that halves the instructions per code.
      __m256i iacc[R][U];
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) iacc[i][u] = _mm256_setzero_si256();
      for (int c = 0; c < BLOCK; c += 8) {
        const int64_t col = b * BLOCK + c;
        __m256i w0[U], w1[U];
        if constexpr (BITS == 4 && R == 1) {
          for (int u = 0; u < U; u += 2) {
            _mm_prefetch(reinterpret_cast<const char*>(cp[u] + col * 8) + kPrefetch4, _MM_HINT_T0);
          }
        }
        for (int u = 0; u < U; ++u) {
          if constexpr (BITS == 4) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp[u] + col * 8));
            w0[u] = _mm256_and_si256(v, nib);
            w1[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          } else {
            w0[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp[u] + col * 16));
            w1[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp[u] + col * 16 + 64));
          }
        }
        for (int i = 0; i < R; ++i) {
          const int8_t* xp = a.q.data() + (row0 + i) * kp + col;
          int32_t x0, x1;
          std::memcpy(&x0, xp, 4);
          std::memcpy(&x1, xp + 4, 4);
          const __m256i bx0 = _mm256_set1_epi32(x0), bx1 = _mm256_set1_epi32(x1);
          for (int u = 0; u < U; ++u) {
#if defined(__AVXVNNI__)
            iacc[i][u] = _mm256_dpbusd_avx_epi32(iacc[i][u], w0[u], bx0);
            iacc[i][u] = _mm256_dpbusd_avx_epi32(iacc[i][u], w1[u], bx1);
#else
            if constexpr (BITS == 4) {
              iacc[i][u] = _mm256_add_epi16(iacc[i][u], _mm256_add_epi16(
                  _mm256_maddubs_epi16(w0[u], bx0), _mm256_maddubs_epi16(w1[u], bx1)));
            } else {
              iacc[i][u] = dpbusd(dpbusd(iacc[i][u], w0[u], bx0), w1[u], bx1);
            }
#endif
          }
        }
      }
      for (int i = 0; i < R; ++i) {
        const __m256 d = _mm256_set1_ps(a.d[(row0 + i) * nb + b]);
        const __m256 ds = _mm256_set1_ps(a.dsum[(row0 + i) * nb + b]);
        for (int u = 0; u < U; ++u) {
          __m256i dot = iacc[i][u];
#if !defined(__AVXVNNI__)
          if constexpr (BITS == 4) dot = _mm256_madd_epi16(dot, ones16);
#endif
          acc[i][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s[u], d), acc[i][u]);
          acc[i][u] = _mm256_fmadd_ps(m[u], ds, acc[i][u]);
        }
      }
    }
  }
  (void)ones16;
}

// 8 float32 -> bf16 bits, round to nearest even (finite values), as the AVX-512 path.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The first `count` (<= 8) values of y into dst (float32 or bf16).
inline void store8(void* dst, bool bf16, __m256 y, int64_t count) {
  if (bf16) {
    const __m128i h = to_bf16(y);
    if (count >= 8) {
      _mm_storeu_si128(static_cast<__m128i*>(dst), h);
    } else {
      alignas(16) uint16_t t[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
      std::memcpy(dst, t, count * sizeof(uint16_t));
    }
  } else if (count >= 8) {
    _mm256_storeu_ps(static_cast<float*>(dst), y);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, y);
    std::memcpy(dst, t, count * sizeof(float));
  }
}

struct Output {
  void* data;
  bool bf16;
  int64_t n;
  const float* bias;
};

template <int BITS, int BLOCK, int R, int U>
void run_tile(const Weights& w, const QuantActs& a, int64_t row0, int64_t unit0, const Output& o) {
  __m256 acc[R][U];
  tile<BITS, BLOCK, R, U>(w, unit0, a, row0, acc);
  const int64_t esize = o.bf16 ? 2 : 4;
  for (int u = 0; u < U; ++u) {
    const int64_t col0 = (unit0 + u) * kUnit;
    const int64_t count = std::min<int64_t>(kUnit, o.n - col0);
    if (count <= 0) continue;
    const __m256 bias = o.bias != nullptr ? load_x8(o.bias + col0, count) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const int64_t at = (row0 + i) * o.n + col0;
      store8(static_cast<char*>(o.data) + at * esize, o.bf16, _mm256_add_ps(acc[i][u], bias), count);
    }
  }
}

// Portable forms of the two dequantizations (a token table's lookups and the wide
// tiled product): scalar loops, with the AVX-512 path's roundings (one fma for dequant_t,
// each operation rounded on its own for dequant_row, which is built without contraction).
template <int BITS>
void dequant_t(const Weights& w, int64_t group, int64_t k, int64_t t0, int64_t tn, uint16_t* wt) {
#pragma omp parallel for schedule(static)
  for (int64_t row = t0; row < t0 + tn; ++row) {
    const uint8_t* panel = w.codes + (row / kPanel) * w.panel_bytes;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t idx = sc_at(w, w.groups == 1 ? 0 : c / group, row);
      const float s = load1(w.sc, w.sc_kind, idx), o = load1(w.off, w.off_kind, idx);
      const float m = w.zero_form ? (0.f - s) * o : o;
      const float y = std::fma(static_cast<float>(code_at<BITS>(panel, row % kPanel, c)), s, m);
      wt[c * tn + (row - t0)] = c10::BFloat16(y).x;
    }
  }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // s * q + o: two roundings, as the reference
template <int BITS>
void dequant_row(const Weights& w, int64_t group, int64_t k, int64_t row, void* out, bool bf16) {
  const uint8_t* panel = w.codes + (row / kPanel) * w.panel_bytes;
  for (int64_t c = 0; c < k; ++c) {
    const int64_t idx = sc_at(w, w.groups == 1 ? 0 : c / group, row);
    const float q = static_cast<float>(code_at<BITS>(panel, row % kPanel, c));
    const float s = load1(w.sc, w.sc_kind, idx), o = load1(w.off, w.off_kind, idx);
    const float y = w.zero_form ? (q - o) * s : s * q + o;
    if (bf16) static_cast<uint16_t*>(out)[c] = c10::BFloat16(y).x;
    else static_cast<float*>(out)[c] = y;
  }
}
#pragma GCC pop_options

inline int32_t i8_dot(const uint8_t* w, const int8_t* x, int64_t kp) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t c = 0; c < kp; c += 32) {
    acc = dpbusd(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c)),
                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c)));
  }
  return hsum8(acc);
}

#endif  // PAGODA_Q_AVX512 / PAGODA_Q_AVX2

#if defined(PAGODA_Q_VEC)

// The drivers of either path: run_tile<BITS, BLOCK, R, P> computes R activation rows times P
// tiles of kTileRows output rows (AVX-512: panels; AVX2: units of 8 rows, half a panel).
template <int BITS, int BLOCK, int P>
void run_rows(int rows, const Weights& w, const QuantActs& a, int64_t row0, int64_t tile0,
              const Output& o) {
  switch (rows) {
    case 4: run_tile<BITS, BLOCK, 4, P>(w, a, row0, tile0, o); break;
    case 3: run_tile<BITS, BLOCK, 3, P>(w, a, row0, tile0, o); break;
    case 2: run_tile<BITS, BLOCK, 2, P>(w, a, row0, tile0, o); break;
    default: run_tile<BITS, BLOCK, 1, P>(w, a, row0, tile0, o); break;
  }
}

// AVX-512: a single row's share is walked as this many streams side by side (1 to 4;
// set_gemv_streams), each a contiguous run of its panels. NOTE: one stream a core left the
// memory idle between the core's misses; two kept more reads in flight (the head 0.80-0.84x
// of the time on a Zen 4) where three and four gained nothing (docs/architecture.md,
// session 37).
#if defined(PAGODA_Q_AVX512)
inline std::atomic<int> g_gemv_streams{2};
#endif

// One activation row (decode): each thread takes an equal contiguous share of the tiles,
// kGemvTiles at a time (one panel on either path), as g_gemv_streams sequential streams of
// codes on AVX-512 (its last count % streams panels, and shares shorter than two panels a
// stream, after them as one), one on AVX2 (whose 16 registers hold one panel's).
template <int BITS, int BLOCK>
void q_gemv_share(const Weights& w, const QuantActs& a, const Output& o, int64_t tid,
                  int64_t nth) {
  // NOTE: shares are whole panels (a panel is kGemvTiles tiles), counted in panels.
  static_assert(kPanel / kTileRows == kGemvTiles, "a single-row tile is one panel");
  const int64_t panels = w.np / kPanel;
  const int64_t end = panels * (tid + 1) / nth * kGemvTiles;
  int64_t begin = panels * tid / nth * kGemvTiles;
#if defined(PAGODA_Q_AVX512)
  const int streams = g_gemv_streams.load(std::memory_order_relaxed);
  if (streams > 1 && end - begin >= 2 * streams) {
    const int64_t run = (end - begin) / streams;
    for (int64_t j = 0; j < run; ++j) {
      if (streams == 2) run_tile<BITS, BLOCK, 1, 2>(w, a, 0, begin + j, o, run);
      else if (streams == 3) run_tile<BITS, BLOCK, 1, 3>(w, a, 0, begin + j, o, run);
      else run_tile<BITS, BLOCK, 1, 4>(w, a, 0, begin + j, o, run);
    }
    begin += run * streams;
  }
#endif
  for (int64_t p = begin; p < end; p += kGemvTiles) {
    run_tile<BITS, BLOCK, 1, kGemvTiles>(w, a, 0, p, o);
  }
}

template <int BITS, int BLOCK>
void q_gemv(const Weights& w, const QuantActs& a, const Output& o) {
#pragma omp parallel
  q_gemv_share<BITS, BLOCK>(w, a, o, omp_get_thread_num(), omp_get_num_threads());
}

template <int BITS, int BLOCK>
void q_linear_impl(const Weights& w, const QuantActs& a, int64_t m, const Output& o) {
  static_assert(kTaskTiles == 2, "a task is a pair of tiles, or one at an odd end");
  if (m == 1) {
    q_gemv<BITS, BLOCK>(w, a, o);
    return;
  }
  const int64_t tiles = w.np / kTileRows;
  const int64_t tasks = (tiles + kTaskTiles - 1) / kTaskTiles;
  // NOTE: every task reads all the chunk's activation rows: chunks of them small enough to
  // stay in L2 (else hundreds of rows stream from L3 once per panel pair), and of equal
  // size: the static schedule below gives each thread a run of (chunk, task) pairs, so a
  // short last chunk left one thread most of the work (docs/quantization.md).
  const int64_t max_rows = std::max<int64_t>(kRowTile, kChunkBytes / a.kp / kRowTile * kRowTile);
  const int64_t wanted = (m + max_rows - 1) / max_rows;
  const int64_t chunk_rows = ((m + wanted - 1) / wanted + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t p0 = t * kTaskTiles, r1 = std::min(m, (c + 1) * chunk_rows);
      const bool pair = p0 + 1 < tiles;  // NOTE: always, in AVX2 units (2 per panel)
      for (int64_t r = c * chunk_rows; r < r1; r += kRowTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowTile, r1 - r));
        if (pair) run_rows<BITS, BLOCK, 2>(rows, w, a, r, p0, o);
        else run_rows<BITS, BLOCK, 1>(rows, w, a, r, p0, o);
      }
    }
  }
}

#endif  // PAGODA_Q_VEC

int kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kByte: return kU8;
    default: TORCH_CHECK(false, "scales and offsets must be float32, float16 or uint8");
  }
  return kF32;
}

// The layout's tensors checked against x [M, K] (and n), as the kernels read them.
Weights checked_weights(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                        const at::Tensor& off, int64_t bits, int64_t block, int64_t group,
                        bool zero_form, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK((bits == 4 && block == 32) || (bits == 8 && (block == 32 || block == 16)),
              "unsupported (bits, block) = (", bits, ", ", block, ")");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be a contiguous uint8 [panels, panel bytes]");
  const int64_t kp = codes.size(1) / (2 * bits), np = codes.size(0) * kPanel;
  TORCH_CHECK(kp % 64 == 0 && kp * 2 * bits == codes.size(1) && x.size(1) <= kp,
              "codes cover ", kp, " columns, x has ", x.size(1));
  TORCH_CHECK(n <= np && n > np - kPanel, "n = ", n, " does not match ", np, " padded rows");
  // Scales and offsets: [G, padded N] (group by group) or [panels, G, 16] (panel by panel).
  const bool by_panel = sc.dim() == 3;
  TORCH_CHECK(((sc.dim() == 2 && sc.size(1) == np) ||
               (by_panel && sc.size(0) == np / kPanel && sc.size(2) == kPanel)) &&
                  off.sizes() == sc.sizes() && sc.is_contiguous() && off.is_contiguous(),
              "scales and offsets must be contiguous [G, ", np, "] or [", np / kPanel,
              ", G, 16]");
  const int sc_kind = kind_of(sc), off_kind = kind_of(off);
  TORCH_CHECK(sc_kind != kU8 && (zero_form || off_kind != kU8),
              "scales must be float; uint8 offsets only as zeros");
  const int64_t groups = sc.size(by_panel ? 1 : 0), nb = kp / block;
  TORCH_CHECK(groups >= 1 && (groups == 1 || (group % block == 0 && (groups - 1) * group < kp &&
                                              groups * group >= x.size(1))),
              "groups of ", group, " columns do not fit blocks of ", block);
  return Weights{codes.data_ptr<uint8_t>(), codes.size(1), sc.data_ptr(), off.data_ptr(),
                 sc_kind, off_kind, zero_form, np, groups, groups == 1 ? nb : group / block,
                 by_panel ? kPanel : np, by_panel ? kPanel * groups : kPanel};
}

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements");
  return bias->to(at::kFloat).contiguous();
}

// The same product through a bf16 GEMM: per tile of `tile` output rows (a multiple of 16),
// the weights dequantized into a bf16 scratch [K, tile] (w = s * q + m in float32, one
// rounding to bf16), then x @ scratch (+ bias) by ATen's bf16 GEMM (oneDNN: AMX tiles where
// the CPU has them). q_linear runs it from `wide_min_rows` rows; one tile covering N writes
// `out` directly.
at::Tensor q_linear_tiles(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                          const at::Tensor& off, int64_t bits, int64_t block, int64_t group,
                          bool zero_form, int64_t n, const c10::optional<at::Tensor>& bias,
                          int64_t tile) {
  const Weights w = checked_weights(x, codes, sc, off, bits, block, group, zero_form, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tile > 0 && (tile % kPanel == 0 || tile >= n),
              "the tiled path takes bf16 x and tiles of whole panels (or one covering n)");
  const at::Tensor b = float_bias(bias, n);
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(PAGODA_Q_VEC)
  at::Tensor scratch = at::empty({k * std::min(tile, n)}, x.options());
  const at::Tensor b16 = b.defined() ? b.to(at::kBFloat16) : b;
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t tn = std::min(tile, n - t0);
    at::Tensor wt = scratch.narrow(0, 0, k * tn).view({k, tn});
    auto* dst = reinterpret_cast<uint16_t*>(wt.data_ptr<at::BFloat16>());
    if (bits == 4) dequant_t<4>(w, group, k, t0, tn, dst);
    else dequant_t<8>(w, group, k, t0, tn, dst);
    if (tn == n) {
      if (b16.defined()) at::addmm_out(out, b16, x, wt);
      else at::mm_out(out, x, wt);
    } else {
      at::Tensor y = b16.defined() ? at::addmm(b16.narrow(0, t0, tn), x, wt) : at::mm(x, wt);
      out.narrow(1, t0, tn).copy_(y);
    }
  }
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512 or AVX2");
#endif
  return out;
}

// The same product on AMX tiles without a dequantized copy in memory: per panel (16 output
// rows), its codes dequantized (w = s * q + m in float32, one rounding to bf16, as
// dequant_t) into a per-thread buffer in the B-tile layout of TDPBF16PS (a tile row holds
// input columns 2i and 2i + 1 of the 16 output rows, interleaved), then for every 16
// activation rows and 32 input columns one TDPBF16PS into a 16 x 16 float32 tile. The codes
// are read once per call whatever the row count, so a decode step's 16-256 rows cost about
// the weight's dequantization, not the int8 panel kernel's per-row work. Each output sums
// its 32-column blocks in one order, whatever M is: a row's result does not depend on the
// other rows of the call. The bias is added in float32 before the rounding to bf16.
// Blocking: two row tiles x two panels (tiles 0-3 accumulators, 2 * row tile + panel; 4-5
// activations; 6-7 weights); the next panel pair is dequantized between the current pair's
// row tiles; rows run in chunks that stay in L2 (kAmxChunkBytes); x is read in place where
// its rows are whole tiles already (K a multiple of 64).
#if defined(PAGODA_Q_AMX)
constexpr int64_t kAmxChunkBytes = int64_t{1} << 20;

// 32 bf16: e[0], o[0], e[1], o[1], ... (each rounded to nearest even, as to_bf16).
inline __m512i interleave_bf16(__m512 e, __m512 o) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o, e)));
}

// Input columns [c0, c1) (c0 a multiple of 8; c1 rounded up to one) of the dequantized
// panel p into buf [kp / 32][16][32] bf16 in the B-tile layout: buf[b][i][2 * r + t] =
// w[row r, column 32 * b + 2 * i + t]. Columns from K on are never written: the caller's
// zeros stay there (x is zero there too).
template <int BITS>
void dequant_panel_vnni(const Weights& w, int64_t group, int64_t c0, int64_t c1, int64_t p,
                        uint16_t* buf) {
  const __m512i lo8 = _mm512_set1_epi32(0xFF);
  const uint8_t* cp = w.codes + p * w.panel_bytes;
  __m512 s = _mm512_setzero_ps(), m = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; c += 8) {
    if (c == c0 || c % group == 0) {
      panel_scale_offset(w, w.groups == 1 ? 0 : c / group, p * kPanel, s, m);
    }
    __m512i v[2];
    // NOTE: the panels of a thread's share are one stream; reads ahead keep it flowing.
    _mm_prefetch(reinterpret_cast<const char*>(cp + c * 2 * BITS) + kPrefetch4, _MM_HINT_T0);
    if constexpr (BITS == 8) {
      _mm_prefetch(reinterpret_cast<const char*>(cp + c * 2 * BITS) + kPrefetch4 + 64,
                   _MM_HINT_T0);
    }
    decode8<BITS>(cp + c * 2 * BITS, v[0], v[1]);
    for (int h = 0; h < 2; ++h) {
      // Columns c + 4h + {0, 1} and {2, 3}: bytes 0-3 of each lane, one pair a store.
      const __m512 y0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v[h], lo8)), s, m);
      const __m512 y1 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[h], 8), lo8)), s, m);
      const __m512 y2 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[h], 16), lo8)), s, m);
      const __m512 y3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v[h], 24)), s, m);
      const int64_t col = c + 4 * h;
      uint16_t* dst = buf + (col / 32) * 512 + ((col % 32) / 2) * 32;
      _mm512_storeu_si512(dst, interleave_bf16(y0, y1));
      _mm512_storeu_si512(dst + 32, interleave_bf16(y2, y3));
    }
  }
}

// All 32-column blocks of up to two row tiles (activations at a0 and a1, rows a_stride
// elements apart) times up to two panels' weight buffers (b0, b1:
// the B-tile layout above) into the accumulators 2 * tile + panel. Per block, NT + NP
// loads feed NT * NP products: each activation tile serves both panels, each weight tile
// both row tiles. Tiles 4-5 activations, 6-7 weights. (The tile intrinsics take literal
// tile numbers: hence the template, instantiated per shape.)
template <int NT, int NP>
inline void amx_block_2x2(const uint16_t* a0, const uint16_t* a1, int64_t a_stride,
                          const uint16_t* b0, const uint16_t* b1, int64_t kb_n) {
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    _tile_loadd(6, b0 + kb * 512, 64);
    if constexpr (NP == 2) _tile_loadd(7, b1 + kb * 512, 64);
    _tile_loadd(4, a0 + kb * 32, a_stride * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NT == 2) {
      _tile_loadd(5, a1 + kb * 32, a_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

inline void amx_store(int t, float* c) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}
#endif

// Whether q_linear_amx runs in this build (AMX-TILE and AMX-BF16 compiled in).
bool amx_compiled() {
#if defined(PAGODA_Q_AMX)
  return true;
#else
  return false;
#endif
}

#if defined(PAGODA_Q_AMX)
// The product on AMX tiles, its weight panels either dequantized per call (w: into
// per-thread buffers, each pair while the previous pair's products run) or read from a copy
// dequantized once (`pre`: [panels][kp / 32][16][32] bf16, the buffers' layout). The two
// give the same bits: the same values in the same tiles, summed in the same order.
at::Tensor amx_linear(const at::Tensor& x, const Weights* w, const uint16_t* pre, int64_t kp,
                      int64_t panels, int64_t n, int64_t group, int64_t bits,
                      const at::Tensor& b) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // The activations as whole tiles: rows to a multiple of 16, columns to kp (zeros). Where
  // K is kp already, x's whole tiles are read in place and only the last, partial one is
  // copied (a copy of all of x took a tenth of a 256-row product's time).
  const int64_t row_tiles = (m + 15) / 16;
  const bool in_place = k == kp && x.is_contiguous();
  const int64_t copied_from = in_place ? m / 16 * 16 : 0;
  at::Tensor xs = at::zeros({row_tiles * 16 - copied_from, kp}, x.options());
  xs.narrow(0, 0, m - copied_from).narrow(1, 0, k).copy_(x.narrow(0, copied_from, m - copied_from));
  const auto* x_in = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* x_pad = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  auto row_tile = [&](int64_t t) {
    const int64_t r = t * 16;
    return r < copied_from ? x_in + r * kp : x_pad + (r - copied_from) * kp;
  };
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t kb_n = kp / 32, panel_elems = kp * kPanel;
#pragma omp parallel
  {
    pagoda_amx::load_full_tiles();
    // NOTE: two panels (32 output columns) at a time: each activation tile loaded feeds two
    // products (one tile load per product halves the L2 reads of x), and each output row's
    // 64 bytes are one store, a whole cache line, instead of two halves written apart.
    // Dequantizing, the next pair's dequantization is interleaved with this pair's
    // products, a slice after each pair of row tiles: the vector work runs while the tile
    // unit computes (double-buffered weights: slots 0 and 1, two panels each).
    // NOTE: the buffers outlive the call (OpenMP's threads do): a fresh zeroed vector per
    // call and thread cost 1-5% of a 48-64-row product. Only the last 32-column block can
    // hold columns dequant_panel_vnni never writes (from K on, when K is not a multiple of
    // 32); it is zeroed here, since what an earlier product left there may be inf or NaN.
    static thread_local std::vector<uint16_t> wbuf;
    if (pre == nullptr) {
      if (wbuf.size() < static_cast<size_t>(4 * panel_elems)) wbuf.resize(4 * panel_elems);
      if (k % 32 != 0) {
        for (int i = 0; i < 4; ++i) {
          std::fill(wbuf.data() + i * panel_elems + k / 32 * 512,
                    wbuf.data() + (i + 1) * panel_elems, uint16_t{0});
        }
      }
    }
    auto slot_buf = [&](int slot, int q) { return wbuf.data() + (2 * slot + q) * panel_elems; };
    auto dequant_pair = [&](int64_t pair, int slot, int64_t c0, int64_t c1) {
      for (int64_t q = 0; q < 2 && 2 * pair + q < panels; ++q) {
        if (bits == 4) dequant_panel_vnni<4>(*w, group, c0, c1, 2 * pair + q, slot_buf(slot, q));
        else dequant_panel_vnni<8>(*w, group, c0, c1, 2 * pair + q, slot_buf(slot, q));
      }
    };
    alignas(64) float acc[2][16 * 16];
    const int64_t pairs = (panels + 1) / 2;
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t lo = pairs * tid / nth, hi = pairs * (tid + 1) / nth, own = hi - lo;
    // Rows in chunks of about kAmxChunkBytes of x (whole row pairs), each chunk a pass over
    // the thread's panel pairs: the chunk's rows stay in L2 while every pair reads them.
    const int64_t chunk_tiles = std::max<int64_t>(2, kAmxChunkBytes / (kp * 2 * 16) / 2 * 2);
    const int64_t chunks = (row_tiles + chunk_tiles - 1) / chunk_tiles;
    const int64_t row_pairs = (std::min(chunk_tiles, row_tiles) + 1) / 2;
    // Columns of the next pair dequantized after each row pair (a multiple of 8).
    const int64_t slice = ((k + 7) / 8 + row_pairs - 1) / row_pairs * 8;
    if (pre == nullptr && own > 0) dequant_pair(lo, 0, 0, k);
    for (int64_t u = 0; u < chunks * own; ++u) {
      const int64_t pp = lo + u % own, t_lo = u / own * chunk_tiles;
      const int64_t t_hi = std::min(row_tiles, t_lo + chunk_tiles);
      const int64_t p0 = 2 * pp;
      const int np = static_cast<int>(std::min<int64_t>(2, panels - p0));
      // NOTE: one pair per thread: it stays in slot 0 across the chunks, dequantized once.
      const int slot = own == 1 ? 0 : static_cast<int>(u & 1);
      const uint16_t* b0 = pre != nullptr ? pre + p0 * panel_elems : slot_buf(slot, 0);
      const uint16_t* b1 = pre == nullptr ? slot_buf(slot, 1) : np == 2 ? b0 + panel_elems : b0;
      const bool ahead = pre == nullptr && own > 1 && u + 1 < chunks * own;
      const int64_t next = lo + (u + 1) % own;
      int64_t done = 0;  // columns of the next pair dequantized so far
      const int64_t col0 = p0 * kPanel;
      __mmask16 mask[2];
      __m512 bv[2];
      for (int q = 0; q < 2; ++q) {
        mask[q] = q < np ? first_lanes(n - col0 - q * kPanel) : 0;
        bv[q] = bp != nullptr ? _mm512_maskz_loadu_ps(mask[q], bp + col0 + q * kPanel)
                              : _mm512_setzero_ps();
      }
      for (int64_t t0 = t_lo; t0 < t_hi; t0 += 2) {
        const int nt = static_cast<int>(std::min<int64_t>(2, t_hi - t0));
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* a0 = row_tile(t0);
        const uint16_t* a1 = nt == 2 ? row_tile(t0 + 1) : a0;
        if (nt == 2 && np == 2) amx_block_2x2<2, 2>(a0, a1, kp, b0, b1, kb_n);
        else if (nt == 2) amx_block_2x2<2, 1>(a0, a1, kp, b0, b1, kb_n);
        else if (np == 2) amx_block_2x2<1, 2>(a0, a1, kp, b0, b1, kb_n);
        else amx_block_2x2<1, 1>(a0, a1, kp, b0, b1, kb_n);
        if (ahead && done < k) {
          const int64_t end = std::min(k, done + slice);
          dequant_pair(next, slot ^ 1, done, end);
          done = end;
        }
        for (int t = 0; t < nt; ++t) {
          for (int q = 0; q < np; ++q) amx_store(2 * t + q, acc[q]);
          const int64_t r0 = (t0 + t) * 16;
          for (int64_t r = 0; r < 16 && r0 + r < m; ++r) {
            const __m256i y0 = to_bf16(_mm512_add_ps(_mm512_load_ps(acc[0] + r * 16), bv[0]));
            uint16_t* dst = op + (r0 + r) * n + col0;
            if (np == 2) {
              const __m256i y1 = to_bf16(_mm512_add_ps(_mm512_load_ps(acc[1] + r * 16), bv[1]));
              const __m512i y = _mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1);
              _mm512_mask_storeu_epi16(dst, static_cast<__mmask32>(mask[0]) |
                                                (static_cast<__mmask32>(mask[1]) << 16), y);
            } else {
              _mm256_mask_storeu_epi16(dst, mask[0], y0);
            }
          }
        }
      }
      if (ahead && done < k) dequant_pair(next, slot ^ 1, done, k);
    }
    _tile_release();
  }
  return out;
}
#endif

at::Tensor q_linear_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                        const at::Tensor& off, int64_t bits, int64_t block, int64_t group,
                        bool zero_form, int64_t n, const c10::optional<at::Tensor>& bias) {
  const Weights w = checked_weights(x, codes, sc, off, bits, block, group, zero_form, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the AMX path takes bf16 x");
#if defined(PAGODA_Q_AMX)
  const int64_t kp = codes.size(1) / (2 * bits);
  return amx_linear(x, &w, nullptr, kp, w.np / kPanel, n, group, bits, float_bias(bias, n));
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AMX-TILE and AMX-BF16");
#endif
}

// The whole weight dequantized once into q_linear_amx's per-thread buffer layout, every
// panel: [panels, kp * 16] bf16 (kp / 32 blocks of [16][32]; columns from K on zero). The
// copy `q_linear_panels` reads instead of dequantizing: a GGUF linear's dense copy.
at::Tensor dequantize_panels(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& off,
                             int64_t bits, int64_t block, int64_t group, bool zero_form,
                             int64_t n, int64_t k) {
  const at::Tensor probe = at::empty({1, k}, codes.options().dtype(at::kBFloat16));
  const Weights w = checked_weights(probe, codes, sc, off, bits, block, group, zero_form, n);
  const int64_t kp = codes.size(1) / (2 * bits), panels = w.np / kPanel;
  at::Tensor buf = at::zeros({panels, kp * kPanel}, probe.options());
#if defined(PAGODA_Q_AMX)
  auto* dst = reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>());
#pragma omp parallel for
  for (int64_t p = 0; p < panels; ++p) {
    if (bits == 4) dequant_panel_vnni<4>(w, group, 0, k, p, dst + p * kp * kPanel);
    else dequant_panel_vnni<8>(w, group, 0, k, p, dst + p * kp * kPanel);
  }
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AMX-TILE and AMX-BF16");
#endif
  return buf;
}

// q_linear_amx's product from a dequantize_panels copy: the same bits, no dequantization.
at::Tensor q_linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bf16 [M, K] matrix");
  TORCH_CHECK(panels.dim() == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16 && panels.size(1) % (64 * kPanel) == 0,
              "panels must be a contiguous bf16 [panels, kp * 16] copy (dequantize_panels)");
  const int64_t kp = panels.size(1) / kPanel, np = panels.size(0) * kPanel;
  TORCH_CHECK(x.size(1) <= kp, "the panels cover ", kp, " columns, x has ", x.size(1));
  TORCH_CHECK(n <= np && n > np - kPanel, "n = ", n, " does not match ", np, " padded rows");
#if defined(PAGODA_Q_AMX)
  return amx_linear(x, nullptr, reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()),
                    kp, panels.size(0), n, 0, 0, float_bias(bias, n));
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AMX-TILE and AMX-BF16");
#endif
}

// Activation rows for which q_linear's bf16 products run q_linear_amx: [amx_min_rows,
// amx_max_rows] (set once per process by quant_cpu.py where AMX tiles were granted;
// INT64_MAX: never).
std::atomic<int64_t> amx_min_rows{std::numeric_limits<int64_t>::max()};
std::atomic<int64_t> amx_max_rows{0};

// Rows from which q_linear's bf16 products run q_linear_tiles (set once per process by
// quant_cpu.py: on a CPU with AMX the dequantized tiles through oneDNN are the faster path
// for wide products; INT64_MAX: never).
std::atomic<int64_t> wide_min_rows{std::numeric_limits<int64_t>::max()};
// At most this many bytes of dequantized bf16 weight per tile: one tile covers a SmolLM2 or
// Llama-8B attention weight (one GEMM, written in place), and the scratch stays under
// memory_env's 32 MiB mmap threshold.
constexpr int64_t kTileBytes = int64_t{16} << 20;

int64_t tile_rows(int64_t k, int64_t n) {
  const int64_t rows = std::max<int64_t>(kTileBytes / (2 * k), kPanel);
  return rows >= n ? n : rows / kPanel * kPanel;
}

// y[M, n] = x[M, K] @ w.T (+ bias), w in the panel layout above; out has x's dtype.
at::Tensor q_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc,
                    const at::Tensor& off, int64_t bits, int64_t block, int64_t group,
                    bool zero_form, int64_t n, const c10::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= amx_min_rows.load() &&
      x.size(0) <= amx_max_rows.load()) {
    return q_linear_amx(x, codes, sc, off, bits, block, group, zero_form, n, bias);
  }
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= wide_min_rows.load()) {
    return q_linear_tiles(x, codes, sc, off, bits, block, group, zero_form, n, bias,
                          tile_rows(x.size(1), n));
  }
  const Weights w = checked_weights(x, codes, sc, off, bits, block, group, zero_form, n);
  const at::Tensor b = float_bias(bias, n);
  const int64_t m = x.size(0), k = x.size(1), kp = codes.size(1) / (2 * bits);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(PAGODA_Q_VEC)
  const Output o{out.data_ptr(), x.scalar_type() == at::kBFloat16, n,
                 b.defined() ? b.data_ptr<float>() : nullptr};
  QuantActs a;
  if (x.scalar_type() == at::kFloat) quantize_acts(x.data_ptr<float>(), m, k, kp, block, a);
  else quantize_acts(x.data_ptr<at::BFloat16>(), m, k, kp, block, a);
  if (bits == 4) q_linear_impl<4, 32>(w, a, m, o);
  else if (block == 32) q_linear_impl<8, 32>(w, a, m, o);
  else q_linear_impl<8, 16>(w, a, m, o);
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512 or AVX2");
#endif
  return out;
}

// A weight's layout, checked once, for pagoda_q_gemv_part (q_gemv_abi.h): the tensors are
// held so that the pointers in `w` stay valid while the Python object lives.
struct GemvPlan {
  at::Tensor codes, sc, off;
  Weights w;
  int64_t bits, block, k, kp, n;
};

GemvPlan make_gemv_plan(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& off,
                        int64_t bits, int64_t block, int64_t group, bool zero_form, int64_t n,
                        int64_t k) {
#if !defined(PAGODA_Q_VEC)
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512 or AVX2");
#endif
  TORCH_CHECK(k > 0, "k must be positive");
  // NOTE: checked_weights reads only x's shape and dtype.
  const at::Tensor x = at::empty({1, k}, at::kBFloat16);
  const Weights w = checked_weights(x, codes, sc, off, bits, block, group, zero_form, n);
  return GemvPlan{codes, sc, off, w, bits, block, k, codes.size(1) / (2 * bits), n};
}

extern "C" void pagoda_q_gemv_part(const void* plan, const void* x, void* y, int bf16,
                                   const float* bias, int tid, int nth) {
#if defined(PAGODA_Q_VEC)
  const GemvPlan& p = *static_cast<const GemvPlan*>(plan);
  // NOTE: per thread: every thread of the caller's team quantizes the row itself.
  thread_local QuantActs a;
  if (bf16) quantize_acts(static_cast<const at::BFloat16*>(x), 1, p.k, p.kp, p.block, a);
  else quantize_acts(static_cast<const float*>(x), 1, p.k, p.kp, p.block, a);
  const Output o{y, bf16 != 0, p.n, bias};
  if (p.bits == 4) q_gemv_share<4, 32>(p.w, a, o, tid, nth);
  else if (p.block == 32) q_gemv_share<8, 32>(p.w, a, o, tid, nth);
  else q_gemv_share<8, 16>(p.w, a, o, tid, nth);
#endif
}

static_assert(std::is_same_v<decltype(&pagoda_q_gemv_part), PagodaGemvPart>,
              "pagoda_q_gemv_part must have q_gemv_abi.h's signature");

// out[i] = row rows[i] of the layout's weight (float32 or bf16 [R, K]): what the reference
// (quant_layouts.BlockLayout.dequantize_rows) computes, without its dozen tensor ops.
void dequant_rows(at::Tensor out, const at::Tensor& codes, const at::Tensor& sc,
                  const at::Tensor& off, int64_t bits, int64_t group, bool zero_form, int64_t n,
                  const at::Tensor& rows) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous float32 or bfloat16 [R, K]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == out.size(0), "rows must be a contiguous int64 [R]");
  const int64_t k = out.size(1);
  const at::Tensor x = at::empty({0, k}, out.options());  // the shape checks' K
  const Weights w = checked_weights(x, codes, sc, off, bits, 32, group, zero_form, n);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < n, "row ", r[i], " is out of range [0, ", n, ")");
  }
#if defined(PAGODA_Q_VEC)
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  auto* base = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = k * out.element_size();
#pragma omp parallel for schedule(static) if (rows.size(0) * k >= (1 << 16))
  for (int64_t i = 0; i < rows.size(0); ++i) {
    if (bits == 4) dequant_row<4>(w, group, k, r[i], base + i * row_bytes, bf16);
    else dequant_row<8>(w, group, k, r[i], base + i * row_bytes, bf16);
  }
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512 or AVX2");
#endif
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
#if defined(PAGODA_Q_VEC)
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
      const int64_t dot = static_cast<int64_t>(i8_dot(cp + j * kp, xq.data() + r * kp, kp)) -
                          128 * qsum[r];
      float y = static_cast<float>(static_cast<double>(dot) * st[r] * sp[j]);
      if (bp != nullptr) y += bp[j];
      op[r * n + j] = y;
    }
  }
#else
  TORCH_CHECK(false, "pagoda quant kernels were built without AVX-512 or AVX2");
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// fp8_cpu.cpp
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    int64_t kblock, const c10::optional<at::Tensor>& bias);
void fp8_dequant(const at::Tensor& codes, const at::Tensor& scales, int64_t kblock,
                 at::Tensor& out);
std::vector<std::string> fp8_isa();

}  // namespace pagoda_quant

// NOTE: also a dispatcher op, so that the other extension's whole-layer calls
// (decoder_layer_cpu.cpp) can run quantized projections without linking against this one.
TORCH_LIBRARY(pagoda_quant, m) {
  m.def("q_linear", &pagoda_quant::q_linear);
  m.def("q_linear_panels", &pagoda_quant::q_linear_panels);
  // NOTE: a token table's lookups in the other extension's decode bursts.
  m.def("dequant_rows", &pagoda_quant::dequant_rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q_linear", &pagoda_quant::q_linear, "x @ w.T for panel-packed codes (int8 activations; bf16 tiles from wide_min_rows rows)");
  m.def("q_linear_tiles", &pagoda_quant::q_linear_tiles,
        "q_linear through per-tile bf16 dequantization and a bf16 GEMM");
  m.def("set_gemv_streams", [](int64_t n) {
          TORCH_CHECK(n >= 1 && n <= 4, "the single-row streams must be 1 to 4, not ", n);
#if defined(PAGODA_Q_AVX512)
          return static_cast<int64_t>(pagoda_quant::g_gemv_streams.exchange(static_cast<int>(n)));
#else
          return int64_t{1};
#endif
        }, "streams a single-row product walks side by side per thread on AVX-512 (1-4; "
           "the same bits at any count; AVX2: always 1); returns the old count");
  m.def("set_wide_min_rows", [](int64_t rows) { pagoda_quant::wide_min_rows.store(rows); },
        "rows from which q_linear's bf16 products take q_linear_tiles");
  m.def("q_linear_amx", &pagoda_quant::q_linear_amx,
        "q_linear on AMX tiles: each panel dequantized to bf16 in the B-tile layout, TDPBF16PS");
  m.def("dequantize_panels", &pagoda_quant::dequantize_panels,
        "the weight dequantized once into q_linear_amx's buffer layout: [panels, kp * 16] bf16");
  m.def("q_linear_panels", &pagoda_quant::q_linear_panels,
        "q_linear_amx's product from a dequantize_panels copy (the same bits)");
  m.def("amx_compiled", &pagoda_quant::amx_compiled, "whether q_linear_amx was built");
  m.def("set_amx_rows", [](int64_t lo, int64_t hi) {
          pagoda_quant::amx_min_rows.store(lo);
          pagoda_quant::amx_max_rows.store(hi);
        }, "the activation rows [lo, hi] for which q_linear's bf16 products take q_linear_amx");
  m.def("tile_rows", &pagoda_quant::tile_rows, "output rows per tile of q_linear's wide products");
  m.def("dequant_rows", &pagoda_quant::dequant_rows,
        "rows of a panel layout's weight, dequantized into out (float32 or bf16)");
  m.def("i8_linear", &pagoda_quant::i8_linear, "W8A8 with a dynamic per-token activation scale");
  m.def("fp8_gemv", &pagoda_quant::fp8_gemv, "x @ w.T for e4m3fn codes with block scales (few rows)");
  m.def("fp8_dequant", &pagoda_quant::fp8_dequant, "e4m3fn codes times their scales, into a bf16 buffer");
  namespace py = pybind11;
  py::class_<pagoda_quant::GemvPlan>(m, "GemvPlan",
                                     "A panel layout checked for single-row products "
                                     "(q_gemv_abi.h); address: for the other extension")
      .def(py::init(&pagoda_quant::make_gemv_plan), py::arg("codes"), py::arg("scales"),
           py::arg("offsets"), py::arg("bits"), py::arg("block"), py::arg("group"),
           py::arg("zero_form"), py::arg("n"), py::arg("k"))
      .def_property_readonly("address", [](const pagoda_quant::GemvPlan& p) {
        return reinterpret_cast<std::intptr_t>(&p);
      });
  m.def("gemv_part_address", [] {
        return reinterpret_cast<std::intptr_t>(&pagoda_quant::pagoda_q_gemv_part);
      },
        "the address of pagoda_q_gemv_part (q_gemv_abi.h)");
  m.def("kernel_isa", [] { return std::map<std::string, std::vector<std::string>>{
      {"quant", pagoda_quant::quant_isa()}, {"fp8", pagoda_quant::fp8_isa()}}; }, "op -> the /proc/cpuinfo flags its vector path uses");
}
