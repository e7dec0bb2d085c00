// Prefill attention over the paged KV cache, on the CPU: a tile of query rows against each
// tile of 16 K/V positions once (the decode kernel, paged_attention_cpu.cpp, reads every K/V
// row once per query row).
//
// One work item: query rows [row0, row0 + M) of one request and the G = H / Hk query heads of
// one kv head: M * G query vectors, in lane blocks of 16 (AVX-512) or 8 (AVX2). Every tile of
// positions the item reads is staged once from the cache (for vdpbf16ps: K as bf16, V as bf16
// row pairs; else both as fp32), then each lane block computes, one query vector per lane:
//   scores  S[t] = q . K[t]                        one K value broadcast per instruction
//   softmax online per lane: running max, sum, rescale; causal and window masks per lane
//   values  acc[d] = acc[d] * rescale + sum_t P[t] * V[t][d]   one V value (pair) broadcast
// Every operation is vertical (no horizontal sums, no transposes), and the item's K/V rows
// are read from the cache once per M query rows. The next tile's rows are prefetched while
// the current one is computed (block ids are random: the hardware prefetchers cannot).
//
// Numerics: with a bf16 q and a bf16, int8 or fp8 cache, q . k is vdpbf16ps (codes staged as
// bf16 are exact: int8 and e4m3 values have at most 8 significant bits; fp8 subnormals too,
// scaled into bf16's normal range), whose bf16 products are exact in fp32 and summed in fp32,
// as in the decode kernel; the softmax in fp32; P . V also through vdpbf16ps, on V rows as they
// are (bf16, or codes as exact bf16) and the probabilities (times their V scales) rounded to
// bf16 (2^-9 relative each, as the bf16 output itself; sums in fp32): twice the products per
// instruction of fp32 FMAs on widened V rows, measured 1.3x faster at 2,048 tokens. A float32
// q or cache, or a CPU without AVX512_BF16: fp32 FMAs throughout on exact fp32 rows (float32
// q: the exact path). The output is rounded once.
//
// The AVX2 (+ FMA) build has the fp32 path only (no bf16 dot products), in 8-lane blocks with
// the same operations per lane in the same order (the loops written once over
// vec_lanes_cpu.h's 16- or 8-lane wrappers; vexp_nonpos one polynomial for both widths;
// every multiply-add written as one), so its results equal the AVX-512 fp32 path's bit for
// bit; with a bf16 q it is that path, not the vdpbf16ps one.
//
// Layouts (all contiguous):
//   q, out        [T, H, D]       float32 or bfloat16 (same dtype)
//   k/v_cache     [N, bs, Hk, D]  and k/v_scale [N, bs, Hk] as in paged_attention_cpu.cpp
//   block_tables  [R, max_blocks] int64
//   query_starts, query_lens, seq_lens  [R] int64: request r's query rows are
//     q[query_starts[r] + i], i < query_lens[r], at positions seq_lens[r] - query_lens[r] + i;
//     row i at position p attends to positions [max(0, p - window + 1), p] (window < 0: none).
// AVX-512 or AVX2 + FMA, head dims 32/64/96/128/256; the caller takes the decode kernel
// elsewhere.

// NOTE: no FMA contraction: both vector paths must fuse the same multiply-adds, written as
// vfmadd.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_cpu.h"
#include "index_args_cpu.h"

// The vector path: 16 lanes (AVX512F), else 8 (AVX2 + FMA; the fp32 path only).
#if defined(__AVX512F__)
#define PAGODA_PREFILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGODA_PREFILL_AVX2 1
#endif
// The bf16 dot-product path (vdpbf16ps; vpermw/vpermt2w to pair V rows).
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGODA_PREFILL_DOT 1
#endif

// The AMX path (paged_prefill_amx_cpu.cpp).
namespace pagoda_prefill_amx {
extern std::atomic<bool> g_enabled;
bool compiled();
bool takes(bool bf16, bool quantized, int head_dim);
void run(const uint16_t* q, uint16_t* out, const uint16_t* k, const uint16_t* v,
         const int64_t* bt, int64_t bt_stride, const int64_t* qs, const int64_t* ql,
         const int64_t* sl, int64_t num_reqs, int H, int Hk, int D, int bs, float scale,
         int64_t window);
}  // namespace pagoda_prefill_amx

