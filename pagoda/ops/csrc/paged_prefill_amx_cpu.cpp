// Prefill attention on AMX tiles: bf16 q over a bf16 paged cache, both products of the
// online softmax as TDPBF16PS (paged_prefill_cpu.cpp calls it where it is on; its own
// vector path runs everything else).
//
// One work item: query rows [i0, i0 + n) of one request (n <= kItemRows) and the G = H / Hk
// query heads of one kv head: G * ceil(n / 16) row tiles of 16 query rows of one head. The
// item's keys are staged from the cache a chunk at a time, once for all its row tiles:
//   K^T   per 32 positions and 32 head dims, two B tiles (positions 0-15, 16-31): tile row j
//         holds dims 2j, 2j + 1 of each of the 16 positions (a 32-bit transpose of the rows);
//   V     per 32 positions and 16 head dims, one B tile: row j holds positions 2j and 2j + 1
//         of each of the 16 dims, interleaved.
// Positions outside the item's range are staged as zeros. Then for each row tile, the blocks
// of a chunk it needs in two passes:
//   1. per block, S = Q K^T (two 16 x 16 float32 tiles, summed over D / 32 chunks), stored;
//      then P = 2^(S * scale * log2(e) - m) per row, masked (causal, window), rounded to bf16,
//      kept per block (16 x 32 bf16: one A tile); the next block's products are issued before
//      this block's softmax, so the tile unit and the vector units overlap;
//   2. O += P V over those blocks, O (16 x 64 head dims: tiles 0-3) held in tiles meanwhile.
// m is the row's running max, but it only moves when a score exceeds it by more than
// kSlack2 (base 2): then the blocks before are run through pass 2, and O and the row sum l
// are scaled by alpha = 2^(m_old - m_new) (the online softmax, with its rescale made rare).
//
// Numerics: q . k as bf16 products exact in float32, summed in float32 (in TDPBF16PS's order,
// not the vector path's); the softmax in float32 with a base-2 exp (its own polynomial,
// relative error about 3e-6); P at most 2^kSlack2, rounded to bf16 before P V (2^-9 relative
// each, as the vector path's vdpbf16ps does), its row sums taken before that rounding; O
// summed in float32 in tile order; the output rounded once. O and l share m, so a lagging m
// changes only rounding. AMX flushes bf16 denormal inputs to zero.
//
// Tiles: 16 rows x 64 bytes each. Pass 1: S in 0-1 or 2-3 (alternate blocks), K^T in 4-5, Q in
// 6-7 (kept from block to block where D is 64); pass 2: O in 0-3, P in 4, V in 5-7.

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGODA_PREFILL_AMX 1
#include "amx_tiles_cpu.h"
#endif

namespace pagoda_prefill_amx {

// Set once per process by ops/cpu.py where the CPU lists amx_bf16 and the kernel was granted
// AMX's tile state (arch_prctl); never on otherwise: a tile instruction would fault.
std::atomic<bool> g_enabled{false};

bool compiled() {
#if defined(PAGODA_PREFILL_AMX)
  return true;
#else
  return false;
#endif
}

bool takes(bool bf16, bool quantized, int head_dim) {
  return compiled() && g_enabled.load(std::memory_order_relaxed) && bf16 && !quantized &&
         head_dim % 64 == 0 && head_dim <= 256;
}

#if defined(PAGODA_PREFILL_AMX)
using pagoda_attn::TileRows;
using pagoda_attn::tile_rows;

constexpr int kKeys = 32;         // positions per block: one row of P is one A-tile row
constexpr int kChunkKeys = 512;   // positions staged at once for an item
constexpr int kItemRows = 64;     // query rows per item (four row tiles per query head)
constexpr float kSlack2 = 8.0f;   // how far (base 2) a score may exceed the running max

struct Problem {
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* k;
  const uint16_t* v;
  const int64_t* bt;
  int64_t bt_stride;
  const int64_t* qs;
  const int64_t* ql;
  const int64_t* sl;
  int H, Hk, D, bs;
  float scale;
  int64_t window;
};

struct Item {
  int64_t r, i0;
  int kvh, n;
  int64_t cost;
};

// Per thread: the staged chunk, the item's queries and its row tiles' softmax state.
struct Scratch {
  std::vector<uint16_t> kt, vp, q;  // staged K^T / V pairs (per block), Q rows per row tile
  std::vector<uint16_t> p;          // one row tile's P per block of a chunk, before P V
  std::vector<float> o, m, l;       // per row tile: O [16][D], running max [16], sum [16][16]
  alignas(64) float s[2][16 * kKeys];  // S of two blocks in flight (scores' s0 / 2)
  alignas(64) float alpha[16];
};

// r[e] = the 16 rows' 32-bit elements e (r[p] held row p's 16 elements).
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane L: rows 4i .. 4i + 3 at element 4L + j.
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Element 4L + j gathers lane L of u[j], u[4 + j], u[8 + j], u[12 + j].
  for (int j = 0; j < 4; ++j) {
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v2 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v2, w2, 0xDD);
  }
}