namespace {

using namespace pagoda_attn;

struct PrefillProblem {
  const void* q;
  void* out;
  bool q_is_bf16;
  const int64_t* block_tables;
  int64_t bt_stride;
  const int64_t* query_starts;
  const int64_t* query_lens;
  const int64_t* seq_lens;
  int num_heads;
  int num_kv_heads;
  int block_size;
  float scale;
  int64_t window;
  const float* k_scale = nullptr;  // [N * bs * Hk], quantized caches only
  const float* v_scale = nullptr;
};

#if defined(PAGODA_PREFILL_AVX512) || defined(PAGODA_PREFILL_AVX2)

// The lane vectors of the fp32 path, one query vector per lane: every operation is per lane,
// so both widths give the same bits. The float32 arithmetic is vec_lanes_cpu.h's wrappers
// (through attention_cpu.h); the int32 lanes and masks of the causal / window masks are here.
using namespace pagoda_vec;

#if defined(PAGODA_PREFILL_AVX512)
constexpr int kLanes = 16;
using VecF = __m512;
using VecI = __m512i;
using Mask = __mmask16;

inline VecI viload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline VecI viset1(int32_t x) { return _mm512_set1_epi32(x); }
inline VecI visub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline Mask mask_none() { return 0; }
inline Mask mask_le(VecI a, VecI b) { return _mm512_cmple_epi32_mask(a, b); }
inline Mask mask_ge(VecI a, VecI b) { return _mm512_cmpge_epi32_mask(a, b); }
inline Mask mask_and(Mask a, Mask b) { return a & b; }
// x where k, else other; x where k, else 0.
inline VecF vselect(Mask k, VecF x, VecF other) { return _mm512_mask_mov_ps(other, k, x); }
inline VecF vkeep(Mask k, VecF x) { return _mm512_maskz_mov_ps(k, x); }
#else
constexpr int kLanes = 8;
using VecF = __m256;
using VecI = __m256i;
using Mask = __m256i;  // all ones in a selected lane

inline VecI viload(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline VecI viset1(int32_t x) { return _mm256_set1_epi32(x); }
inline VecI visub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline Mask mask_none() { return _mm256_setzero_si256(); }
inline Mask mask_le(VecI a, VecI b) {
  return _mm256_xor_si256(_mm256_cmpgt_epi32(a, b), _mm256_set1_epi32(-1));
}
inline Mask mask_ge(VecI a, VecI b) {
  return _mm256_xor_si256(_mm256_cmpgt_epi32(b, a), _mm256_set1_epi32(-1));
}
inline Mask mask_and(Mask a, Mask b) { return _mm256_and_si256(a, b); }
inline VecF vselect(Mask k, VecF x, VecF other) {
  return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(k));
}
inline VecF vkeep(Mask k, VecF x) { return _mm256_and_ps(_mm256_castsi256_ps(k), x); }
#endif

// Query rows [row0, row0 + rows) of request req, for the query heads of kv head kvh.
struct WorkItem {
  int64_t req;
  int64_t row0;
  int rows;
  int kvh;
};

// Query vectors per item (lane blocks of kLanes): the accumulators (kD * 4 bytes each), the
// queries and the staged tile stay in the first cache levels.
template <int kD>
constexpr int kMaxQueryVectors = kD <= 64 ? 64 : (kD <= 128 ? 32 : 16);

// Per-thread state of one item; [block][dim][lane] for the queries and accumulators.
struct PrefillScratch {
  std::vector<uint32_t> qp;   // bf16 q, dims in pairs: [blocks][kD / 2][16] (AVX-512 only)
  std::vector<float> qf;      // fp32 q: [blocks][kD][kLanes]
  std::vector<float> acc;     // [blocks][kD][kLanes]
  std::vector<float> m, l;    // running max and sum: [blocks][kLanes]
  std::vector<int32_t> pos;   // each lane's query position: [blocks][kLanes]
  std::vector<uint16_t> kb;   // the tile's K as bf16: [16][kD]
  std::vector<float> kf;      // the tile's K as fp32: [16][kD]
  std::vector<float> vf;      // the tile's V as fp32 times its scale: [16][kD]
  std::vector<uint32_t> vp;   // the tile's V as bf16, rows 2i and 2i + 1 paired: [8][kD]
  std::vector<float> ks;      // per tile row: softmax scale times its K scale
  std::vector<float> vs;      // per tile row: its V scale (1 for a plain cache)
  PrefillScratch(int blocks, int d)
      : qp(blocks * d / 2 * kLanes), qf(blocks * d * kLanes), acc(blocks * d * kLanes),
        m(blocks * kLanes), l(blocks * kLanes), pos(blocks * kLanes), kb(kTile * d),
        kf(kTile * d), vf(kTile * d), vp(kTile / 2 * d), ks(kTile), vs(kTile) {}
};

// One cache row as fp32 values times mul, natural dim order, into dst.
template <typename KV, int kD>
inline void stage_row_f32(const KV* src, float* dst, float mul) {
  const VecF m = vset1<VecF>(mul);
  if constexpr (std::is_same_v<KV, uint16_t>) {
    // NOTE: natural dim order (load_row_f32 would pair even / odd elements).
    for (int i = 0; i < kD / kLanes; ++i) {
      vstore(dst + kLanes * i, vmul(vload_bf16<VecF>(src + kLanes * i), m));
    }
  } else {
    VecF f[kD / kLanes];
    load_row_f32<kD>(src, f);
    for (int i = 0; i < kD / kLanes; ++i) vstore(dst + kLanes * i, vmul(f[i], m));
  }
}

#if defined(PAGODA_PREFILL_DOT)
// One cache row of bf16 or codes as bf16 code values (exact, see the top), into dst.
template <typename KV, int kD>
inline void stage_row_bf16(const KV* src, uint16_t* dst) {
  if constexpr (std::is_same_v<KV, uint16_t>) {
    std::memcpy(dst, src, kD * sizeof(uint16_t));
  } else {
    static_assert(kQuantized<KV>, "float caches keep the fp32 path");
    __m512 f[kD / 16];
    load_row_f32<kD>(src, f);
    const __m512 unit = _mm512_set1_ps(kCodeUnit<KV>);
    for (int i = 0; i < kD / 16; ++i) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(f[i], unit));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i), (__m256i)b);
    }
  }
}
#endif

#if defined(PAGODA_PREFILL_DOT)
// 32 values of a row as bf16 (codes as their exact values).
template <typename KV>
inline __m512i load_bf16x32(const KV* src) {
  if constexpr (std::is_same_v<KV, uint16_t>) {
    return _mm512_loadu_si512(src);
  } else {
    __m512 f[2];
    load_row_f32<32>(src, f);
    const __m512 unit = _mm512_set1_ps(kCodeUnit<KV>);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(f[1], unit), _mm512_mul_ps(f[0], unit));
  }
}

// The tile's V rows as bf16 pairs: s.vp[i][d] = (V[2i][d], V[2i + 1][d]), the operand layout
// of vdpbf16ps.
template <typename KV, int kD>
inline void stage_value_pairs(const KV* v_cache, const TileRows& tr, int64_t col,
                              PrefillScratch& s) {
  alignas(64) int16_t lo[32], hi[32];
  for (int i = 0; i < 16; ++i) {
    lo[2 * i] = static_cast<int16_t>(i), lo[2 * i + 1] = static_cast<int16_t>(32 + i);
    hi[2 * i] = static_cast<int16_t>(16 + i), hi[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_load_si512(hi);
  for (int i = 0; i < kTile / 2; ++i) {
    const KV* ra = v_cache + tr.off[2 * i] + col;
    const KV* rb = v_cache + tr.off[2 * i + 1] + col;
    uint32_t* dst = s.vp.data() + i * kD;
    for (int c = 0; c < kD / 32; ++c) {
      const __m512i a = load_bf16x32(ra + 32 * c), b = load_bf16x32(rb + 32 * c);
      _mm512_storeu_si512(dst + 32 * c, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_storeu_si512(dst + 32 * c + 16, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}
#endif

// The tile's K and V rows of kv head kvh (column col) into the scratch, and each row's
// score multiplier. Lanes outside the tile's valid rows repeat a valid row (finite values).
template <typename KV, int kD, bool kDot>
inline void stage_tile(const PrefillProblem& p, const KV* k_cache, const KV* v_cache,
                       const TileRows& tr, int64_t col, int kvh, PrefillScratch& s) {
  for (int t = 0; t < kTile; ++t) {
    float k_mul = p.scale, v_mul = 1.0f;
    if constexpr (kQuantized<KV>) {
      const int64_t i = tr.slot[t] * p.num_kv_heads + kvh;
      k_mul *= p.k_scale[i];
      v_mul = p.v_scale[i];
    }
    s.ks[t] = k_mul;
    s.vs[t] = v_mul;
    const KV* kr = k_cache + tr.off[t] + col;
#if defined(PAGODA_PREFILL_DOT)
    if constexpr (kDot) {
      stage_row_bf16<KV, kD>(kr, s.kb.data() + t * kD);
    } else {
      stage_row_f32<KV, kD>(kr, s.kf.data() + t * kD, kCodeUnit<KV>);
    }
#else
    stage_row_f32<KV, kD>(kr, s.kf.data() + t * kD, kCodeUnit<KV>);
#endif
    if constexpr (!kDot) {
      stage_row_f32<KV, kD>(v_cache + tr.off[t] + col, s.vf.data() + t * kD,
                            v_mul * kCodeUnit<KV>);
    }
  }
#if defined(PAGODA_PREFILL_DOT)
  if constexpr (kDot) stage_value_pairs<KV, kD>(v_cache, tr, col, s);
#endif
}

// Prefetch the K/V rows (and scales) of a tile of kv head column col.
template <typename KV, int kD>
inline void prefetch_tile(const PrefillProblem& p, const KV* k_cache, const KV* v_cache,
                          const TileRows& tr, int64_t col, int kvh) {
  constexpr int64_t kSpan = kD * sizeof(KV);
  for (int t = tr.lo; t < tr.hi; ++t) {
    const char* kr = reinterpret_cast<const char*>(k_cache + tr.off[t] + col);
    const char* vr = reinterpret_cast<const char*>(v_cache + tr.off[t] + col);
    for (int64_t off = 0; off < kSpan; off += 64) {
      _mm_prefetch(kr + off, _MM_HINT_T0);
      _mm_prefetch(vr + off, _MM_HINT_T0);
    }
    if constexpr (kQuantized<KV>) {
      const int64_t i = tr.slot[t] * p.num_kv_heads + kvh;
      _mm_prefetch(reinterpret_cast<const char*>(p.k_scale + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.v_scale + i), _MM_HINT_T0);
    }
  }
}

// The item's queries into the lanes: query vector j = (row j / G, head j % G); lanes past the
// item's nqv query vectors get q = 0 and the last row's position (computed, never stored).
template <int kD, bool kDot>
inline void load_queries(const PrefillProblem& p, int64_t qrow0, int64_t pos0, int kvh, int G,
                         int nqv, int nblk, PrefillScratch& s) {
  for (int j = 0; j < nblk * kLanes; ++j) {
    const int b = j / kLanes, lane = j % kLanes;
    const bool real = j < nqv;
    const int r = (real ? j : nqv - 1) / G;
    s.pos[j] = static_cast<int32_t>(pos0 + r);
    const int64_t q0 = ((qrow0 + r) * p.num_heads + static_cast<int64_t>(kvh) * G + j % G) * kD;
    for (int d = 0; d < kD; ++d) {
      if constexpr (kDot) {
        const uint16_t bits = real ? static_cast<const c10::BFloat16*>(p.q)[q0 + d].x : 0;
        auto* pair = reinterpret_cast<uint16_t*>(&s.qp[(b * (kD / 2) + d / 2) * kLanes + lane]);
        pair[d & 1] = bits;  // NOTE: vdpbf16ps pairs: the even dim in the low half
      } else {
        float x = 0.0f;
        if (real) {
          x = p.q_is_bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(p.q)[q0 + d])
                          : static_cast<const float*>(p.q)[q0 + d];
        }
        s.qf[(b * kD + d) * kLanes + lane] = x;
      }
    }
  }
}

// Scores of lane block b against the staged tile: sc[t] = q . K[t] (unscaled).
template <int kD, bool kDot>
inline void block_scores(const PrefillScratch& s, int b, VecF* sc) {
  for (int t = 0; t < kTile; ++t) sc[t] = vzero<VecF>();
#if defined(PAGODA_PREFILL_DOT)
  if constexpr (kDot) {
    const auto* kp = reinterpret_cast<const int32_t*>(s.kb.data());
    const uint32_t* qb = s.qp.data() + b * (kD / 2) * kLanes;
    for (int dp = 0; dp < kD / 2; ++dp) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + dp * kLanes);
      for (int t = 0; t < kTile; ++t) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(kp[t * (kD / 2) + dp]);
        sc[t] = _mm512_dpbf16_ps(sc[t], qv, kv);
      }
    }
    return;
  }
#endif
  // NOTE: AVX2 has 16 registers: the tile's sums in two halves (the same sums in each lane).
  constexpr int kRows = kLanes == 16 ? kTile : kTile / 2;
  for (int t0 = 0; t0 < kTile; t0 += kRows) {
    for (int d = 0; d < kD; ++d) {
      const VecF qv = vload<VecF>(s.qf.data() + (b * kD + d) * kLanes);
      for (int t = t0; t < t0 + kRows; ++t) {
        sc[t] = vfmadd(qv, vset1<VecF>(s.kf[t * kD + d]), sc[t]);
      }
    }
  }
}

// One lane block against the staged tile (positions key0 + t): scores, the online-softmax
// update with each lane's causal / window mask, then the values into the accumulators.
// acc[d] = acc[d] * corr + sum_t p[t] * V[t][d] for one lane block: fp32 FMAs on the fp32 V
// rows, or (kDot) vdpbf16ps on the bf16 V row pairs and the probabilities (times their V
// scales) rounded to bf16 pairs.
template <int kD, bool kDot>
inline void block_values(float* acc, const VecF* pr, VecF corr, const PrefillScratch& s) {
#if defined(PAGODA_PREFILL_DOT)
  if constexpr (kDot) {
    alignas(64) int16_t order[32];
    for (int i = 0; i < 16; ++i) {
      order[2 * i] = static_cast<int16_t>(i), order[2 * i + 1] = static_cast<int16_t>(16 + i);
    }
    const __m512i idx = _mm512_load_si512(order);
    __m512bh pp[kTile / 2];
    for (int i = 0; i < kTile / 2; ++i) {
      const __m512 pa = _mm512_mul_ps(pr[2 * i], _mm512_set1_ps(s.vs[2 * i]));
      const __m512 pb = _mm512_mul_ps(pr[2 * i + 1], _mm512_set1_ps(s.vs[2 * i + 1]));
      const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(pb, pa);
      pp[i] = (__m512bh)_mm512_permutexvar_epi16(idx, w);
    }
    constexpr int kChunk = 16;
    const auto* vp = reinterpret_cast<const int32_t*>(s.vp.data());
    for (int d0 = 0; d0 < kD; d0 += kChunk) {
      __m512 a[kChunk];
      for (int i = 0; i < kChunk; ++i) {
        a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + i) * kLanes), corr);
      }
      for (int t2 = 0; t2 < kTile / 2; ++t2) {
        for (int i = 0; i < kChunk; ++i) {
          const __m512bh v = (__m512bh)_mm512_set1_epi32(vp[t2 * kD + d0 + i]);
          a[i] = _mm512_dpbf16_ps(a[i], pp[t2], v);
        }
      }
      for (int i = 0; i < kChunk; ++i) _mm512_storeu_ps(acc + (d0 + i) * kLanes, a[i]);
    }
    return;
  }