// The key block [p0, p0 + 32) of kv head kvh into the chunk's staging slot b: K^T and V pairs.
void stage_block(const Problem& pr, const int64_t* table, int kvh, int64_t p0, int64_t kstart,
                 int64_t kend, uint16_t* kt, uint16_t* vp) {
  const int D = pr.D;
  const int64_t row_stride = static_cast<int64_t>(pr.Hk) * D;
  const uint16_t* krow[kKeys];
  const uint16_t* vrow[kKeys];
  for (int h = 0; h < 2; ++h) {
    const int64_t t0 = p0 + 16 * h;
    TileRows tr{};
    if (t0 < kend && t0 + 16 > kstart) {
      tile_rows(pr.bs, table, row_stride, t0 / 16, kstart, kend, tr);
    } else {
      tr.lo = tr.hi = 0;
    }
    for (int t = 0; t < 16; ++t) {
      const bool ok = t >= tr.lo && t < tr.hi;
      krow[16 * h + t] = ok ? pr.k + tr.off[t] + static_cast<int64_t>(kvh) * D : nullptr;
      vrow[16 * h + t] = ok ? pr.v + tr.off[t] + static_cast<int64_t>(kvh) * D : nullptr;
    }
  }
  // K^T: per 32-dim chunk c and half h a 16 x 16 transpose of 32-bit (dim pair) elements.
  const __m512i zero16 = _mm512_setzero_si512();
  for (int c = 0; c < D / 32; ++c) {
    for (int h = 0; h < 2; ++h) {
      __m512i rows[16];
      for (int pos = 0; pos < 16; ++pos) {
        const uint16_t* row = krow[16 * h + pos];
        rows[pos] = row != nullptr ? _mm512_loadu_si512(row + 32 * c) : zero16;
      }
      transpose16x16_epi32(rows);
      uint16_t* dst = kt + (c * 2 + h) * 512;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + 32 * j, rows[j]);
    }
  }
  // V pairs: per 16-dim group g, row j = positions 2j, 2j + 1 interleaved over the dims.
  const __m256i zero = _mm256_setzero_si256();
  for (int g = 0; g < D / 16; ++g) {
    uint16_t* dst = vp + g * 512;
    for (int j = 0; j < 16; ++j) {
      const uint16_t* ra = vrow[2 * j];
      const uint16_t* rb = vrow[2 * j + 1];
      const __m256i a = ra != nullptr
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 16 * g)) : zero;
      const __m256i b = rb != nullptr
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + 16 * g)) : zero;
      const __m256i lo = _mm256_unpacklo_epi16(a, b);  // dims 0-3 | 8-11
      const __m256i hi = _mm256_unpackhi_epi16(a, b);  // dims 4-7 | 12-15
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * j),
                          _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * j + 16),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}