#endif
  // Accumulators held in registers beside the 16 probabilities (AVX2: beside one of them).
  constexpr int kChunk = kLanes == 16 ? 8 : 4;
  for (int d0 = 0; d0 < kD; d0 += kChunk) {
    VecF a[kChunk];
    for (int i = 0; i < kChunk; ++i) a[i] = vmul(vload<VecF>(acc + (d0 + i) * kLanes), corr);
    for (int t = 0; t < kTile; ++t) {
      const float* vr = s.vf.data() + t * kD + d0;
      for (int i = 0; i < kChunk; ++i) a[i] = vfmadd(pr[t], vset1<VecF>(vr[i]), a[i]);
    }
    for (int i = 0; i < kChunk; ++i) vstore(acc + (d0 + i) * kLanes, a[i]);
  }
}

template <int kD, bool kDot>
inline void block_step(const PrefillProblem& p, int64_t key0, const TileRows& tr, int b,
                       PrefillScratch& s) {
  VecF sc[kTile];
  block_scores<kD, kDot>(s, b, sc);
  const VecI pos = viload(s.pos.data() + b * kLanes);
  // NOTE: a key at k is in a query's window iff k >= pos - window + 1 (the caller keeps
  // window below 2^31: a longer one is no window).
  const VecI first = visub(pos, viset1(static_cast<int32_t>(p.window - 1)));
  const VecF neg_inf = vset1<VecF>(-std::numeric_limits<float>::infinity());
  const VecF m_old = vload<VecF>(s.m.data() + b * kLanes);
  VecF m_new = m_old;
  Mask valid[kTile];
  for (int t = 0; t < kTile; ++t) {
    Mask k = mask_none();
    if (t >= tr.lo && t < tr.hi) {
      const VecI kp = viset1(static_cast<int32_t>(key0 + t));
      k = mask_le(kp, pos);
      if (p.window >= 0) k = mask_and(k, mask_ge(kp, first));
    }
    valid[t] = k;
    sc[t] = vselect(k, vmul(sc[t], vset1<VecF>(s.ks[t])), neg_inf);
    m_new = vmax(m_new, sc[t]);
  }
  // NOTE: a lane with no key yet has m = -inf: its rescale and probabilities come out of
  // vexp_nonpos's clamp (NaN or -inf arguments give ~1e-38) and are masked or multiply 0.
  const VecF corr = vexp_nonpos(vsub(m_old, m_new));
  VecF l = vload<VecF>(s.l.data() + b * kLanes);
  for (int t = 0; t < kTile; ++t) {
    sc[t] = vkeep(valid[t], vexp_nonpos(vsub(sc[t], m_new)));
    // NOTE: l * corr + p[0] in one rounding, then the other probabilities added one by one.
    l = t == 0 ? vfmadd(l, corr, sc[0]) : vadd(l, sc[t]);
  }
  vstore(s.m.data() + b * kLanes, m_new);
  vstore(s.l.data() + b * kLanes, l);

  block_values<kD, kDot>(s.acc.data() + static_cast<int64_t>(b) * kD * kLanes, sc, corr, s);
}

template <typename KV, int kD, bool kDot>
void prefill_item(const PrefillProblem& p, const KV* k_cache, const KV* v_cache,
                  const WorkItem& it, PrefillScratch& s) {
  const int G = p.num_heads / p.num_kv_heads;
  const int nqv = it.rows * G;
  const int nblk = (nqv + kLanes - 1) / kLanes;
  const int64_t pos0 = p.seq_lens[it.req] - p.query_lens[it.req] + it.row0;
  const int64_t end = pos0 + it.rows;  // one past the last row's position
  const int64_t qrow0 = p.query_starts[it.req] + it.row0;
  load_queries<kD, kDot>(p, qrow0, pos0, it.kvh, G, nqv, nblk, s);
  std::fill(s.acc.begin(), s.acc.begin() + nblk * kD * kLanes, 0.0f);
  std::fill(s.m.begin(), s.m.begin() + nblk * kLanes, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + nblk * kLanes, 0.0f);

  const int64_t start = p.window >= 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * kD;
  const int64_t col = static_cast<int64_t>(it.kvh) * kD;
  const int64_t* table = p.block_tables + it.req * p.bt_stride;
  const int64_t first = start / kTile, last = (end - 1) / kTile;
  TileRows rows[2];
  if (start < end) tile_rows(p.block_size, table, row_stride, first, start, end, rows[0]);
  for (int64_t tile = first; start < end && tile <= last; ++tile) {
    const TileRows& tr = rows[(tile - first) & 1];
    stage_tile<KV, kD, kDot>(p, k_cache, v_cache, tr, col, it.kvh, s);
    if (tile < last) {
      TileRows& next = rows[(tile - first + 1) & 1];
      tile_rows(p.block_size, table, row_stride, tile + 1, start, end, next);
      prefetch_tile<KV, kD>(p, k_cache, v_cache, next, col, it.kvh);
    }
    for (int b = 0; b < nblk; ++b) block_step<kD, kDot>(p, tile * kTile, tr, b, s);
  }

  for (int j = 0; j < nqv; ++j) {
    const int b = j / kLanes, lane = j % kLanes;
    const float l = s.l[b * kLanes + lane];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t o0 =
        ((qrow0 + j / G) * p.num_heads + static_cast<int64_t>(it.kvh) * G + j % G) * kD;
    const float* a = s.acc.data() + static_cast<int64_t>(b) * kD * kLanes + lane;
    if (p.q_is_bf16) {
      auto* o = static_cast<c10::BFloat16*>(p.out) + o0;
      for (int d = 0; d < kD; ++d) o[d] = c10::BFloat16(a[d * kLanes] * inv);
    } else {
      float* o = static_cast<float*>(p.out) + o0;
      for (int d = 0; d < kD; ++d) o[d] = a[d * kLanes] * inv;
    }
  }
}