// S = Q K^T for one row tile and one staged block into tiles s0 (positions 0-15) and s0 + 1
// (16-31), stored to s [16][32]; Q chunks in tiles 6 and 7, K^T in 4 and 5.
// NOTE: the caller alternates s0 between 0 and 2, so that the next block's products can run
// on the tile unit while the vector softmax of this one runs (no tile is renamed: a product
// into the tiles just stored would wait for that store).
// NOTE: a macro, since the tile intrinsics take their tile numbers as literals.
#define PAGODA_SCORES(S0, S1)                          \
  _tile_zero(S0);                                      \
  _tile_zero(S1);                                      \
  for (int c = 0; c < D / 32; c += 2) {                \
    if (load_q) {                                      \
      _tile_loadd(6, q + 32 * c, D * 2);               \
      _tile_loadd(7, q + 32 * (c + 1), D * 2);         \
    }                                                  \
    _tile_loadd(4, kt + (c * 2) * 512, 64);            \
    _tile_loadd(5, kt + (c * 2 + 1) * 512, 64);        \
    _tile_dpbf16ps(S0, 6, 4);                          \
    _tile_dpbf16ps(S1, 6, 5);                          \
    _tile_loadd(4, kt + (c * 2 + 2) * 512, 64);        \
    _tile_loadd(5, kt + (c * 2 + 3) * 512, 64);        \
    _tile_dpbf16ps(S0, 7, 4);                          \
    _tile_dpbf16ps(S1, 7, 5);                          \
  }                                                    \
  _tile_stored(S0, s, kKeys * 4);                      \
  _tile_stored(S1, s + 16, kKeys * 4)

inline void scores(int s0, bool load_q, const uint16_t* q, const uint16_t* kt, int D,
                   float* s) {
  if (s0 == 0) {
    PAGODA_SCORES(0, 1);
  } else {
    PAGODA_SCORES(2, 3);
  }
}
#undef PAGODA_SCORES

// 2^y for y <= kSlack2: the exp of the softmax in base 2, so that the scale's log2(e) folds
// into the scores' one multiply. Its polynomial is a degree-4 fit of 2^f on f in [-1/2, 1/2]
// (relative error 2.7e-6: a higher degree buys nothing, P being rounded to bf16's 2^-9).
// scalef gives 0 for large negative n.
// kClamp: y may be -inf or hold lanes that are masked off afterwards (clamped to -150, whose
// result is 0); without it y must be finite, as a full block's scores are.
template <bool kClamp>
__attribute__((always_inline)) inline __m512 vexp2(__m512 y) {
  if constexpr (kClamp) y = _mm512_max_ps(y, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(9.570082649588585e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591784417629242e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
  return _mm512_scalef_ps(p, n);
}

// One row tile's P for one key block: 16 rows of 32 bf16, the A tile of P V.
constexpr int kPBlock = 16 * kKeys;

// The softmax of one row tile over one staged block, its S in s (unscaled): P into p,
// the row sums into l, the running maxima m moved where a row's scores rose more than kSlack2
// above it (those rows' factors alpha[r] < 1 for the O accumulated so far; 1 elsewhere).
// Returns whether any row's max moved so (O must then be brought up to the previous block
// and rescaled before this block's P V).
//
// NOTE: the max m is the largest score seen, but held back until a score exceeds it by more
// than kSlack2 (in base 2): P's values are then at most 2^kSlack2, and the common block needs
// no horizontal max and no rescaling of O, which stays in tiles across blocks. O and l share
// m, so O / l is the same softmax; only rounding differs.
//
// kFull: every one of the 16 rows sees every key of the block (a block below the diagonal,
// inside any window): no masks, and the exp needs no clamp. That is nearly every block of a
// long prompt, so it gets its own loop.
template <bool kFull>
bool softmax_rows(const Problem& pr, Scratch& sc, const float* s, int rows, int64_t qp0,
                  int64_t p0, float* m, float* l, uint16_t* p) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float sl2 = pr.scale * 1.44269504088896341f;
  const __m512 vsl2 = _mm512_set1_ps(sl2);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pa = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(p0)), iota);
  const __m512i pb = _mm512_add_epi32(pa, _mm512_set1_epi32(16));
  bool moved = false;
  for (int r = 0; r < 16; ++r) {
    uint16_t* prow = p + r * kKeys;
    sc.alpha[r] = 1.0f;
    __mmask16 ka = 0xFFFF, kb = 0xFFFF;
    if constexpr (!kFull) {
      if (r >= rows) {
        ka = kb = 0;
      } else {
        const int64_t qp = qp0 + r;
        const int64_t lo = pr.window >= 0 ? std::max<int64_t>(0, qp - pr.window + 1) : 0;
        const __m512i vqp = _mm512_set1_epi32(static_cast<int>(qp));
        const __m512i vlo = _mm512_set1_epi32(static_cast<int>(lo));
        ka = _mm512_cmple_epi32_mask(pa, vqp) & _mm512_cmpge_epi32_mask(pa, vlo);
        kb = _mm512_cmple_epi32_mask(pb, vqp) & _mm512_cmpge_epi32_mask(pb, vlo);
      }
      if ((ka | kb) == 0) {
        _mm512_storeu_si512(prow, _mm512_setzero_si512());
        continue;
      }
    }
    const __m512 sa = _mm512_load_ps(s + r * kKeys);
    const __m512 sb = _mm512_load_ps(s + r * kKeys + 16);
    float mr = m[r];
    __m512 ya, yb;
    bool over = mr == neg_inf;
    if (!over) {
      const __m512 mv = _mm512_set1_ps(mr);
      ya = _mm512_fmsub_ps(sa, vsl2, mv);
      yb = _mm512_fmsub_ps(sb, vsl2, mv);
      const __m512 lim = _mm512_set1_ps(kSlack2);
      over = (_mm512_mask_cmp_ps_mask(ka, ya, lim, _CMP_GT_OQ) |
              _mm512_mask_cmp_ps_mask(kb, yb, lim, _CMP_GT_OQ)) != 0;
    }
    if (over) {
      // NOTE: scale > 0, so the largest score is the largest scaled one.
      const float mx = sl2 * std::max(_mm512_mask_reduce_max_ps(ka, sa),
                                      _mm512_mask_reduce_max_ps(kb, sb));
      if (mr != neg_inf) {  // O and l so far are this row's: rescaled (else both are 0)
        const float alpha = std::exp2(mr - mx);
        sc.alpha[r] = alpha;
        float* lr = l + r * 16;
        _mm512_storeu_ps(lr, _mm512_mul_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(alpha)));
        moved = true;
      }
      mr = mx;
      m[r] = mx;
      const __m512 mv = _mm512_set1_ps(mr);
      ya = _mm512_fmsub_ps(sa, vsl2, mv);
      yb = _mm512_fmsub_ps(sb, vsl2, mv);
    }
    __m512 ea = vexp2<!kFull>(ya), eb = vexp2<!kFull>(yb);
    if constexpr (!kFull) {
      ea = _mm512_maskz_mov_ps(ka, ea);
      eb = _mm512_maskz_mov_ps(kb, eb);
    }
    // The row's sum per lane, reduced once at the end.
    float* lr = l + r * 16;
    _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_loadu_ps(lr), _mm512_add_ps(ea, eb)));
    _mm512_storeu_si512(prow, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(eb, ea)));
  }
  return moved;
}