template <typename KV, int kD, bool kDot>
void prefill_all(const PrefillProblem& p, const KV* k_cache, const KV* v_cache,
                 int64_t num_reqs) {
  const int G = p.num_heads / p.num_kv_heads;
  const int rows_per_item = std::max(1, kMaxQueryVectors<kD> / G);
  const int max_blocks = (rows_per_item * G + kLanes - 1) / kLanes;
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = p.query_lens[r];
    if (n <= 0) continue;
    // NOTE: later rows read more keys; listed first, dynamic scheduling evens out the rest.
    for (int64_t row0 = (n - 1) / rows_per_item * rows_per_item; row0 >= 0;
         row0 -= rows_per_item) {
      const int rows = static_cast<int>(std::min<int64_t>(rows_per_item, n - row0));
      for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) items.push_back({r, row0, rows, kvh});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int num_threads = static_cast<int>(
      std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(num_items, 1)));
#pragma omp parallel num_threads(num_threads)
  {
    PrefillScratch s(max_blocks, kD);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      prefill_item<KV, kD, kDot>(p, k_cache, v_cache, items[i], s);
    }
  }
}

template <typename KV, int kD>
void dispatch_prefill(const PrefillProblem& p, const KV* k, const KV* v, int64_t num_reqs) {
#if defined(PAGODA_PREFILL_DOT)
  // NOTE: a float32 q or cache keeps the fp32 FMAs (the exact path).
  if constexpr (!std::is_same_v<KV, float>) {
    if (g_use_bf16_dot && p.q_is_bf16) return prefill_all<KV, kD, true>(p, k, v, num_reqs);
  }
#endif
  prefill_all<KV, kD, false>(p, k, v, num_reqs);
}

template <typename KV>
void dispatch_head_dim(const PrefillProblem& p, int head_dim, const KV* k, const KV* v,
                       int64_t num_reqs) {
  switch (head_dim) {
    case 32:
      return dispatch_prefill<KV, 32>(p, k, v, num_reqs);
    case 64:
      return dispatch_prefill<KV, 64>(p, k, v, num_reqs);
    case 96:
      return dispatch_prefill<KV, 96>(p, k, v, num_reqs);
    case 128:
      return dispatch_prefill<KV, 128>(p, k, v, num_reqs);
    case 256:
      return dispatch_prefill<KV, 256>(p, k, v, num_reqs);
    default:
      TORCH_CHECK(false, "paged_prefill_attention: head dim ", head_dim,
                  " is not one of 32, 64, 96, 128, 256");
  }
}
#endif  // PAGODA_PREFILL_AVX512 || PAGODA_PREFILL_AVX2

// The requests' arguments, checked: rows inside q, contexts inside their tables, and the
// block ids each request reads inside the cache.
void check_requests(const torch::Tensor& q, const torch::Tensor& bt, const int64_t* starts,
                    const int64_t* qlens, const int64_t* lens, int64_t num_reqs,
                    int64_t block_size, int64_t num_blocks, int64_t window) {
  const int64_t max_len = bt.size(1) * block_size;
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(qlens[r] >= 0 && starts[r] >= 0 && starts[r] + qlens[r] <= q.size(0),
                "request ", r, ": query rows [", starts[r], ", ", starts[r] + qlens[r],
                ") are outside q's ", q.size(0), " rows");
    TORCH_CHECK(lens[r] >= qlens[r] && lens[r] <= max_len, "request ", r, ": seq_len ",
                lens[r], " out of range (query_len ", qlens[r], ", table of ", max_len,
                " positions)");
    if (qlens[r] == 0) continue;
    const int64_t pos0 = lens[r] - qlens[r];
    const int64_t start = window >= 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
    check_block_ids(bt.data_ptr<int64_t>() + r * bt.size(1), r, start, lens[r], block_size,
                    num_blocks);
  }
}