bool softmax_block(const Problem& pr, Scratch& sc, const float* s, int rows, int64_t qp0,
                   int64_t p0, float* m, float* l, uint16_t* p) {
  const int64_t qp_last = qp0 + rows - 1;
  const bool full = rows == 16 && p0 + kKeys - 1 <= qp0 &&
                    (pr.window < 0 || p0 >= qp_last - pr.window + 1);
  return full ? softmax_rows<true>(pr, sc, s, rows, qp0, p0, m, l, p)
              : softmax_rows<false>(pr, sc, s, rows, qp0, p0, m, l, p);
}

// O += P V over the blocks listed (their P in sc.p, slot i for blk[i]), O [16][D] float32 in
// memory, held in tiles 0-3 per 64 head dims meanwhile.
void accumulate_pv(const Scratch& sc, const int* blk, int nb, int D, float* o) {
  if (nb == 0) return;
  for (int g4 = 0; g4 < D / 64; ++g4) {
    float* og = o + 64 * g4;
    _tile_loadd(0, og, D * 4);
    _tile_loadd(1, og + 16, D * 4);
    _tile_loadd(2, og + 32, D * 4);
    _tile_loadd(3, og + 48, D * 4);
    for (int i = 0; i < nb; ++i) {
      const uint16_t* v = sc.vp.data() + static_cast<size_t>(blk[i]) * D * kKeys + g4 * 4 * 512;
      _tile_loadd(4, sc.p.data() + static_cast<size_t>(i) * kPBlock, kKeys * 2);
      _tile_loadd(5, v, 64);
      _tile_loadd(6, v + 512, 64);
      _tile_loadd(7, v + 1024, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, og, D * 4);
    _tile_stored(1, og + 16, D * 4);
    _tile_stored(2, og + 32, D * 4);
    _tile_stored(3, og + 48, D * 4);
  }
}

void run_item(const Problem& pr, const Item& it, Scratch& sc) {
  const int D = pr.D, G = pr.H / pr.Hk, tiles = (it.n + 15) / 16, rt_n = G * tiles;
  const int64_t qlen = pr.ql[it.r], seq = pr.sl[it.r], qstart = pr.qs[it.r];
  const int64_t pos0 = seq - qlen + it.i0;  // the item's first query position
  const int64_t kend = pos0 + it.n;          // one past its last query position
  const int64_t kstart = pr.window >= 0 ? std::max<int64_t>(0, pos0 - pr.window + 1) : 0;
  const int64_t* table = pr.bt + it.r * pr.bt_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Q rows per row tile (zeros past n), O = 0, m = -inf, l = 0.
  std::fill(sc.q.begin(), sc.q.begin() + static_cast<size_t>(rt_n) * 16 * D, uint16_t{0});
  std::fill(sc.o.begin(), sc.o.begin() + static_cast<size_t>(rt_n) * 16 * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rt_n * 16, neg_inf);
  std::fill(sc.l.begin(), sc.l.begin() + rt_n * 256, 0.0f);
  for (int g = 0; g < G; ++g) {
    const int h = it.kvh * G + g;
    for (int i = 0; i < it.n; ++i) {
      const uint16_t* src = pr.q + ((qstart + it.i0 + i) * pr.H + h) * D;
      std::memcpy(sc.q.data() + ((g * tiles + i / 16) * 16 + i % 16) * D, src, D * 2);
    }
  }
  const int64_t first = kstart / kKeys * kKeys;
  int blk[kChunkKeys / kKeys];
  for (int64_t c0 = first; c0 < kend; c0 += kChunkKeys) {
    const int nblk = static_cast<int>(std::min<int64_t>(kChunkKeys, kend - c0 + kKeys - 1) /
                                      kKeys);
    const int kt_block = D * kKeys, vp_block = D * kKeys;
    for (int b = 0; b < nblk; ++b) {
      stage_block(pr, table, it.kvh, c0 + b * kKeys, kstart, kend, sc.kt.data() + b * kt_block,
                  sc.vp.data() + b * vp_block);
    }
    for (int rt = 0; rt < rt_n; ++rt) {
      const int tile = rt % tiles;
      const int rows = std::min(16, it.n - 16 * tile);
      const int64_t qp0 = pos0 + 16 * tile;      // position of the tile's row 0
      const int64_t qp_last = qp0 + rows - 1;
      const int64_t lo0 = pr.window >= 0 ? std::max<int64_t>(0, qp0 - pr.window + 1) : 0;
      const uint16_t* q = sc.q.data() + static_cast<size_t>(rt) * 16 * D;
      float* o = sc.o.data() + static_cast<size_t>(rt) * 16 * D;
      float* m = sc.m.data() + rt * 16;
      float* l = sc.l.data() + rt * 256;
      // The blocks whose P waits for its P V (P in sc.p's slots 0 .. nb - 1).
      int nb = 0;
      bool q_stale = true;  // Q not in tiles 6 and 7
      // The softmax of block b, its S in sc.s[parity]; its P into slot nb.
      auto softmax = [&](int b, int parity) {
        uint16_t* slot = sc.p.data() + static_cast<size_t>(nb) * kPBlock;
        if (softmax_block(pr, sc, sc.s[parity], rows, qp0, c0 + b * kKeys, m, l, slot)) {
          // Some row's max moved: O up to the previous block, rescaled, then this block's P
          // (made with the new max) moved to slot 0.
          accumulate_pv(sc, blk, nb, D, o);
          q_stale = true;
          for (int r = 0; r < rows; ++r) {
            if (sc.alpha[r] == 1.0f) continue;
            const __m512 al = _mm512_set1_ps(sc.alpha[r]);
            for (int d = 0; d < D; d += 16) {
              _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), al));
            }
          }
          if (nb > 0) std::memcpy(sc.p.data(), slot, kPBlock * 2);
          nb = 0;
        }
        blk[nb++] = b;
      };
      int prev = -1, parity = 0;
      for (int b = 0; b < nblk; ++b) {
        const int64_t p0 = c0 + b * kKeys;
        if (p0 > qp_last || p0 + kKeys <= lo0) continue;  // no row of the tile sees it
        // NOTE: this block's products are issued before the previous block's softmax, so that
        // the tile unit and the vector units work at once.
        // NOTE: Q (64 head dims: tiles 6 and 7) stays in its tiles from block to block, until
        // a P V pass takes them.
        scores(2 * parity, q_stale || D > 64, q, sc.kt.data() + b * kt_block, D, sc.s[parity]);
        q_stale = false;
        if (prev >= 0) softmax(prev, parity ^ 1);
        prev = b;
        parity ^= 1;
      }
      if (prev >= 0) softmax(prev, parity ^ 1);
      accumulate_pv(sc, blk, nb, D, o);
    }
  }
  // out = O / l, rounded once to bf16.
  for (int rt = 0; rt < rt_n; ++rt) {
    const int g = rt / tiles, tile = rt % tiles;
    const int h = it.kvh * G + g;
    const int rows = std::min(16, it.n - 16 * tile);
    for (int r = 0; r < rows; ++r) {
      const int64_t row = qstart + it.i0 + 16 * tile + r;
      const float* orow = sc.o.data() + (static_cast<size_t>(rt) * 16 + r) * D;
      const __m512 inv = _mm512_set1_ps(
          1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(sc.l.data() + (rt * 16 + r) * 16)));
      uint16_t* dst = pr.out + (row * pr.H + h) * D;
      for (int d = 0; d < D; d += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(orow + d), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
      }
    }
  }
}
#endif  // PAGODA_PREFILL_AMX