void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor query_starts, torch::Tensor query_lens,
                             torch::Tensor seq_lens, double scale, int64_t sliding_window,
                             std::optional<torch::Tensor> k_scale,
                             std::optional<torch::Tensor> v_scale) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, k_scale, v_scale, "[T, H, D]");
  const int64_t num_reqs = query_starts.numel();
  TORCH_CHECK(query_starts.dim() == 1 && query_lens.sizes() == query_starts.sizes() &&
                  seq_lens.sizes() == query_starts.sizes(),
              "query_starts, query_lens and seq_lens must be [R]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_reqs,
              "block_tables: [R, M]");
  if (num_reqs == 0) return;

  auto bt = pagoda_index::as_long(block_tables);
  auto qs = pagoda_index::as_long(query_starts);
  auto ql = pagoda_index::as_long(query_lens);
  auto sl = pagoda_index::as_long(seq_lens);
  const int block_size = shape.block_size;
  // NOTE: a window longer than every table reads everything (and keeps the lanes' int32
  // window arithmetic in range).
  if (sliding_window > bt.size(1) * block_size) sliding_window = -1;
  check_requests(q, bt, qs.data_ptr<int64_t>(), ql.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                 num_reqs, block_size, k_cache.size(0), sliding_window);
  if (pagoda_prefill_amx::takes(
          q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
          shape.quantized, shape.head_dim)) {
    pagoda_prefill_amx::run(
        reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
        bt.data_ptr<int64_t>(), bt.size(1), qs.data_ptr<int64_t>(), ql.data_ptr<int64_t>(),
        sl.data_ptr<int64_t>(), num_reqs, shape.num_heads, shape.num_kv_heads,
        shape.head_dim, block_size, static_cast<float>(scale), sliding_window);
    return;
  }
#if defined(PAGODA_PREFILL_AVX512) || defined(PAGODA_PREFILL_AVX2)
  PrefillProblem p{q.data_ptr(), out.data_ptr(), q.scalar_type() == at::kBFloat16,
                   bt.data_ptr<int64_t>(), bt.size(1), qs.data_ptr<int64_t>(),
                   ql.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), shape.num_heads,
                   shape.num_kv_heads, block_size, static_cast<float>(scale), sliding_window};
  if (shape.quantized) {
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
  }
  visit_caches(k_cache, v_cache, [&](const auto* k, const auto* v) {
    dispatch_head_dim(p, shape.head_dim, k, v, num_reqs);
  });
#else
  TORCH_CHECK(false,
              "paged_prefill_attention needs AVX-512 or AVX2 + FMA (this build has neither)");
#endif
}

}  // namespace

// The instruction-set extensions the tiled prefill kernel was compiled to use; empty: not
// built (neither AVX-512 nor AVX2 + FMA), the caller keeps the decode kernel's rows.
std::vector<std::string> prefill_attention_isa() {
  std::vector<std::string> isa;
#if defined(PAGODA_PREFILL_AVX512)
  isa.push_back("avx512f");
#elif defined(PAGODA_PREFILL_AVX2)
  isa.push_back("avx2");
  isa.push_back("fma");
#endif
#if defined(PAGODA_PREFILL_DOT)
  isa.push_back("avx512_bf16");
  isa.push_back("avx512bw");
#endif
  return isa;
}

void register_prefill_attention(pybind11::module& m) {
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Prefill attention over a paged KV cache, tiles of query rows (in place into out)",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("query_starts"),
        pybind11::arg("query_lens"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("sliding_window"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none());
  m.def("prefill_amx_compiled", &pagoda_prefill_amx::compiled,
        "whether paged_prefill_attention's AMX path is in this build");
  m.def(
      "set_prefill_amx",
      [](bool on) {
        TORCH_CHECK(!on || pagoda_prefill_amx::compiled(),
                    "the AMX prefill path is not in this build");
        pagoda_prefill_amx::g_enabled.store(on);
      },
      "bf16 prefills on AMX tiles (only once the process was granted AMX's tile state)");
  m.def("prefill_amx_enabled", [] { return pagoda_prefill_amx::g_enabled.load(); });
}