// The whole call (arguments checked by the caller: paged_prefill_attention).
void run(const uint16_t* q, uint16_t* out, const uint16_t* k, const uint16_t* v,
         const int64_t* bt, int64_t bt_stride, const int64_t* qs, const int64_t* ql,
         const int64_t* sl, int64_t num_reqs, int H, int Hk, int D, int bs, float scale,
         int64_t window) {
#if defined(PAGODA_PREFILL_AMX)
  const Problem pr{q, out, k, v, bt, bt_stride, qs, ql, sl, H, Hk, D, bs, scale, window};
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int64_t i0 = 0; i0 < ql[r]; i0 += kItemRows) {
      const int n = static_cast<int>(std::min<int64_t>(kItemRows, ql[r] - i0));
      const int64_t last = sl[r] - ql[r] + i0 + n;
      const int64_t keys = window >= 0 ? std::min<int64_t>(last, window + n) : last;
      for (int kvh = 0; kvh < Hk; ++kvh) items.push_back({r, i0, kvh, n, keys});
    }
  }
  // NOTE: the costliest first, so that dynamic scheduling ends the threads together.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int G = H / Hk, rt_max = G * (kItemRows / 16);
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    pagoda_amx::load_full_tiles();
    Scratch sc;
    sc.kt.resize(static_cast<size_t>(kChunkKeys) * D);
    sc.vp.resize(static_cast<size_t>(kChunkKeys) * D);
    sc.q.resize(static_cast<size_t>(rt_max) * 16 * D);
    sc.p.resize(static_cast<size_t>(kChunkKeys / kKeys) * kPBlock);
    sc.o.resize(static_cast<size_t>(rt_max) * 16 * D);
    sc.m.resize(rt_max * 16);
    sc.l.resize(rt_max * 256 + 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) run_item(pr, items[i], sc);
    _tile_release();
  }
#else
  (void)q, (void)out, (void)k, (void)v, (void)bt, (void)bt_stride, (void)qs, (void)ql, (void)sl;
  (void)num_reqs, (void)H, (void)Hk, (void)D, (void)bs, (void)scale, (void)window;
  TORCH_CHECK(false, "the AMX prefill attention kernel is not in this build");
#endif
}

}  // namespace pagoda_prefill_amx
