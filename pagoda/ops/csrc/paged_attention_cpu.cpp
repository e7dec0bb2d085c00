// Decode attention over the paged KV cache, on the CPU (prefill rows in tiles:
// paged_prefill_cpu.cpp; the helpers both use: attention_cpu.h).
//
// One work item is a request (or, with few requests, one kv head of a request): the
// G = H / Hk query heads that share a kv head are processed together, so every K/V row is
// read from memory once for all of them. K/V rows are read in place through the block
// table (no gather copy), and the softmax is computed online, a few positions at a time.
//
// Three implementations: an AVX-512 one for head dims 32/64/96/128/256 (tiles of 16
// positions, vdpbf16ps for bf16 where the CPU has AVX512_BF16; see the comment at its start);
// its fp32 path on AVX2 + FMA for the same head dims where the build has no AVX-512 (the same
// tiles and phases on 8-lane halves, bit for bit the AVX-512 fp32 path; no bf16 dot products,
// so a bf16 q takes the fp32 FMAs, except on int8 caches: the AVX-512 VNNI path's integer
// dot products through vpmaddwd, bit for bit too); and a portable one for everything else
// (any head dim, CPUs with neither). The build uses -march=native (or PAGODA_CPU_MARCH), so the preprocessor
// picks what exists: the AVX-512 path uses AVX512F intrinsics only (plus AVX512_BF16 /
// AVX512BW / AVX512_VNNI for the dot products, under their own guards), the AVX2 path AVX2 +
// FMA ones; `kernel_isa()` reports the subsets compiled in, which the Python side checks
// against the CPU's flags.
// Any block size works (the tiles find their rows through the block table); block ids
// are checked against the cache before anything is read.
//
// Layouts (all contiguous):
//   q, out        [B, H, D]          float32 or bfloat16 (same dtype)
//   k/v_cache     [N, bs, Hk, D]     float32 or bfloat16 (same dtype; may differ from q's),
//                                    or quantized codes: int8, or uint8 = fp8 e4m3fn bits
//   k/v_scale     [N, bs, Hk]        float32, with quantized caches only (kv_quant_cpu.h)
//   block_tables  [B, max_blocks]    int64 (int32 is widened by the caller)
//   seq_lens      [B]                int64
//   q_sink        [B, H, D]          optional, q's dtype: attention sinks (attention/sinks.py)
// Query b attends to positions [max(0, seq_len - window), seq_len); window < 0 means none.
// With q_sink and S = num_sink_tokens: positions [0, min(S, seq_len)) with q_sink[b] (the
// query rotated back by the evicted tokens), then [max(S, seq_len - window), seq_len) with
// q[b], in one softmax.
//
// Quantized caches are read in place too (no dequantized copy): q . code is scaled by the
// row's K scale (one multiply per score) and each probability by the row's V scale before it
// weights the codes. With a bf16 q, int8 rows go through vpdpwssd (int16 q and weights; on
// AVX2 vpmaddwd + vpaddd, the same sums) and fp8 rows through vdpbf16ps (codes widened to
// bf16; bf16 weights): tile_scores_codes / tile_values_codes.

// NOTE: no FMA contraction: the AVX-512 and AVX2 paths must fuse the same multiply-adds,
// written as FMAs (the portable path's products are rounded as written too).
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <omp.h>
#include <sched.h>

// The vector paths: AVX-512 (AVX512F), else AVX2 + FMA (the fp32 path only).
#if defined(__AVX512F__)
#define PAGODA_DECODE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGODA_DECODE_AVX2 1
#endif
#if defined(PAGODA_DECODE_AVX512) || defined(PAGODA_DECODE_AVX2)
#define PAGODA_DECODE_VEC 1
#include <immintrin.h>
#endif
// The quantized caches' dot-product paths (16-bit widening needs AVX512BW).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGODA_FP8_DOT 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGODA_INT8_DOT 1
#endif
// int8 codes with a bf16 q on AVX2: vpmaddwd + vpaddd give vpdpwssd's exact int32 sums, so
// this build can repeat PAGODA_INT8_DOT's arithmetic (tile_scores_codes / tile_values_codes
// in the AVX2 section). fp8 has no AVX2 counterpart of vdpbf16ps and keeps the fp32 path.
#if defined(PAGODA_DECODE_AVX2)
#define PAGODA_INT8_DOT_AVX2 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_cpu.h"
#include "decode_attention_cpu.h"
#include "index_args_cpu.h"
#include "kv_quant_cpu.h"

namespace {

using namespace pagoda_attn;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// exp(x) for x <= 0 (softmax arguments after subtracting the running max), written as
// plain arithmetic so that the compiler vectorises the loops that call it.
// NOTE: relative error ~2e-7 (degree-6 polynomial on [-ln2/2, ln2/2]); inputs below -87
// are clamped, which returns ~1e-38 instead of a denormal or zero, harmless after scaling.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t e = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * bits_to_float(e);
}

// Copy one cache row to float (a no-op pointer pass-through for float caches).
template <typename KV>
struct RowLoader;

template <>
struct RowLoader<float> {
  static inline const float* load(const float* src, float* /*buf*/, int /*d*/) { return src; }
};

template <>
struct RowLoader<uint16_t> {
  static inline const float* load(const uint16_t* src, float* buf, int d) {
#pragma omp simd
    for (int i = 0; i < d; ++i) {
      buf[i] = bits_to_float(static_cast<uint32_t>(src[i]) << 16);
    }
    return buf;
  }
};

// Quantized rows: the codes' values (the row's scale is applied by the caller).
template <>
struct RowLoader<int8_t> {
  static inline const float* load(const int8_t* src, float* buf, int d) {
#pragma omp simd
    for (int i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
};

template <>
struct RowLoader<uint8_t> {
  static inline const float* load(const uint8_t* src, float* buf, int d) {
    for (int i = 0; i < d; ++i) buf[i] = pagoda_kvq::fp8_decode(src[i]);
    return buf;
  }
};


struct Problem {
  const void* q;
  void* out;
  bool q_is_bf16;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  int64_t bt_stride;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
  int64_t window;
  const float* k_scale = nullptr;  // [N * bs * Hk], quantized caches only
  const float* v_scale = nullptr;
  // Attention sinks: positions [0, num_sinks) are read with q_sink ([B, H, D], q's dtype)
  // and the rest with q; nullptr: none.
  const void* q_sink = nullptr;
  int64_t num_sinks = 0;
};

// Positions per part of a split range (for_each_item): a multiple of the vector paths' tile;
// 0: no split (set_decode_split_len, for benchmarks' comparisons).
std::atomic<int64_t> g_split_len{512};

struct Split;

// A work item: request b's kv heads [kvh0, kvh1) and their query heads (for_each_item); with
// `split`, part `part` of the request's split range: positions [pos0, pos1) of it.
struct OneItem {
  int64_t b;
  int kvh0, kvh1;
  Split* split = nullptr;
  int64_t part = 0;
  int64_t pos0 = 0, pos1 = 0;
};

// The first position a query at seq_len - 1 attends to within its window (0: no window).
inline int64_t window_start(const Problem& p, int64_t seq_len) {
  return p.window >= 0 ? std::max<int64_t>(0, seq_len - p.window) : 0;
}

// Element i of a query tensor q (p.q or p.q_sink), which has q's dtype.
inline float load_q(const Problem& p, const void* q, int64_t i) {
  if (p.q_is_bf16) {
    return static_cast<float>(static_cast<const c10::BFloat16*>(q)[i]);
  }
  return static_cast<const float*>(q)[i];
}

inline void store_out(const Problem& p, int64_t i, float x) {
  if (p.q_is_bf16) {
    static_cast<c10::BFloat16*>(p.out)[i] = c10::BFloat16(x);
  } else {
    static_cast<float*>(p.out)[i] = x;
  }
}

// A call whose requests' ranges are split into parts (for_each_item): each part's softmax
// state per query head, and per (request, kv head) the parts not yet finished.
struct Split {
  int64_t len = 0;              // positions per part (g_split_len when the call started)
  std::vector<int64_t> base;    // per request: its first partial row, in floats; -1: not split
  std::vector<float> partials;  // per split request: [parts][H][D + 2] = max, sum, acc[D]
  std::unique_ptr<std::atomic<int>[]> pending;  // [B * Hk]: at the items' first kv heads
};

// Where request b's attention range [start, seq_len) is split: the aligned parts
// [k * len, (k + 1) * len) it meets, when it is longer than one part.
inline int64_t num_parts(int64_t len, int64_t start, int64_t seq_len) {
  return seq_len - start > len ? (seq_len - 1) / len - start / len + 1 : 1;
}

inline float* part_row(const Problem& p, Split& sp, int64_t b, int64_t part, int head) {
  return sp.partials.data() + sp.base[b] +
         (part * p.num_heads + head) * static_cast<int64_t>(p.head_dim + 2);
}

// Query heads [h0, h1) of request b from its parts: each part's sums rescaled to the largest
// max, added in part order (the same bits whichever thread merges), normalized once.
inline void merge_parts(const Problem& p, Split& sp, int64_t b, int h0, int h1) {
  const int64_t seq_len = p.seq_lens[b];
  const int64_t start = window_start(p, seq_len);
  const int64_t n = num_parts(sp.len, start, seq_len);
  const int D = p.head_dim;
  std::vector<float> acc(D);
  for (int h = h0; h < h1; ++h) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < n; ++k) mx = std::max(mx, part_row(p, sp, b, k, h)[0]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < n; ++k) {
      const float* r = part_row(p, sp, b, k, h);
      const float w = exp_nonpos(r[0] - mx);
      l += r[1] * w;
      for (int d = 0; d < D; ++d) acc[d] += r[2 + d] * w;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t o = (b * p.num_heads + h) * static_cast<int64_t>(D);
    for (int d = 0; d < D; ++d) store_out(p, o + d, acc[d] * inv);
  }
}

// Part items run since the extension loaded (tests: that a long range was split).
std::atomic<int64_t> g_parts_run{0};

// After a part item: the last of its (request, kv heads) to finish merges their query heads.
inline void finish_part(const Problem& p, const OneItem& it) {
  g_parts_run.fetch_add(1, std::memory_order_relaxed);
  Split& sp = *it.split;
  const int G = p.num_heads / p.num_kv_heads;
  if (sp.pending[it.b * p.num_kv_heads + it.kvh0].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    merge_parts(p, sp, it.b, it.kvh0 * G, it.kvh1 * G);
  }
}

// The CPUs this process may run on: the split decision's thread count. NOTE: not the
// OpenMP team's current size, which worker/omp_team.py lowers and raises with the load:
// a request's output must not depend on that (tests/unit/test_omp_team.py).
int64_t process_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
    return CPU_COUNT(&set);
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}
const int64_t g_split_cpus = process_cpus();

// The items of a call in which some range is split (request by request, kv-head groups of
// heads_per_item, parts in order), with their Split; false (nothing built) when none is:
// also when the call has two (request, kv head) pairs a CPU or more, which the threads share
// evenly enough whole.
// NOTE (measured, 2-core Zen 4, SmolLM2's shape, 30 layers of bf16 caches): parts of 512
// took one request at 1,500-8,000 positions 1.13-1.18x faster, but 8 at 2,000 and 64 at
// 1,500 (items of all 3 kv heads) 0.88x as fast: each item's set-up and merge cost more there
// than the balance gains.
inline bool split_items(const Problem& p, int64_t batch, int heads_per_item,
                        std::vector<OneItem>& items, Split& sp) {
  if (p.q_sink != nullptr) return false;  // NOTE: one softmax over two ranges: never split
  const int64_t len = g_split_len.load(std::memory_order_relaxed);
  if (len <= 0 || batch * p.num_kv_heads >= 2 * g_split_cpus) return false;
  sp.len = len;
  sp.base.assign(batch, -1);
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = window_start(p, p.seq_lens[b]);
    const int64_t n = num_parts(len, start, p.seq_lens[b]);
    if (n > 1) {
      sp.base[b] = rows;
      rows += n * p.num_heads * static_cast<int64_t>(p.head_dim + 2);
    }
  }
  if (rows == 0) return false;
  sp.partials.assign(rows, 0.0f);
  sp.pending.reset(new std::atomic<int>[batch * p.num_kv_heads]);
  items.clear();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seq_len = p.seq_lens[b], start = window_start(p, seq_len);
    const int64_t n = num_parts(len, start, seq_len), k0 = start / len;
    for (int kvh0 = 0; kvh0 < p.num_kv_heads; kvh0 += heads_per_item) {
      const int kvh1 = kvh0 + heads_per_item;
      if (n == 1) {
        items.push_back(OneItem{b, kvh0, kvh1});
        continue;
      }
      sp.pending[b * p.num_kv_heads + kvh0].store(static_cast<int>(n), std::memory_order_relaxed);
      for (int64_t k = 0; k < n; ++k) {
        items.push_back(OneItem{b, kvh0, kvh1, &sp, k, std::max(start, (k0 + k) * len),
                                std::min(seq_len, (k0 + k + 1) * len)});
      }
    }
  }
  return true;
}

// Scratch for one work item: scaled queries, accumulators, one block of scores, one row.
constexpr int64_t kPrefetchBlocks = 2;

struct Scratch {
  std::vector<float> q, acc, scores, row, m, l;
  Scratch(int heads, int d, int bs)
      : q(heads * d), acc(heads * d), scores(heads * bs), row(d), m(heads), l(heads) {}
};

// Ask for the rows of kv heads [kvh0, kvh1) of tokens [t0, t1) of one block ahead of use.
template <typename KV>
inline void prefetch_block(const KV* cache, const Problem& p, int64_t block_id, int64_t t0,
                           int64_t t1, int kvh0, int kvh1) {
  const int64_t row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const int64_t span = static_cast<int64_t>(kvh1 - kvh0) * p.head_dim * sizeof(KV);
  for (int64_t t = t0; t < t1; ++t) {
    const char* base = reinterpret_cast<const char*>(
        cache + (block_id * p.block_size + t) * row + static_cast<int64_t>(kvh0) * p.head_dim);
    for (int64_t off = 0; off < span; off += 64) __builtin_prefetch(base + off, 0, 3);
  }
}

#if defined(PAGODA_DECODE_VEC)
// ---------------------------------------------------------------------------------------
// Vector paths (head dims 32, 64, 96, 128, 256): AVX-512, or its fp32 path on AVX2 + FMA
// (8-lane halves of each 16-lane vector: the AVX2 section below). Positions are processed in
// tiles of 16 (aligned to multiples of 16) so that one tile's scores for one query head are
// exactly one (16-lane) vector; the rows of a tile are found through the block table once per
// tile (any block size works) and lanes outside [start, seq_len) are masked. Each tile runs
// in three phases (as the AVX-512 path does them; the AVX2 loops: its section):
//
// 1. Scores, lanes = head dims: one vector of partial sums per (token, head), then the 16
//    vectors of a head are reduced to one vector of 16 scores by a transpose-add tree (sum4
//    + sum16: 45 ops per 16 scores, against ~8 dependent ops per score for a horizontal sum
//    each). With a bf16 q, bf16 caches and AVX512_BF16, q . k is vdpbf16ps on the raw bf16
//    rows: bf16 x bf16 products are exact in fp32 and are accumulated in fp32, so this
//    equals converting both to fp32. Otherwise (float32 caches: the exact path; a float32
//    q; no AVX512_BF16) rows are converted to fp32 and use FMAs.
// 2. The online-softmax update of all the item's heads at once (independent dependency
//    chains, so their latencies overlap): exp vectorised over the tile; the running sum is
//    kept per lane and reduced once at the end.
// 3. Values: acc[h] = acc[h] * rescale + sum_t p[h][t] * v_t with fp32 FMAs, the
//    accumulators of one kv head's query heads in registers for the whole tile. bf16 rows
//    are widened with one op per 16 values (even elements: << 16; odd: & 0xFFFF0000), which
//    leaves the accumulators in an even/odd-permuted dim order, undone once per request.
//
// The next tile's rows are software-prefetched while the current one is computed.
//
// Quantized rows with a bf16 q (the code paths) read 1-byte codes, so per byte they must do
// half the bf16 path's work to stay memory-bound: the K rows of a group of four are
// interleaved so that the dot products land in sum4's layout (no sum4 per head), int8 sums
// stay integer to the end, a tile's scales are vector loads (one block: consecutive slots),
// and V takes two rows per dot-product instruction (16-bit weights).
// ---------------------------------------------------------------------------------------

// Where dim d of a row loaded by load_row_f32 lives (and so of q and the accumulators).
template <typename KV>
inline int row_index(int d) {
  if constexpr (!std::is_same_v<KV, uint16_t>) {
    return d;
  } else {
    const int c = d >> 5, r = d & 31;
    return (2 * c + (r & 1)) * 16 + (r >> 1);
  }
}

// Software prefetch of the next tile's K/V rows, spread over the current tile's work.
// NOTE (measured, B=64 bf16 benchmark): the block ids are random, so the hardware
// prefetchers cannot run ahead across blocks and a software prefetch is needed for every
// line (every other line: 2x slower). All ~200 of a tile at once stall on the core's few
// miss buffers (2x slower than spreading them); prefetching further than one tile ahead
// overflows L1 (48 KiB: 2-4 tiles ahead were 10-20% slower), and L2 hints were slower
// there (an AMX Xeon); on an AMD EPYC they are the fast ones (g_kv_prefetch_l2).
// So issue() is called at a few points per group of tokens and asks for one unit: 128 bytes
// (two lines) of K and the same of V. A row's last unit may be a single line (spans of
// 64 * odd bytes, e.g. head dim 96 in bf16), and a row is done once its span is covered:
// the loop in flush() ends for any span.
struct Prefetcher {
  static constexpr int64_t kUnit = 128;
  bool l2 = false;  // g_kv_prefetch_l2, read at start()
  const char* k = nullptr;
  intptr_t v_minus_k = 0;
  int64_t off[kTile];  // byte offsets of the rows (plus the first kv head's column)
  int rows = 0, row = 0;
  int64_t span = 0;
  const char* base = nullptr;  // the current row's first byte of K
  int64_t done = 0;            // bytes of the current row asked for; >= span: row done

  inline void issue() {
    if (done >= span) {
      if (row >= rows) return;
      base = k + off[row++];
      done = 0;
    }
    const char* pk = base + done;
    const bool two = done + 64 < span;
    if (l2) {
      line<2>(pk, two);  // locality 2: prefetcht1
    } else {
      line<3>(pk, two);  // locality 3: prefetcht0
    }
    done += kUnit;
  }

  template <int kLocality>
  inline void line(const char* pk, bool two) const {
    const char* pv = pk + v_minus_k;
    __builtin_prefetch(pk, 0, kLocality);
    __builtin_prefetch(pv, 0, kLocality);
    if (two) {
      __builtin_prefetch(pk + 64, 0, kLocality);
      __builtin_prefetch(pv + 64, 0, kLocality);
    }
  }

  inline void flush() {
    while (done < span || row < rows) issue();
  }

  template <typename KV>
  void start(const KV* k_cache, const KV* v_cache, const TileRows& tr, int64_t col0,
             int64_t span_bytes) {
    l2 = g_kv_prefetch_l2.load(std::memory_order_relaxed);
    k = reinterpret_cast<const char*>(k_cache);
    v_minus_k = reinterpret_cast<intptr_t>(v_cache) - reinterpret_cast<intptr_t>(k_cache);
    rows = tr.hi - tr.lo;
    for (int t = 0; t < rows; ++t) off[t] = (tr.off[tr.lo + t] + col0) * sizeof(KV);
    span = span_bytes;
    if (off[rows - 1] - off[0] == (rows - 1) * span) {
      // NOTE: rows back to back (one block, all kv heads): one span, no row switches.
      span *= rows;
      rows = 1;
    }
    row = 0;
    done = span;  // no current row: the first issue() starts row 0
  }
};

// Per-thread state of one work item's query heads (head j at j * kD, or j * 16 per vector).
struct AvxScratch {
  std::vector<uint16_t> qb;  // bf16 q: [heads][kD]
  std::vector<float> qf;     // fp32 q in the row layout of load_row_f32: [heads][kD]
  std::vector<float> acc;    // [heads][kD], same layout
  std::vector<float> m, l;   // running max (broadcast) and per-lane sums: [heads][16]
  std::vector<float> p;      // one tile of scores, then probabilities: [heads][16]
  std::vector<float> corr;   // this tile's rescale of acc (broadcast): [heads][16]
  std::vector<float> ks, vs; // quantized caches: this tile's K / V scales: [kv heads][16]
  std::vector<float> qscale;  // int8 code path: the scale of each head's int16 q (in qb)
  // The code paths' q: per head and 32-value chunk, its 16-bit pairs doubled by dword
  // unpacks, lo then hi (tile_scores_codes): [heads][kD / 32][2][16]
  std::vector<uint32_t> qy;
  std::vector<float> hscale;  // the code paths' score multiplier per head (softmax, q scale)
  bool rescaled = false;      // tile_softmax: whether any head's corr differs from 1
  // A range's K / V scales staged tile by tile ([tiles][16][Hk], stage_scales), and the
  // current tile's (nullptr: not staged, read through the slots).
  std::vector<float> k_stage, v_stage;
  const float* k_tile = nullptr;
  const float* v_tile = nullptr;
  AvxScratch(int heads, int d, int /*block_size*/)
      : qb(heads * d), qf(heads * d), acc(heads * d), m(heads * kTile), l(heads * kTile),
        p(heads * kTile), corr(heads * kTile), ks(heads * kTile), vs(heads * kTile),
        qscale(heads), qy(heads * d), hscale(heads) {}
};

// fn(std::integral_constant<int, NH>, g0) for the chunks [g0, g0 + NH) of G query heads.
template <int kMax, typename Fn>
inline void for_head_chunks(int G, Fn&& fn) {
  for (int g0 = 0; g0 < G; g0 += kMax) {
    switch (std::min(kMax, G - g0)) {
      case 1:
        fn(std::integral_constant<int, 1>{}, g0);
        break;
      case 2:
        if constexpr (kMax >= 2) fn(std::integral_constant<int, 2>{}, g0);
        break;
      case 3:
        if constexpr (kMax >= 3) fn(std::integral_constant<int, 3>{}, g0);
        break;
      default:
        if constexpr (kMax >= 4) fn(std::integral_constant<int, 4>{}, g0);
        break;
    }
  }
}

// The K / V scales of tiles [first, last] of a range (block size a multiple of 16: a
// tile's 16 slots are consecutive) copied into s.k_stage / s.v_stage, 16 * Hk floats per
// tile. NOTE (measured): read where each tile starts, the scales missed the cache at their
// first load although prefetched one or two tiles ahead (a third of the int8 path's time);
// these copies are independent loads, so their misses overlap (a burst per range).
inline void stage_scales(const Problem& p, const int64_t* table, int64_t first, int64_t last,
                         AvxScratch& s) {
  const int64_t bs = p.block_size, per = kTile * p.num_kv_heads;
  s.k_stage.resize((last - first + 1) * per);
  s.v_stage.resize((last - first + 1) * per);
  for (int64_t tile = first; tile <= last; ++tile) {
    const int64_t pos0 = tile * kTile;
    const int64_t src = (table[pos0 / bs] * bs + pos0 % bs) * p.num_kv_heads;
    std::memcpy(s.k_stage.data() + (tile - first) * per, p.k_scale + src, per * sizeof(float));
    std::memcpy(s.v_stage.data() + (tile - first) * per, p.v_scale + src, per * sizeof(float));
  }
}

// The cache lines of a tile's scales (kv heads from kvh0 on), each asked for once.
inline void prefetch_scales(const Problem& p, const TileRows& tr, int kvh0) {
  uintptr_t last = 0;
  for (int t = tr.lo; t < tr.hi; ++t) {
    const int64_t i = tr.slot[t] * p.num_kv_heads + kvh0;
    const uintptr_t line = reinterpret_cast<uintptr_t>(p.k_scale + i) >> 6;
    if (line == last) continue;
    last = line;
    _mm_prefetch(reinterpret_cast<const char*>(p.k_scale + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p.v_scale + i), _MM_HINT_T0);
  }
}

// One query head (n values from q[q0]) as int16 (stored in a uint16 buffer) and its scale,
// for the int8 dot path: |q| max -> 32767. NOTE: the rounding error (<= amax / 65534 per
// value) is far below a bf16 q's own (2^-9 relative) and the int8 K's (amax_k / 254).
inline void quantize_q_int16(const Problem& p, const void* q, int64_t q0, int n, uint16_t* out,
                             float& scale) {
  float amax = 0.0f;
  for (int d = 0; d < n; ++d) amax = std::max(amax, std::fabs(load_q(p, q, q0 + d)));
  scale = amax / 32767.0f;
  const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
  for (int d = 0; d < n; ++d) {
    const auto v = static_cast<int16_t>(std::nearbyint(load_q(p, q, q0 + d) * inv));
    out[d] = static_cast<uint16_t>(v);
  }
}

// Fresh softmax state and accumulators for query heads [0, nh).
inline void reset_state(int nh, int d, AvxScratch& s) {
  std::fill(s.acc.begin(), s.acc.begin() + nh * d, 0.0f);
  std::fill(s.m.begin(), s.m.begin() + nh * kTile, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + nh * kTile, 0.0f);
}

// Where dim d of an accumulator lives: the rows' layout (row_index), except on the code
// paths (quantized rows with a bf16 q), whose 16-bit row pairs (unpacklo / unpackhi of two
// rows, per 128-bit lane) leave 32 dims c as lanes [4k + j] of vector 2c (d = 32c + 8k + j)
// and 2c + 1 (d = 32c + 8k + 4 + j); the AVX2 code path stores its sums in the same layout.
template <typename KV, bool kDot>
inline int acc_index(int d) {
  if constexpr (kDot && kQuantized<KV>) {
    const int c = d >> 5, r = d & 31;
    return (2 * c + ((r >> 2) & 1)) * 16 + (r >> 3) * 4 + (r & 3);
  } else {
    return row_index<KV>(d);
  }
}
#endif  // PAGODA_DECODE_VEC

#if defined(PAGODA_DECODE_AVX512)
// ---------------------------------------------------------------------------------------
// AVX-512 phases: the fp32 ones and the dot-product ones (bf16 rows, and the code paths of
// quantized rows with a bf16 q).
// ---------------------------------------------------------------------------------------

// Four vectors of 16 partial sums (tokens a, b, c, d) -> one vector whose 128-bit chunk k
// holds (sum of a's chunk k, of b's, of c's, of d's). Every add combines lanes of one token.
inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}

// Four sum4 results (tokens 0-3, 4-7, 8-11, 12-15) -> lane t = full sum of token t.
inline __m512 sum16(__m512 w0, __m512 w1, __m512 w2, __m512 w3) {
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, kEven),
                                   _mm512_shuffle_f32x4(w0, w1, kOdd));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(w2, w3, kEven),
                                   _mm512_shuffle_f32x4(w2, w3, kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, kEven),
                       _mm512_shuffle_f32x4(x01, x23, kOdd));
}

// a + b lane by lane: int32 lanes (kInt) or fp32 lanes, both in the bits of a __m512i.
template <bool kInt>
inline __m512i add_lanes(__m512i a, __m512i b) {
  if constexpr (kInt) {
    return _mm512_add_epi32(a, b);
  } else {
    return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
  }
}

// Max of 16 lanes, broadcast to every lane.
inline __m512 hmax16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
}

// 32 values of a row as the 16-bit operands of a dot-product instruction: bf16 rows as
// they are; fp8 codes as bf16 bits (the fp8_bits_as_f32 trick on 16 bits: value * 2^-120;
// NOTE: vdpbf16ps reads bf16 denormals as zero, so fp8 subnormal codes, |x| < amax / 28672,
// count as 0 here); int8 codes sign-extended to int16.
inline __m512i load_dot_chunk(const uint16_t* src) { return _mm512_loadu_si512(src); }

#if defined(__AVX512BW__)
inline __m512i load_dot_chunk(const uint8_t* src) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512i w = _mm512_slli_epi16(_mm512_cvtepi8_epi16(x), 4);
  return _mm512_and_si512(w, _mm512_set1_epi16(static_cast<short>(0x87F0)));
}

inline __m512i load_dot_chunk(const int8_t* src) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
#else
// NOTE: never called (the code dot paths need AVX512BW); keeps tile_scores compiling.
template <typename T>
inline __m512i load_dot_chunk(const T*) { return _mm512_setzero_si512(); }
#endif

// bf16 q . bf16 row over kNC chunks of 32 pairs, as 16 fp32 partial sums.
template <int kNC>
inline __m512 dot_chunks(const __m512i* q, const __m512i* kx) {
  __m512 d = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  for (int c = 0; c < kNC; ++c) d = _mm512_dpbf16_ps(d, (__m512bh)q[c], (__m512bh)kx[c]);
#endif
  return d;  // NOTE: zero is unreachable: dispatch_avx takes kDot only where built
}

// acc + the products of 16-bit pairs q and x, lane by lane, in the bits of a __m512i: int32
// lanes through vpdpwssd for int8 codes (int16 pairs), fp32 lanes through vdpbf16ps for fp8
// codes (bf16 pairs). NOTE: the int8 sums are exact: |q| <= 32767, |code| <= 127, so 256
// products stay inside int32.
template <typename KV>
inline __m512i dot_pairs(__m512i acc, __m512i q, __m512i x) {
  if constexpr (std::is_same_v<KV, int8_t>) {
#if defined(PAGODA_INT8_DOT)
    return _mm512_dpwssd_epi32(acc, q, x);
#endif
  } else {
#if defined(PAGODA_FP8_DOT)
    return _mm512_castps_si512(
        _mm512_dpbf16_ps(_mm512_castsi512_ps(acc), (__m512bh)q, (__m512bh)x));
#endif
  }
  return acc;  // NOTE: unreachable: dispatch_avx takes the code paths only where built
}

// dot_pairs onto zero: int8 codes through vpmaddwd (no accumulator to copy first).
template <typename KV>
inline __m512i first_pairs(__m512i q, __m512i x) {
  if constexpr (std::is_same_v<KV, int8_t>) return _mm512_madd_epi16(q, x);
  return dot_pairs<KV>(_mm512_setzero_si512(), q, x);
}

// Phase 1 of a tile: the scaled, masked scores of query heads [j0, j0 + NH) of one kv head
// (rows at column col) into s.p. kDot (bf16 rows): vdpbf16ps on the raw bf16 q and rows.
// Quantized rows with a bf16 q take tile_scores_codes instead.
template <typename KV, int kD, int NH, bool kDot>
inline void tile_scores(const KV* __restrict k_cache, const TileRows& tr, int64_t col,
                        AvxScratch& s, int j0, float scale, const float* ksc,
                        Prefetcher& pf) {
  constexpr int kNV = kD / 16;
  __m512 vscale = _mm512_set1_ps(scale);
  __m512 w[4][NH];
  if constexpr (kDot) {
    constexpr int kNC = kD / 32;
    __m512i q[NH][kNC];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < kNC; ++c)
        q[h][c] = _mm512_loadu_si512(s.qb.data() + (j0 + h) * kD + 32 * c);
    for (int g = 0; g < 4; ++g) {
      __m512 a[4][NH];
      for (int u = 0; u < 4; ++u) {
        const KV* kr = k_cache + tr.off[4 * g + u] + col;
        __m512i kx[kNC];
        for (int c = 0; c < kNC; ++c) kx[c] = load_dot_chunk(kr + 32 * c);
        for (int h = 0; h < NH; ++h) a[u][h] = dot_chunks<kNC>(q[h], kx);
      }
      for (int h = 0; h < NH; ++h) w[g][h] = sum4(a[0][h], a[1][h], a[2][h], a[3][h]);
      pf.issue();
      pf.issue();
    }
  } else {
    for (int g = 0; g < 4; ++g) {
      __m512 a[4][NH];
      for (int u = 0; u < 4; ++u) {
        __m512 kf[kNV];
        load_row_f32<kD>(k_cache + tr.off[4 * g + u] + col, kf);
        for (int h = 0; h < NH; ++h) {
          const float* qh = s.qf.data() + (j0 + h) * kD;
          __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qh), kf[0]);
          for (int i = 1; i < kNV; ++i) d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), kf[i], d);
          a[u][h] = d;
        }
      }
      for (int h = 0; h < NH; ++h) w[g][h] = sum4(a[0][h], a[1][h], a[2][h], a[3][h]);
      pf.issue();
      pf.issue();
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if constexpr (kQuantized<KV>) vscale = _mm512_mul_ps(vscale, _mm512_loadu_ps(ksc));
  for (int h = 0; h < NH; ++h) {
    const __m512 sc = _mm512_mul_ps(sum16(w[0][h], w[1][h], w[2][h], w[3][h]), vscale);
    _mm512_storeu_ps(s.p.data() + (j0 + h) * kTile, _mm512_mask_mov_ps(neg_inf, tr.mask, sc));
  }
}

// Phase 2: the online-softmax update of heads [0, nh): probabilities into s.p, the rescale
// of the accumulators into s.corr (and s.rescaled: whether any differs from 1).
// NOTE: forced inline (measured: 2-3% of the int8 path as a call once per tile).
__attribute__((always_inline)) inline void tile_softmax(AvxScratch& s, int nh,
                                                        __mmask16 mask) {
  const __m512 one = _mm512_set1_ps(1.0f);
  s.rescaled = false;
  for (int j = 0; j < nh; ++j) {
    float* pj = s.p.data() + j * kTile;
    const __m512 sc = _mm512_loadu_ps(pj);
    const __m512 m_old = _mm512_loadu_ps(s.m.data() + j * kTile);
    // NOTE: the max rarely grows after the first tiles: then no lane exceeds it, and the
    // horizontal max and the rescale's exp are skipped (exp(0) == 1). On the first tile
    // m_old = -inf and the rescale is exp(-87) ~ 0 (acc and l are 0).
    __m512 m_new = m_old, corr = one;
    if (_mm512_cmp_ps_mask(sc, m_old, _CMP_GT_OQ) != 0) {
      m_new = _mm512_max_ps(m_old, hmax16(sc));
      corr = vexp_nonpos(_mm512_sub_ps(m_old, m_new));
      s.rescaled = true;
    }
    const __m512 e = _mm512_maskz_mov_ps(mask, vexp_nonpos(_mm512_sub_ps(sc, m_new)));
    _mm512_storeu_ps(pj, e);
    const __m512 l_old = _mm512_loadu_ps(s.l.data() + j * kTile);
    _mm512_storeu_ps(s.l.data() + j * kTile, _mm512_fmadd_ps(l_old, corr, e));
    _mm512_storeu_ps(s.m.data() + j * kTile, m_new);
    _mm512_storeu_ps(s.corr.data() + j * kTile, corr);
  }
}

// Phase 3: acc[j] = acc[j] * corr[j] + sum_t p[j][t] * v_t for query heads [j0, j0 + NH)
// of one kv head, the accumulators held in registers.
template <typename KV, int kD, int NH>
inline void tile_values(const KV* __restrict v_cache, const TileRows& tr, int64_t col,
                        AvxScratch& s, int j0, const float* vsc, Prefetcher& pf) {
  constexpr int kNV = kD / 16;
  __m512 acc[NH][kNV];
  for (int h = 0; h < NH; ++h) {
    const __m512 corr = _mm512_loadu_ps(s.corr.data() + (j0 + h) * kTile);
    for (int i = 0; i < kNV; ++i)
      acc[h][i] = _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + (j0 + h) * kD + 16 * i), corr);
  }
  const float* pb = s.p.data() + j0 * kTile;
  for (int t = tr.lo; t < tr.hi; ++t) {
    __m512 vf[kNV];
    load_row_f32<kD>(v_cache + tr.off[t] + col, vf);
    // NOTE: prefetch units per row in proportion to its bytes (float: 2, bf16: 1,
    // codes: one every other row).
    if constexpr (sizeof(KV) == 1) {
      if (t & 1) pf.issue();
    } else {
      for (int i = 0; i < static_cast<int>(sizeof(KV)) / 2; ++i) pf.issue();
    }
    for (int h = 0; h < NH; ++h) {
      float w = pb[h * kTile + t];
      if constexpr (kQuantized<KV>) w *= vsc[t];
      const __m512 wt = _mm512_set1_ps(w);
      for (int i = 0; i < kNV; ++i) acc[h][i] = _mm512_fmadd_ps(wt, vf[i], acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < kNV; ++i)
      _mm512_storeu_ps(s.acc.data() + (j0 + h) * kD + 16 * i, acc[h][i]);
}

#if defined(PAGODA_INT8_DOT) || defined(PAGODA_FP8_DOT)
// Phase 1 for quantized rows with a bf16 q. Each pair of rows (a, b) has its 32-value
// chunks, widened to 16-bit pairs, interleaved by dword unpacks into two vectors whose
// 128-bit lane k holds (a, b, a, b) of pairs 4k, 4k, 4k + 1, 4k + 1 (lo) and 4k + 2, 4k + 2,
// 4k + 3, 4k + 3 (hi); against q unpacked the same way (s.qy: lo, hi per chunk), the
// products of two rows share one vector, and one qword unpack per four rows and head puts
// them in sum4's layout: the first level of the transpose-add tree is done on the rows, once
// for all NH heads, and the second costs a third of sum4. int8 sums stay exact int32 up to
// one conversion per 16 scores. lane_scale: the rows' K scales (times the codes' unit);
// s.hscale: the heads' multipliers.
template <typename KV, int kD, int NH>
inline void tile_scores_codes(const KV* __restrict k_cache, const TileRows& tr, int64_t col,
                              AvxScratch& s, int j0, __m512 lane_scale, Prefetcher& pf) {
  constexpr int kNC = kD / 32;
  constexpr bool kInt = std::is_same_v<KV, int8_t>;
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  __m512i q[NH][kNC][2];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kNC; ++c)
      for (int x = 0; x < 2; ++x)
        q[h][c][x] = _mm512_loadu_si512(s.qy.data() + ((j0 + h) * kNC + c) * 32 + 16 * x);
  // Rows (t, t + 1) of every head: 16 partial sums, lane 4k + r (r < 2: row r of the pair;
  // r = 2, 3: row r - 2, the other pairs of chunk k).
  auto pair_sums = [&](int t, __m512i* out) {
    const KV* ra = k_cache + tr.off[t] + col;
    const KV* rb = k_cache + tr.off[t + 1] + col;
    // NOTE: lo and hi accumulate apart: dependency chains of kNC, not 2 * kNC.
    __m512i lo[NH], hi[NH];
    for (int c = 0; c < kNC; ++c) {
      const __m512i xa = load_dot_chunk(ra + 32 * c), xb = load_dot_chunk(rb + 32 * c);
      const __m512i ulo = _mm512_unpacklo_epi32(xa, xb), uhi = _mm512_unpackhi_epi32(xa, xb);
      for (int h = 0; h < NH; ++h) {
        if (c == 0) {
          lo[h] = first_pairs<KV>(q[h][0][0], ulo);
          hi[h] = first_pairs<KV>(q[h][0][1], uhi);
        } else {
          lo[h] = dot_pairs<KV>(lo[h], q[h][c][0], ulo);
          hi[h] = dot_pairs<KV>(hi[h], q[h][c][1], uhi);
        }
      }
    }
    for (int h = 0; h < NH; ++h) out[h] = add_lanes<kInt>(lo[h], hi[h]);
  };
  // Four rows from t: sum4's layout (lane 4k + r: row t + r, chunk k).
  auto quad_sums = [&](int t, __m512i* out) {
    __m512i ab[NH], cd[NH];
    pair_sums(t, ab);
    pair_sums(t + 2, cd);
    for (int h = 0; h < NH; ++h) {
      out[h] = add_lanes<kInt>(_mm512_unpacklo_epi64(ab[h], cd[h]),
                               _mm512_unpackhi_epi64(ab[h], cd[h]));
    }
    pf.issue();
  };
  // sum16's levels as the quads come: lane t of `total` = the full sum of row t.
  __m512i half[2][NH];
  for (int k = 0; k < 2; ++k) {
    __m512i w0[NH], w1[NH];
    quad_sums(8 * k, w0);
    quad_sums(8 * k + 4, w1);
    for (int h = 0; h < NH; ++h) {
      half[k][h] = add_lanes<kInt>(_mm512_shuffle_i32x4(w0[h], w1[h], kEven),
                                   _mm512_shuffle_i32x4(w0[h], w1[h], kOdd));
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int h = 0; h < NH; ++h) {
    const __m512i total = add_lanes<kInt>(_mm512_shuffle_i32x4(half[0][h], half[1][h], kEven),
                                          _mm512_shuffle_i32x4(half[0][h], half[1][h], kOdd));
    const __m512 sum = kInt ? _mm512_cvtepi32_ps(total) : _mm512_castsi512_ps(total);
    const __m512 sc = _mm512_mul_ps(sum, _mm512_mul_ps(lane_scale,
                                                       _mm512_set1_ps(s.hscale[j0 + h])));
    _mm512_storeu_ps(s.p.data() + (j0 + h) * kTile, _mm512_mask_mov_ps(neg_inf, tr.mask, sc));
  }
}

// Phase 3 for quantized rows with a bf16 q: each probability times its row's V scale as a
// 16-bit weight (int8: int16 with one scale per tile, the tile's largest V scale -> 32767,
// error <= 1.5e-5 of that scale; fp8: bf16, 2^-9 relative), packed so that rows t, t + 1 (t even) are one dword to
// broadcast; then two rows at a time, their codes widened to 16 bits and paired by word
// unpacks, through dot_pairs: 32 products per instruction against 16 FMAs after two to
// three widening ops on the fp32 path. int8 sums are scaled into the fp32 accumulators once
// per tile. vsc: the tile's V scales, 0 outside [lo, hi) (a lane there has weight 0).
template <typename KV, int kD, int NH>
inline void tile_values_codes(const KV* __restrict v_cache, const TileRows& tr, int64_t col,
                              AvxScratch& s, int j0, const float* vsc, Prefetcher& pf) {
  constexpr int kNV = kD / 16;
  constexpr bool kInt = std::is_same_v<KV, int8_t>;
  alignas(32) uint16_t wq[NH][kTile];
  __m512 vs = _mm512_loadu_ps(vsc);
  float wscale = 1.0f;
  if constexpr (kInt) {
    // NOTE: probabilities are <= 1, so the tile's largest V scale bounds every weight: one
    // int16 scale per tile for all NH heads (no horizontal max per head).
    const float vmax = _mm512_reduce_max_ps(vs);
    wscale = vmax / 32767.0f;
    vs = _mm512_mul_ps(vs, _mm512_set1_ps(vmax > 0.0f ? 32767.0f / vmax : 0.0f));
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(s.p.data() + (j0 + h) * kTile), vs);
    __m256i packed;
    if constexpr (kInt) {
      packed = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(w));
    } else {
      packed = (__m256i)_mm512_cvtneps_pbh(w);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(wq[h]), packed);
  }
  __m512i acc[NH][kNV];
  const bool rescaled = s.rescaled;  // NOTE: a local: the stores to s.acc might alias it
  for (int h = 0; h < NH; ++h) {
    const float* a = s.acc.data() + (j0 + h) * kD;
    const __m512 corr = _mm512_loadu_ps(s.corr.data() + (j0 + h) * kTile);
    for (int i = 0; i < kNV; ++i) {
      if constexpr (kInt) {
        acc[h][i] = _mm512_setzero_si512();
      } else {
        const __m512 x = _mm512_loadu_ps(a + 16 * i);
        acc[h][i] = _mm512_castps_si512(rescaled ? _mm512_mul_ps(x, corr) : x);
      }
    }
  }
  // NOTE: all 8 pairs, a lane outside [lo, hi) with weight 0 (its row repeats a valid one):
  // a fixed trip count, unrolled, keeps the accumulators in place (a loop of variable length
  // compiled to a copy of each accumulator per iteration).
#pragma GCC unroll 8
  for (int t = 0; t < kTile; t += 2) {
    const KV* ra = v_cache + tr.off[t] + col;
    const KV* rb = v_cache + tr.off[t + 1] + col;
    pf.issue();
    __m512i x[kNV];
    for (int c = 0; c < kD / 32; ++c) {
      const __m512i xa = load_dot_chunk(ra + 32 * c), xb = load_dot_chunk(rb + 32 * c);
      x[2 * c] = _mm512_unpacklo_epi16(xa, xb);
      x[2 * c + 1] = _mm512_unpackhi_epi16(xa, xb);
    }
    for (int h = 0; h < NH; ++h) {
      int32_t pair;
      std::memcpy(&pair, &wq[h][t], sizeof(pair));
      const __m512i wp = _mm512_set1_epi32(pair);
      for (int i = 0; i < kNV; ++i) acc[h][i] = dot_pairs<KV>(acc[h][i], wp, x[i]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    float* a = s.acc.data() + (j0 + h) * kD;
    const __m512 corr = _mm512_loadu_ps(s.corr.data() + (j0 + h) * kTile);
    for (int i = 0; i < kNV; ++i) {
      __m512 out = _mm512_castsi512_ps(acc[h][i]);
      if constexpr (kInt) {
        __m512 old = _mm512_loadu_ps(a + 16 * i);
        if (rescaled) old = _mm512_mul_ps(old, corr);
        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][i]), _mm512_set1_ps(wscale), old);
      }
      _mm512_storeu_ps(a + 16 * i, out);
    }
  }
}
#else
// NOTE: never called (dispatch_avx takes the code paths only where they were built).
template <typename KV, int kD, int NH>
inline void tile_scores_codes(const KV*, const TileRows&, int64_t, AvxScratch&, int, __m512,
                              Prefetcher&) {}
template <typename KV, int kD, int NH>
inline void tile_values_codes(const KV*, const TileRows&, int64_t, AvxScratch&, int,
                              const float*, Prefetcher&) {}
#endif

// Query heads handled together per call of tile_scores / tile_values: the accumulators
// (NH * kD / 16 vectors) stay in registers.
template <int kD>
constexpr int kMaxHeadsPerStep = kD <= 64 ? 4 : (kD <= 128 ? 2 : 1);

// Lane t = base[t * stride + offset] for t < 16, from the 16 * stride floats at base:
// pairs of vectors through a two-source permute each (no gather).
inline __m512 strided16(const float* base, int stride, int offset) {
  const __m512i idx0 = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(stride)),
      _mm512_set1_epi32(offset));
  __m512 r = _mm512_setzero_ps();
  for (int j = 0; j < stride; j += 2) {
    const __m512i idx = _mm512_sub_epi32(idx0, _mm512_set1_epi32(16 * j));
    const __mmask16 in = _mm512_cmplt_epu32_mask(idx, _mm512_set1_epi32(32));
    if (in == 0) continue;
    const __m512 lo = _mm512_loadu_ps(base + 16 * j);
    const __m512 hi = j + 1 < stride ? _mm512_loadu_ps(base + 16 * j + 16) : lo;
    r = _mm512_mask_mov_ps(r, in, _mm512_permutex2var_ps(lo, idx, hi));
  }
  return r;
}

// The running sum's 16 lanes of one head, added in pagoda_vec::sum16's tree (the one GCC's
// _mm512_reduce_add_ps uses, written out for the AVX2 path to repeat).
inline float lane_sum16(const float* x) { return pagoda_vec::sum16(_mm512_loadu_ps(x)); }
#endif  // PAGODA_DECODE_AVX512

#if defined(PAGODA_DECODE_AVX2)
// ---------------------------------------------------------------------------------------
// AVX2 + FMA phases: the AVX-512 path's fp32 phases (tile_scores without dot products,
// tile_softmax, tile_values) on 8-lane vectors. Each 16-lane vector of that path is two
// halves here (lo: lanes 0-7, hi: lanes 8-15) that take the same operations per lane in the
// same order (load_row_f32's 8-lane vector i is half i % 2 of its 16-lane vector i / 2, on
// every row type), and its cross-lane steps (sum4, sum16, hmax16, the final sum of l) are the
// same trees of adds / maxes: the results equal the AVX-512 fp32 path's bit for bit (a
// float32 q on every cache dtype; a bf16 q: the AVX-512 build's fallback without dot
// products, which this build does not have, except for int8 rows: tile_scores_codes /
// tile_values_codes below). The loops are ordered to fit 16 registers:
// scores one head at a time over 32-value chunks of four rows (a K row is read from L1 once
// per head), values in 32-dim chunks of at most two heads.
// ---------------------------------------------------------------------------------------

// sum4 on one half: its unpacks stay inside 128-bit lanes, so the halves of the AVX-512
// sum4 are sum4 of the halves.
inline __m256 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd)));
}

// The halves of (c0 + c1, c2 + c3) of the 128-bit chunks of a 16-lane vector given as halves
// (lo = c0 c1, hi = c2 c3): the adds of sum16's shuffle_f32x4 pairs (even + odd chunks).
inline __m256 add_chunk_pairs(__m256 lo, __m256 hi) {
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                       _mm256_permute2f128_ps(lo, hi, 0x31));
}

// sum16 of four sum4 results w[g] (halves w[g][0], w[g][1]) -> lane t = full sum of token t,
// as halves lo / hi: x01 = (pairs of w0, pairs of w1), x23 likewise, then pairs of those.
inline void sum16(const __m256 (&w)[4][2], __m256& lo, __m256& hi) {
  __m256 y[4];
  for (int g = 0; g < 4; ++g) y[g] = add_chunk_pairs(w[g][0], w[g][1]);
  lo = add_chunk_pairs(y[0], y[1]);
  hi = add_chunk_pairs(y[2], y[3]);
}

// hmax16 on halves, the same maxes with the same operands: chunks (2, 3, 0, 1), then
// (1, 0, 3, 2), then within chunks.
__attribute__((always_inline)) inline void hmax16(__m256& lo, __m256& hi) {
  const __m256 a = _mm256_max_ps(lo, hi), b = _mm256_max_ps(hi, lo);
  lo = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 0x01));
  hi = _mm256_max_ps(b, _mm256_permute2f128_ps(b, b, 0x01));
  lo = _mm256_max_ps(lo, _mm256_permute_ps(lo, _MM_SHUFFLE(1, 0, 3, 2)));
  hi = _mm256_max_ps(hi, _mm256_permute_ps(hi, _MM_SHUFFLE(1, 0, 3, 2)));
  lo = _mm256_max_ps(lo, _mm256_permute_ps(lo, _MM_SHUFFLE(2, 3, 0, 1)));
  hi = _mm256_max_ps(hi, _mm256_permute_ps(hi, _MM_SHUFFLE(2, 3, 0, 1)));
}

// Bits 0-7 (lo) and 8-15 (hi) of a tile's lane mask as all-ones / all-zeros lanes.
inline void lane_masks(uint16_t mask, __m256& lo, __m256& hi) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i m = _mm256_set1_epi32(mask);
  lo = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(m, bits), bits));
  const __m256i bits_hi = _mm256_slli_epi32(bits, 8);
  hi = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(m, bits_hi), bits_hi));
}

// Phase 1 (AVX-512 tile_scores, kDot false): per (row, head) the two halves of the 16
// partial sums q . k, lane l of 16-lane vector i in order of i (vector 2c = halves 0, 1 of
// chunk c's four 8-lane vectors, 2c + 1 = halves 2, 3), then sum4 / sum16, times the scale.
template <typename KV, int kD, int NH, bool kDot>
inline void tile_scores(const KV* __restrict k_cache, const TileRows& tr, int64_t col,
                        AvxScratch& s, int j0, float scale, const float* ksc, Prefetcher& pf) {
  static_assert(!kDot, "the AVX2 path has no dot products");
  constexpr int kNC = kD / 32;
  __m256 w[NH][4][2];
  for (int g = 0; g < 4; ++g) {
    for (int h = 0; h < NH; ++h) {
      const float* qh = s.qf.data() + (j0 + h) * kD;
      __m256 a[4][2];
      for (int c = 0; c < kNC; ++c) {
        __m256 qc[4];
        for (int i = 0; i < 4; ++i) qc[i] = _mm256_loadu_ps(qh + 32 * c + 8 * i);
        for (int u = 0; u < 4; ++u) {
          __m256 kc[4];
          load_row_f32<32>(k_cache + tr.off[4 * g + u] + col + 32 * c, kc);
          for (int x = 0; x < 2; ++x) {
            a[u][x] = c == 0 ? _mm256_mul_ps(qc[x], kc[x])
                             : _mm256_fmadd_ps(qc[x], kc[x], a[u][x]);
            a[u][x] = _mm256_fmadd_ps(qc[2 + x], kc[2 + x], a[u][x]);
          }
        }
      }
      for (int x = 0; x < 2; ++x) w[h][g][x] = sum4(a[0][x], a[1][x], a[2][x], a[3][x]);
    }
    pf.issue();
    pf.issue();
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 valid[2], vscale[2];
  lane_masks(tr.mask, valid[0], valid[1]);
  for (int x = 0; x < 2; ++x) {
    vscale[x] = _mm256_set1_ps(scale);
    if constexpr (kQuantized<KV>) {
      vscale[x] = _mm256_mul_ps(vscale[x], _mm256_loadu_ps(ksc + 8 * x));
    }
  }
  for (int h = 0; h < NH; ++h) {
    __m256 sum[2];
    sum16(w[h], sum[0], sum[1]);
    for (int x = 0; x < 2; ++x) {
      const __m256 sc = _mm256_mul_ps(sum[x], vscale[x]);
      _mm256_storeu_ps(s.p.data() + (j0 + h) * kTile + 8 * x,
                       _mm256_blendv_ps(neg_inf, sc, valid[x]));
    }
  }
}

// Phase 2 (AVX-512 tile_softmax) on halves.
// NOTE: forced inline, as the AVX-512 one.
__attribute__((always_inline)) inline void tile_softmax(AvxScratch& s, int nh, uint16_t mask) {
  __m256 valid[2];
  lane_masks(mask, valid[0], valid[1]);
  const __m256 one = _mm256_set1_ps(1.0f);
  s.rescaled = false;
  for (int j = 0; j < nh; ++j) {
    float* pj = s.p.data() + j * kTile;
    float* mj = s.m.data() + j * kTile;
    float* lj = s.l.data() + j * kTile;
    __m256 sc[2], m_old[2], m_new[2], corr[2] = {one, one};
    int grows = 0;
    for (int x = 0; x < 2; ++x) {
      sc[x] = _mm256_loadu_ps(pj + 8 * x);
      m_new[x] = m_old[x] = _mm256_loadu_ps(mj + 8 * x);
      grows |= _mm256_movemask_ps(_mm256_cmp_ps(sc[x], m_old[x], _CMP_GT_OQ));
    }
    if (grows != 0) {
      __m256 mx[2] = {sc[0], sc[1]};
      hmax16(mx[0], mx[1]);
      for (int x = 0; x < 2; ++x) {
        m_new[x] = _mm256_max_ps(m_old[x], mx[x]);
        corr[x] = vexp_nonpos(_mm256_sub_ps(m_old[x], m_new[x]));
      }
      s.rescaled = true;
    }
    for (int x = 0; x < 2; ++x) {
      const __m256 e = _mm256_and_ps(valid[x], vexp_nonpos(_mm256_sub_ps(sc[x], m_new[x])));
      _mm256_storeu_ps(pj + 8 * x, e);
      const __m256 l_old = _mm256_loadu_ps(lj + 8 * x);
      _mm256_storeu_ps(lj + 8 * x, _mm256_fmadd_ps(l_old, corr[x], e));
      _mm256_storeu_ps(mj + 8 * x, m_new[x]);
      _mm256_storeu_ps(s.corr.data() + j * kTile + 8 * x, corr[x]);
    }
  }
}

// Phase 3 (AVX-512 tile_values): per lane acc * corr, then one FMA per row t in order; here a
// 32-dim chunk (four 8-lane vectors: halves 0, 1, 0, 1) of at most two heads at a time.
template <typename KV, int kD, int NH>
inline void tile_values(const KV* __restrict v_cache, const TileRows& tr, int64_t col,
                        AvxScratch& s, int j0, const float* vsc, Prefetcher& pf) {
  const float* pb = s.p.data() + j0 * kTile;
  float wt[NH][kTile];
  for (int h = 0; h < NH; ++h) {
    for (int t = tr.lo; t < tr.hi; ++t) {
      float w = pb[h * kTile + t];
      if constexpr (kQuantized<KV>) w *= vsc[t];
      wt[h][t] = w;
    }
  }
  for (int c = 0; c < kD / 32; ++c) {
    __m256 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      const float* cj = s.corr.data() + (j0 + h) * kTile;
      const float* aj = s.acc.data() + (j0 + h) * kD + 32 * c;
      for (int i = 0; i < 4; ++i) {
        const __m256 corr = _mm256_loadu_ps(cj + 8 * (i & 1));  // the half's lanes
        acc[h][i] = _mm256_mul_ps(_mm256_loadu_ps(aj + 8 * i), corr);
      }
    }
    for (int t = tr.lo; t < tr.hi; ++t) {
      __m256 vf[4];
      load_row_f32<32>(v_cache + tr.off[t] + col + 32 * c, vf);
      if (c == 0) {
        // NOTE: the AVX-512 path's prefetch units per row.
        if constexpr (sizeof(KV) == 1) {
          if (t & 1) pf.issue();
        } else {
          for (int i = 0; i < static_cast<int>(sizeof(KV)) / 2; ++i) pf.issue();
        }
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 wv = _mm256_set1_ps(wt[h][t]);
        for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_fmadd_ps(wv, vf[i], acc[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      float* aj = s.acc.data() + (j0 + h) * kD + 32 * c;
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(aj + 8 * i, acc[h][i]);
    }
  }
}

// The code paths for int8 rows with a bf16 q (PAGODA_INT8_DOT's arithmetic): vpmaddwd on
// int16 q (s.qb) or weights against codes widened to int16 gives the pairwise int32 sums
// vpdpwssd adds, and vpaddd adds them; integer sums are exact in any order, so these loops
// are free to pair and reduce differently from the AVX-512 ones (no saturation: |code| <=
// 127, |int16| <= 32767). Every float operation is the AVX-512 one, lane by lane.

// 16 codes from src sign-extended to int16.
inline __m256i load_codes16(const int8_t* src) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

// sum4 on int32 lanes: four vectors of partial sums (rows a, b, c, d) -> per 128-bit lane
// (sum of a's lanes there, of b's, of c's, of d's).
inline __m256i sum4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

// Phase 1 (AVX-512 tile_scores_codes, int8): per four rows and head, 8 int32 partial sums of
// q . k per row over 32-value chunks (the K chunk widened once for the NH heads), sum4_epi32,
// then the two 128-bit lanes of two such groups added: lane t = the exact sum of row t. As
// there: one conversion per score, times (K scale * s.hscale), masked.
template <int kD, int NH>
inline void tile_scores_codes(const int8_t* __restrict k_cache, const TileRows& tr, int64_t col,
                              AvxScratch& s, int j0, const float* ksc, Prefetcher& pf) {
  constexpr int kNC = kD / 32;
  __m256i w[NH][4];
  for (int g = 0; g < 4; ++g) {
    __m256i a[4][NH];
    for (int c = 0; c < kNC; ++c) {
      __m256i qc[NH][2];
      for (int h = 0; h < NH; ++h) {
        const uint16_t* qh = s.qb.data() + (j0 + h) * kD + 32 * c;
        for (int x = 0; x < 2; ++x)
          qc[h][x] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 16 * x));
      }
      for (int u = 0; u < 4; ++u) {
        const int8_t* kr = k_cache + tr.off[4 * g + u] + col + 32 * c;
        const __m256i k0 = load_codes16(kr), k1 = load_codes16(kr + 16);
        for (int h = 0; h < NH; ++h) {
          const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(qc[h][0], k0),
                                             _mm256_madd_epi16(qc[h][1], k1));
          a[u][h] = c == 0 ? d : _mm256_add_epi32(a[u][h], d);
        }
      }
    }
    for (int h = 0; h < NH; ++h) w[h][g] = sum4_epi32(a[0][h], a[1][h], a[2][h], a[3][h]);
    pf.issue();
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 valid[2];
  lane_masks(tr.mask, valid[0], valid[1]);
  for (int h = 0; h < NH; ++h) {
    const __m256 hs = _mm256_set1_ps(s.hscale[j0 + h]);
    for (int x = 0; x < 2; ++x) {
      const __m256i lo = w[h][2 * x], hi = w[h][2 * x + 1];
      const __m256i total = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                             _mm256_permute2x128_si256(lo, hi, 0x31));
      const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(total),
                                      _mm256_mul_ps(_mm256_loadu_ps(ksc + 8 * x), hs));
      _mm256_storeu_ps(s.p.data() + (j0 + h) * kTile + 8 * x,
                       _mm256_blendv_ps(neg_inf, sc, valid[x]));
    }
  }
}

// Phase 3 (AVX-512 tile_values_codes, int8): the same int16 weights (the tile's largest V
// scale -> 32767, rounded by cvtps_epi32; packed with saturation, which never applies: every
// weight is <= 32767.5), then per 16 dims and row pair (t, t + 1) the two rows' codes paired
// by word unpacks against the broadcast weight pair, all 8 pairs (weight 0 outside [lo, hi)).
// The int32 sums go into the fp32 accumulators, in their AVX-512 layout, with the AVX-512
// path's fma.
template <int kD, int NH>
inline void tile_values_codes(const int8_t* __restrict v_cache, const TileRows& tr, int64_t col,
                              AvxScratch& s, int j0, const float* vsc, Prefetcher& pf) {
  __m256 vs[2] = {_mm256_loadu_ps(vsc), _mm256_loadu_ps(vsc + 8)};
  __m256 mx = _mm256_max_ps(vs[0], vs[1]);
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
  mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, _MM_SHUFFLE(1, 0, 3, 2)));
  mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, _MM_SHUFFLE(2, 3, 0, 1)));
  const float vmax = _mm256_cvtss_f32(mx);
  const float wscale = vmax / 32767.0f;
  const __m256 mul = _mm256_set1_ps(vmax > 0.0f ? 32767.0f / vmax : 0.0f);
  for (int x = 0; x < 2; ++x) vs[x] = _mm256_mul_ps(vs[x], mul);
  alignas(32) uint16_t wq[NH][kTile];
  for (int h = 0; h < NH; ++h) {
    const float* ph = s.p.data() + (j0 + h) * kTile;
    __m256i wi[2];
    for (int x = 0; x < 2; ++x)
      wi[x] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(ph + 8 * x), vs[x]));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(wi[0], wi[1]),
                                                    _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(wq[h]), packed);
  }
  const bool rescaled = s.rescaled;  // NOTE: a local: the stores to s.acc might alias it
  const __m256 ws = _mm256_set1_ps(wscale);
  // NOTE: 16 dims at a time: the accumulators of up to four heads stay in registers, so the
  // rows are widened once for all of a kv head's query heads (decode_tile).
  for (int e = 0; e < kD / 16; ++e) {
    __m256i acc[NH][2];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 2; ++i) acc[h][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < kTile; t += 2) {
      if (e == 0) pf.issue();  // NOTE: the AVX-512 path's prefetch units per row pair
      const __m256i a = load_codes16(v_cache + tr.off[t] + col + 16 * e);
      const __m256i b = load_codes16(v_cache + tr.off[t + 1] + col + 16 * e);
      // dims (0-3, 8-11) and (4-7, 12-15) of the 16
      const __m256i x[2] = {_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b)};
      for (int h = 0; h < NH; ++h) {
        int32_t pair;
        std::memcpy(&pair, &wq[h][t], sizeof(pair));
        const __m256i wp = _mm256_set1_epi32(pair);
        for (int i = 0; i < 2; ++i)
          acc[h][i] = _mm256_add_epi32(acc[h][i], _mm256_madd_epi16(wp, x[i]));
      }
    }
    // The AVX-512 accumulators' layout (acc_index): of 32 dims c, unpacklo of dims 0-15 is
    // vector 2c's lanes 0-7 and of dims 16-31 its lanes 8-15; unpackhi likewise 2c + 1.
    const int c = e >> 1, half = e & 1;
    for (int h = 0; h < NH; ++h) {
      const float* cj = s.corr.data() + (j0 + h) * kTile + 8 * half;
      for (int i = 0; i < 2; ++i) {
        float* a = s.acc.data() + (j0 + h) * kD + 32 * c + 16 * i + 8 * half;
        __m256 old = _mm256_loadu_ps(a);
        if (rescaled) old = _mm256_mul_ps(old, _mm256_loadu_ps(cj));
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][i]), ws, old));
      }
    }
  }
}

// Query heads per call of tile_scores / tile_values: a 32-dim chunk's accumulators of two
// heads, the V chunk and a weight fill 13 of the 16 registers.
template <int kD>
constexpr int kMaxHeadsPerStep = 2;

// The running sum's 16 lanes of one head, added in sum16's tree (GCC's _mm512_reduce_add_ps).
inline float lane_sum16(const float* x) {
  return pagoda_vec::sum16(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
}
#endif  // PAGODA_DECODE_AVX2

#if defined(PAGODA_DECODE_VEC)
// A quantized tile's K and V scales of kv heads [kvh0, kvh1) into s.ks / s.vs (times the
// codes' unit), lane t = the tile's row t; V scales are 0 outside [lo, hi) (so a weight
// there is 0 whatever the slot holds).
template <typename KV>
inline void tile_scales(const Problem& p, const TileRows& tr, int kvh0, int kvh1,
                        AvxScratch& s) {
  const int hk = p.num_kv_heads;
  if (s.k_tile != nullptr) {
    // NOTE: staged (stage_scales): the tile's 16 slots' scales, consecutive.
#if defined(PAGODA_DECODE_AVX512)
    const __m512 unit = _mm512_set1_ps(kCodeUnit<KV>);
    for (int kvh = kvh0; kvh < kvh1; ++kvh) {
      const __m512 ks = strided16(s.k_tile, hk, kvh);
      const __m512 vs = strided16(s.v_tile, hk, kvh);
      _mm512_storeu_ps(s.ks.data() + (kvh - kvh0) * kTile, _mm512_mul_ps(ks, unit));
      _mm512_storeu_ps(s.vs.data() + (kvh - kvh0) * kTile,
                       _mm512_maskz_mul_ps(tr.mask, vs, unit));
    }
#else
    for (int kvh = kvh0; kvh < kvh1; ++kvh) {
      float* ks = s.ks.data() + (kvh - kvh0) * kTile;
      float* vs = s.vs.data() + (kvh - kvh0) * kTile;
      for (int t = 0; t < kTile; ++t) {
        ks[t] = s.k_tile[t * hk + kvh] * kCodeUnit<KV>;
        vs[t] = (tr.mask >> t) & 1 ? s.v_tile[t * hk + kvh] * kCodeUnit<KV> : 0.0f;
      }
    }
#endif
    return;
  }
  for (int kvh = kvh0; kvh < kvh1; ++kvh) {
    float* ks = s.ks.data() + (kvh - kvh0) * kTile;
    float* vs = s.vs.data() + (kvh - kvh0) * kTile;
    for (int t = 0; t < kTile; ++t) {
      const int64_t i = tr.slot[t] * hk + kvh;
      const bool valid = t >= tr.lo && t < tr.hi;
      ks[t] = p.k_scale[i] * kCodeUnit<KV>;
      vs[t] = valid ? p.v_scale[i] * kCodeUnit<KV> : 0.0f;
    }
  }
}

// Query heads [0, nh) of one work item (elements of q from q_base) into the scratch in the
// form the tiles read: bf16 bits (kDot), int16 with a scale per head (kDot, int8 rows) or
// fp32 in the rows' layout.
template <typename KV, int kD, bool kDot>
inline void stage_queries(const Problem& p, const void* q, int64_t q_base, int nh,
                          AvxScratch& s) {
  for (int j = 0; j < nh; ++j) {
    const int64_t q0 = q_base + static_cast<int64_t>(j) * kD;
    if constexpr (kDot && std::is_same_v<KV, int8_t>) {
      quantize_q_int16(p, q, q0, kD, s.qb.data() + j * kD, s.qscale[j]);
    } else {
      for (int d = 0; d < kD; ++d) {
        if constexpr (kDot) {
          s.qb[j * kD + d] = static_cast<const c10::BFloat16*>(q)[q0 + d].x;  // a bf16 q
        } else {
          s.qf[j * kD + row_index<KV>(d)] = load_q(p, q, q0 + d);
        }
      }
    }
    if constexpr (kDot && kQuantized<KV>) {
      s.hscale[j] = p.scale * (std::is_same_v<KV, int8_t> ? s.qscale[j] : 1.0f);
    }
#if defined(PAGODA_DECODE_AVX512)
    if constexpr (kDot && kQuantized<KV>) {
      // NOTE: tile_scores_codes' operands: each chunk's pairs doubled by dword unpacks (the
      // AVX2 one reads s.qb as it is).
      for (int c = 0; c < kD / 32; ++c) {
        const __m512i pairs = _mm512_loadu_si512(s.qb.data() + j * kD + 32 * c);
        uint32_t* dst = s.qy.data() + (j * (kD / 32) + c) * 32;
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi32(pairs, pairs));
        _mm512_storeu_si512(dst + 16, _mm512_unpackhi_epi32(pairs, pairs));
      }
    }
#endif
  }
}

// The three phases of one tile for kv heads [kvh0, kvh1) and their G query heads each.
template <typename KV, int kD, bool kDot>
inline void decode_tile(const Problem& p, const KV* k_cache, const KV* v_cache,
                        const TileRows& tr, int kvh0, int kvh1, AvxScratch& s, Prefetcher& pf) {
  constexpr int kNH = kMaxHeadsPerStep<kD>;
  const int G = p.num_heads / p.num_kv_heads;
  if constexpr (kQuantized<KV>) tile_scales<KV>(p, tr, kvh0, kvh1, s);
  [[maybe_unused]] constexpr bool kCodes = kDot && kQuantized<KV>;
#if defined(PAGODA_INT8_DOT_AVX2)
  constexpr int kNHv = kCodes ? 4 : kNH;  // tile_values_codes: 16 dims of four heads at a time
#else
  constexpr int kNHv = kNH;
#endif
  for (int kvh = kvh0; kvh < kvh1; ++kvh) {
    const int64_t col = static_cast<int64_t>(kvh) * kD;
    const int jk = (kvh - kvh0) * G;
    const float* ksc = s.ks.data() + (kvh - kvh0) * kTile;
    for_head_chunks<kNH>(G, [&](auto nh_c, int g0) {
      constexpr int kNHc = decltype(nh_c)::value;
#if defined(PAGODA_DECODE_AVX512)
      if constexpr (kCodes) {
        tile_scores_codes<KV, kD, kNHc>(k_cache, tr, col, s, jk + g0, _mm512_loadu_ps(ksc), pf);
      } else
#elif defined(PAGODA_INT8_DOT_AVX2)
      if constexpr (kCodes) {
        tile_scores_codes<kD, kNHc>(k_cache, tr, col, s, jk + g0, ksc, pf);
      } else
#endif
      {
        tile_scores<KV, kD, kNHc, kDot>(k_cache, tr, col, s, jk + g0, p.scale, ksc, pf);
      }
    });
  }
  tile_softmax(s, (kvh1 - kvh0) * G, tr.mask);
  for (int kvh = kvh0; kvh < kvh1; ++kvh) {
    const int64_t col = static_cast<int64_t>(kvh) * kD;
    const int jk = (kvh - kvh0) * G;
    const float* vsc = s.vs.data() + (kvh - kvh0) * kTile;
    for_head_chunks<kNHv>(G, [&](auto nh_c, int g0) {
      constexpr int kNHc = decltype(nh_c)::value;
#if defined(PAGODA_DECODE_AVX512)
      if constexpr (kCodes) {
        tile_values_codes<KV, kD, kNHc>(v_cache, tr, col, s, jk + g0, vsc, pf);
      } else
#elif defined(PAGODA_INT8_DOT_AVX2)
      if constexpr (kCodes) {
        tile_values_codes<kD, kNHc>(v_cache, tr, col, s, jk + g0, vsc, pf);
      } else
#endif
      {
        tile_values<KV, kD, kNHc>(v_cache, tr, col, s, jk + g0, vsc, pf);
      }
    });
  }
}

// Positions [start, end) of request b's context (block table `table`) into the item's
// running softmax and accumulators.
// `next`: the first tile of the thread's next item, whose rows are asked for during this
// range's last tiles (nullptr: none).
struct NextTile {
  const int64_t* table;
  int64_t start, end;
  int kvh0, kvh1;
};

template <typename KV, int kD, bool kDot>
void attend_range(const Problem& p, const KV* k_cache, const KV* v_cache, const int64_t* table,
                  int64_t start, int64_t end, int kvh0, int kvh1, AvxScratch& s,
                  const NextTile* next = nullptr) {
  if (start >= end) return;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * kD;
  const int64_t col0 = static_cast<int64_t>(kvh0) * kD;
  const int64_t span_bytes = static_cast<int64_t>(kvh1 - kvh0) * kD * sizeof(KV);
  const int64_t first = start / kTile, last = (end - 1) / kTile;
  // NOTE: a tile of 1-byte codes takes about half a bf16 tile's time, so its rows are asked
  // for two tiles ahead (the same distance in time).
  constexpr int kAhead = kQuantized<KV> ? 2 : 1;
  TileRows rows[kAhead + 1];
  auto rows_of = [&](int64_t tile) -> TileRows& { return rows[(tile - first) % (kAhead + 1)]; };
  Prefetcher pf;
  const bool staged = kQuantized<KV> && p.block_size % kTile == 0 && p.num_kv_heads <= 16;
  if (staged) stage_scales(p, table, first, last, s);
  s.k_tile = s.v_tile = nullptr;
  auto ask_for = [&](int64_t tile) {
    TileRows& tr = rows_of(tile);
    tile_rows(p.block_size, table, row_stride, tile, start, end, tr);
    pf.start(k_cache, v_cache, tr, col0, span_bytes);
    if constexpr (kQuantized<KV>) {
      if (!staged) prefetch_scales(p, tr, kvh0);
    }
  };
  for (int64_t tile = first; tile < first + kAhead - 1 && tile <= last; ++tile) {
    ask_for(tile);
    pf.flush();
  }
  ask_for(std::min(first + kAhead - 1, last));
  for (int64_t tile = first; tile <= last; ++tile) {
    const TileRows& tr = rows_of(tile);
    pf.flush();  // the rest of tile + kAhead - 1's rows (all of the first ones')
    if (tile + kAhead <= last) {
      ask_for(tile + kAhead);
    } else if (tile + kAhead == last + 1 && next != nullptr) {
      // NOTE: without this, the next item's first tile would be asked for only when that
      // item starts, all at once, with nothing to compute while it arrives.
      TileRows ntr;
      tile_rows(p.block_size, next->table, row_stride, next->start / kTile, next->start,
                next->end, ntr);
      pf.start(k_cache, v_cache, ntr, static_cast<int64_t>(next->kvh0) * kD,
               static_cast<int64_t>(next->kvh1 - next->kvh0) * kD * sizeof(KV));
    }
    if (staged) {
      const int64_t at = (tile - first) * kTile * p.num_kv_heads;
      s.k_tile = s.k_stage.data() + at;
      s.v_tile = s.v_stage.data() + at;
    }
    decode_tile<KV, kD, kDot>(p, k_cache, v_cache, tr, kvh0, kvh1, s, pf);
  }
}

// Where request b's attention starts: its first sink, else its window's first position.
inline int64_t range_start(const Problem& p, int64_t seq_len) {
  return p.q_sink != nullptr ? 0 : window_start(p, seq_len);
}

template <typename KV, int kD, bool kDot>
void decode_one_avx(const Problem& p, const KV* k_cache, const KV* v_cache, const OneItem& it,
                    AvxScratch& s, const OneItem* next_item) {
  const int64_t b = it.b;
  const int kvh0 = it.kvh0, kvh1 = it.kvh1;
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = (kvh1 - kvh0) * G;
  const int64_t seq_len = p.seq_lens[b];
  int64_t start = window_start(p, seq_len);
  const int64_t q_base = (b * p.num_heads + static_cast<int64_t>(kvh0) * G) * kD;
  const int64_t* table = p.block_tables + b * p.bt_stride;
  reset_state(nh, kD, s);
  if (p.q_sink != nullptr) {
    // NOTE: one online softmax over both ranges: the sinks with their query, then the rest.
    stage_queries<KV, kD, kDot>(p, p.q_sink, q_base, nh, s);
    attend_range<KV, kD, kDot>(p, k_cache, v_cache, table, 0,
                               std::min(p.num_sinks, seq_len), kvh0, kvh1, s);
    start = std::max(start, p.num_sinks);
  }
  int64_t end = seq_len;
  if (it.split != nullptr) {
    start = it.pos0;
    end = it.pos1;
  }
  NextTile next{};
  if (next_item != nullptr) {
    const int64_t len = p.seq_lens[next_item->b];
    next = NextTile{p.block_tables + next_item->b * p.bt_stride, range_start(p, len), len,
                    next_item->kvh0, next_item->kvh1};
    if (next_item->split != nullptr) {
      next.start = next_item->pos0;
      next.end = next_item->pos1;
    }
  }
  const bool ahead = next_item != nullptr && next.start < next.end;
  stage_queries<KV, kD, kDot>(p, p.q, q_base, nh, s);
  attend_range<KV, kD, kDot>(p, k_cache, v_cache, table, start, end, kvh0, kvh1, s,
                             ahead ? &next : nullptr);
  for (int j = 0; j < nh; ++j) {
    const float l = lane_sum16(s.l.data() + j * kTile);
    const float* aj = s.acc.data() + j * kD;
    if (it.split != nullptr) {
      float* r = part_row(p, *it.split, b, it.part, kvh0 * G + j);
      r[0] = s.m[j * kTile];
      r[1] = l;
      for (int d = 0; d < kD; ++d) r[2 + d] = aj[acc_index<KV, kDot>(d)];
      continue;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < kD; ++d) {
      store_out(p, q_base + static_cast<int64_t>(j) * kD + d, aj[acc_index<KV, kDot>(d)] * inv);
    }
  }
}
#endif  // PAGODA_DECODE_VEC

// Portable path (any head dim; the only path without AVX-512 or AVX2 + FMA).
// One work item: request b, kv heads [kvh0, kvh1) and their G query heads each. Blocks are
// the outer loop so that, when the item spans all kv heads, each block is read sequentially.

// Query heads [0, nh) of the item from q (p.q or p.q_sink, elements from q_base), times the
// softmax scale, into s.q.
inline void stage_queries_portable(const Problem& p, const void* q, int64_t q_base, int nh,
                                   Scratch& s) {
  for (int i = 0; i < nh * p.head_dim; ++i) s.q[i] = load_q(p, q, q_base + i) * p.scale;
}

// Positions [start, end) of request b's context (block table `table`) into the item's
// running softmax and accumulators, with the queries in s.q.
template <typename KV>
void portable_range(const Problem& p, const KV* k_cache, const KV* v_cache, const int64_t* table,
                    int64_t start, int64_t end, int kvh0, int kvh1, Scratch& s) {
  const int D = p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = (kvh1 - kvh0) * G;  // query heads in this item
  const int bs = p.block_size;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const float* __restrict q = s.q.data();
  float* __restrict acc = s.acc.data();
  float* __restrict scores = s.scores.data();
  float* __restrict row = s.row.data();
  if (start >= end) return;
  const int64_t last_blk = (end - 1) / bs;
  for (int64_t blk = start / bs; blk * bs < end; ++blk) {
    const int64_t t0 = std::max(start, blk * bs) - blk * bs;
    const int64_t t1 = std::min(end, (blk + 1) * bs) - blk * bs;
    const int n = static_cast<int>(t1 - t0);
    // NOTE: block ids are random, so the hardware prefetcher cannot run ahead across
    // blocks; ask for the blocks kPrefetchBlocks ahead (the first iteration covers all).
    for (int64_t ahead = blk == start / bs ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks;
         ++ahead) {
      const int64_t nb = blk + ahead;
      if (nb > last_blk) break;
      const int64_t nt1 = std::min<int64_t>(bs, end - nb * bs);
      prefetch_block(k_cache, p, table[nb], 0, nt1, kvh0, kvh1);
      prefetch_block(v_cache, p, table[nb], 0, nt1, kvh0, kvh1);
    }
    const int64_t slot0 = table[blk] * bs + t0;
    const int64_t first = slot0 * row_stride;
    const KV* k_rows = k_cache + first;
    const KV* v_rows = v_cache + first;
    for (int t = 0; t < n; ++t) {
      for (int kvh = kvh0; kvh < kvh1; ++kvh) {
        const float* kr = RowLoader<KV>::load(k_rows + t * row_stride + kvh * D, row, D);
        const float ks = kQuantized<KV> ? p.k_scale[(slot0 + t) * p.num_kv_heads + kvh] : 1.0f;
        for (int g = 0; g < G; ++g) {
          const int j = (kvh - kvh0) * G + g;
          const float* qj = q + j * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int i = 0; i < D; ++i) dot += qj[i] * kr[i];
          scores[j * bs + t] = dot * ks;
        }
      }
    }

    for (int j = 0; j < nh; ++j) {
      float* sj = scores + j * bs;
      float mx = s.m[j];
#pragma omp simd reduction(max : mx)
      for (int t = 0; t < n; ++t) mx = std::max(mx, sj[t]);
      const float corr = exp_nonpos(s.m[j] - mx);  // exp(-inf) clamps to ~0 on the first block
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < n; ++t) {
        const float e = exp_nonpos(sj[t] - mx);
        sj[t] = e;
        sum += e;
      }
      s.l[j] = s.l[j] * corr + sum;
      s.m[j] = mx;
      if (corr != 1.0f) {
        float* aj = acc + j * D;
#pragma omp simd
        for (int i = 0; i < D; ++i) aj[i] *= corr;
      }
    }

    for (int t = 0; t < n; ++t) {
      for (int kvh = kvh0; kvh < kvh1; ++kvh) {
        const float* vr = RowLoader<KV>::load(v_rows + t * row_stride + kvh * D, row, D);
        const float vs = kQuantized<KV> ? p.v_scale[(slot0 + t) * p.num_kv_heads + kvh] : 1.0f;
        for (int g = 0; g < G; ++g) {
          const int j = (kvh - kvh0) * G + g;
          const float w = scores[j * bs + t] * vs;
          float* aj = acc + j * D;
#pragma omp simd
          for (int i = 0; i < D; ++i) aj[i] += w * vr[i];
        }
      }
    }
  }
}

template <typename KV>
void decode_one(const Problem& p, const KV* k_cache, const KV* v_cache, int64_t b, int kvh0,
                int kvh1, Scratch& s) {
  const int D = p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = (kvh1 - kvh0) * G;  // query heads in this item
  const int64_t seq_len = p.seq_lens[b];
  int64_t start = window_start(p, seq_len);
  const int64_t q_base = (b * p.num_heads + static_cast<int64_t>(kvh0) * G) * D;
  const int64_t* table = p.block_tables + b * p.bt_stride;
  std::fill(s.acc.begin(), s.acc.begin() + nh * D, 0.0f);
  std::fill(s.m.begin(), s.m.begin() + nh, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + nh, 0.0f);
  if (p.q_sink != nullptr) {
    stage_queries_portable(p, p.q_sink, q_base, nh, s);
    portable_range(p, k_cache, v_cache, table, 0, std::min(p.num_sinks, seq_len), kvh0, kvh1,
                   s);
    start = std::max(start, p.num_sinks);
  }
  stage_queries_portable(p, p.q, q_base, nh, s);
  portable_range(p, k_cache, v_cache, table, start, seq_len, kvh0, kvh1, s);
  float* __restrict acc = s.acc.data();
  for (int j = 0; j < nh; ++j) {
    const float inv = s.l[j] > 0.0f ? 1.0f / s.l[j] : 0.0f;
    for (int i = 0; i < D; ++i) store_out(p, q_base + j * D + i, acc[j * D + i] * inv);
  }
}

// Runs fn(item, scratch, next) for every work item on the torch thread count. A work item is
// a request, or one kv head of a request when there are too few requests to keep the threads
// busy (a whole request per item reads each block sequentially: best for the memory system).
// Items are taken one at a time from a shared counter (context lengths, so work per item,
// vary widely), each thread one ahead: `next` is the item the thread runs after this one
// (nullptr: none), so that the vector path can ask for its first rows while it finishes.
//
// With `one`, only that item, on the calling thread (from inside the caller's OpenMP region:
// the one-region decode stack), with a scratch kept per thread from one call to the next.
//
// The vector paths (`may_split`) also split a long range: a request whose range is longer
// than g_split_len positions becomes one item per aligned part of it (num_parts), each of
// which leaves its softmax state (max, sum, unnormalized values) in the Split; the last part
// of a (request, kv heads) to finish merges them (merge_parts). Without it one request's
// decode keeps at most num_kv_heads threads busy: SmolLM2's 3 kv heads on 2 threads ran 2:1.
// Only a call with few (request, kv head) pairs for the process's CPUs splits (split_items),
// so a long request's result can depend on the batch it runs in and the machine, at float32
// rounding (the parts' sums are added in another order), never on the OpenMP team's size;
// the parts are the aligned positions only, and a call gives the same bits on any team and
// in the one-region stack as here.

template <typename ScratchT, typename Fn>
void for_each_item(const Problem& p, int64_t batch, int scratch_heads_per_kv, Fn fn,
                   const OneItem* one, bool may_split = false) {
  auto run = [&](const OneItem& it, ScratchT& s, const OneItem* next) {
    fn(it, s, next);
    if (it.split != nullptr) finish_part(p, it);
  };
  if (one != nullptr) {
    const int heads = (one->kvh1 - one->kvh0) * scratch_heads_per_kv;
    thread_local std::unique_ptr<ScratchT> kept;
    thread_local std::tuple<int, int, int> kept_shape{0, 0, 0};
    const std::tuple<int, int, int> shape{heads, p.head_dim, p.block_size};
    if (kept == nullptr || kept_shape != shape) {
      kept = std::make_unique<ScratchT>(heads, p.head_dim, p.block_size);
      kept_shape = shape;
    }
    run(*one, *kept, static_cast<const OneItem*>(nullptr));
    return;
  }
  const int num_threads = at::get_num_threads();
  const int heads_per_item = batch >= 4 * num_threads ? p.num_kv_heads : 1;
  const int items_per_req = p.num_kv_heads / heads_per_item;
  std::vector<OneItem> list;
  Split split;
  const bool listed = may_split && split_items(p, batch, heads_per_item, list, split);
  const int64_t num_items = listed ? static_cast<int64_t>(list.size()) : batch * items_per_req;
  auto item_of = [&](int64_t item) {
    if (listed) return list[item];
    const int kvh0 = static_cast<int>(item % items_per_req) * heads_per_item;
    return OneItem{item / items_per_req, kvh0, kvh0 + heads_per_item};
  };
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(num_threads)
  {
    ScratchT s(heads_per_item * scratch_heads_per_kv, p.head_dim, p.block_size);
    int64_t cur = counter.fetch_add(1, std::memory_order_relaxed);
    while (cur < num_items) {
      const int64_t nxt = counter.fetch_add(1, std::memory_order_relaxed);
      const OneItem next = nxt < num_items ? item_of(nxt) : OneItem{};
      run(item_of(cur), s, nxt < num_items ? &next : nullptr);
      cur = nxt;
    }
  }
}

#if defined(PAGODA_DECODE_VEC)
template <typename KV, int kD, bool kDot>
void decode_all_avx(const Problem& p, const KV* k, const KV* v, int64_t batch,
                    const OneItem* one) {
  for_each_item<AvxScratch>(p, batch, p.num_heads / p.num_kv_heads,
                            [&](const OneItem& it, AvxScratch& s, const OneItem* next) {
                              decode_one_avx<KV, kD, kDot>(p, k, v, it, s, next);
                            }, one, /*may_split=*/true);
}

template <typename KV, int kD>
void dispatch_avx(const Problem& p, const KV* k, const KV* v, int64_t batch,
                  const OneItem* one) {
  // NOTE: the dot paths only for a bf16 q: a float32 q would have to be rounded (or split
  // into terms); it keeps the fp32 FMAs (the exact path).
  if constexpr (std::is_same_v<KV, uint16_t>) {
#if defined(__AVX512BF16__)
    if (g_use_bf16_dot && p.q_is_bf16) return decode_all_avx<KV, kD, true>(p, k, v, batch, one);
#endif
  } else if constexpr (std::is_same_v<KV, uint8_t>) {
#if defined(PAGODA_FP8_DOT)
    if (g_use_bf16_dot && p.q_is_bf16) return decode_all_avx<KV, kD, true>(p, k, v, batch, one);
#endif
  } else if constexpr (std::is_same_v<KV, int8_t>) {
#if defined(PAGODA_INT8_DOT) || defined(PAGODA_INT8_DOT_AVX2)
    if (g_use_bf16_dot && p.q_is_bf16) return decode_all_avx<KV, kD, true>(p, k, v, batch, one);
#endif
  }
  decode_all_avx<KV, kD, false>(p, k, v, batch, one);
}
#endif

// fn(std::integral_constant<int, D>{}) for the head dims D the vector paths are built for;
// false (fn not called) for any other, or in a build without them. The one list of those
// dims: dispatch_head_dim runs them, and vector_path (which splits long ranges) asks it.
template <typename Fn>
inline bool with_vector_head_dim([[maybe_unused]] int64_t head_dim, [[maybe_unused]] Fn&& fn) {
#if defined(PAGODA_DECODE_VEC)
  switch (head_dim) {
    case 32: fn(std::integral_constant<int, 32>{}); return true;
    case 64: fn(std::integral_constant<int, 64>{}); return true;
    case 96: fn(std::integral_constant<int, 96>{}); return true;
    case 128: fn(std::integral_constant<int, 128>{}); return true;
    case 256: fn(std::integral_constant<int, 256>{}); return true;
    default: break;
  }
#endif
  return false;
}

// Whether dispatch_head_dim takes a vector path (which splits long ranges) for p.
inline bool vector_path(const Problem& p) {
  return with_vector_head_dim(p.head_dim, [](auto) {});
}

template <typename KV>
void dispatch_head_dim(const Problem& p, const KV* k, const KV* v, int64_t batch,
                       const OneItem* one = nullptr) {
#if defined(PAGODA_DECODE_VEC)
  if (with_vector_head_dim(p.head_dim, [&](auto d) {
        dispatch_avx<KV, decltype(d)::value>(p, k, v, batch, one);
      })) {
    return;
  }
#endif
  for_each_item<Scratch>(p, batch, p.num_heads / p.num_kv_heads,
                         [&](const OneItem& it, Scratch& s, const OneItem* /*next*/) {
                           decode_one<KV>(p, k, v, it.b, it.kvh0, it.kvh1, s);
                         }, one);
}

// A decode attention call with its arguments checked: the Problem and the tensors its
// pointers point into.
struct PreparedDecode {
  Problem p;
  torch::Tensor k_cache, v_cache, block_tables, seq_lens;
  int64_t batch;
};

PreparedDecode prepare_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_lens, double scale, int64_t sliding_window,
                              std::optional<torch::Tensor> k_scale,
                              std::optional<torch::Tensor> v_scale,
                              std::optional<torch::Tensor> q_sink, int64_t num_sink_tokens) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, k_scale, v_scale, "[B, H, D]");
  TORCH_CHECK(!q_sink.has_value() || (q_sink->sizes() == q.sizes() &&
                                      q_sink->scalar_type() == q.scalar_type() &&
                                      q_sink->is_contiguous()),
              "q_sink must be contiguous, of q's shape and dtype");
  TORCH_CHECK(num_sink_tokens >= 0 && (num_sink_tokens == 0 || q_sink.has_value()),
              "num_sink_tokens must be >= 0, and > 0 only with q_sink");
  const int64_t batch = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables: [B, M]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch, "seq_lens: [B]");

  auto bt = pagoda_index::as_long(block_tables);
  auto sl = pagoda_index::as_long(seq_lens);
  const int block_size = shape.block_size;
  const int64_t max_len = bt.size(1) * block_size;
  const int64_t* lens = sl.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_len, "seq_len ", lens[b], " out of range");
    const int64_t start = sliding_window >= 0 ? std::max<int64_t>(0, lens[b] - sliding_window)
                                              : 0;
    const int64_t* row = bt.data_ptr<int64_t>() + b * bt.size(1);
    const int64_t sinks_end = std::min(num_sink_tokens, lens[b]);
    check_block_ids(row, b, 0, sinks_end, block_size, num_blocks);
    check_block_ids(row, b, std::max(start, sinks_end), lens[b], block_size, num_blocks);
  }

  Problem p{q.data_ptr(), out.data_ptr(), q.scalar_type() == at::kBFloat16,
            bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), bt.size(1), shape.num_heads,
            shape.num_kv_heads, shape.head_dim, block_size, static_cast<float>(scale),
            sliding_window};
  if (shape.quantized) {
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
  }
  if (q_sink.has_value()) {
    p.q_sink = q_sink->data_ptr();
    p.num_sinks = num_sink_tokens;
  }
  return PreparedDecode{p, k_cache, v_cache, bt, sl, batch};
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale, int64_t sliding_window,
                            std::optional<torch::Tensor> k_scale,
                            std::optional<torch::Tensor> v_scale,
                            std::optional<torch::Tensor> q_sink, int64_t num_sink_tokens) {
  const PreparedDecode d = prepare_decode(out, q, k_cache, v_cache, block_tables, seq_lens,
                                          scale, sliding_window, k_scale, v_scale, q_sink,
                                          num_sink_tokens);
  if (d.batch == 0) return;
  visit_caches(d.k_cache, d.v_cache, [&](const auto* k, const auto* v) {
    dispatch_head_dim(d.p, k, v, d.batch);
  });
}

// Turns the bf16 dot products on or off (tests of the fallback; in the prefill kernel too) and
// returns the inner path that bf16 q on bf16 caches (head dim 32/64/96/128/256) now takes:
// "bf16_dot" (vdpbf16ps), "avx512" (fp32 FMAs), "avx2" (fp32 FMAs, 8 lanes) or "portable".
std::string set_bf16_dot(bool enable) {
  g_use_bf16_dot = enable;
#if defined(__AVX512BF16__)
  if (enable) return "bf16_dot";
#endif
#if defined(PAGODA_DECODE_AVX512)
  return "avx512";
#elif defined(PAGODA_DECODE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// The inner paths that a bf16 q on int8 and on fp8 caches (head dims 32/64/96/128/256) now
// takes: "int8_dot" (int16 q and weights: vpdpwssd on AVX-512, vpmaddwd + vpaddd on AVX2,
// the same results), "bf16_dot" (fp8: vdpbf16ps), "fp32" (widened rows, fp32 FMAs) or
// "portable".
std::map<std::string, std::string> code_paths() {
  std::map<std::string, std::string> paths{{"int8", "fp32"}, {"fp8", "fp32"}};
#if !defined(PAGODA_DECODE_VEC)
  paths = {{"int8", "portable"}, {"fp8", "portable"}};
#endif
#if defined(PAGODA_INT8_DOT) || defined(PAGODA_INT8_DOT_AVX2)
  if (g_use_bf16_dot) paths["int8"] = "int8_dot";
#endif
#if defined(PAGODA_FP8_DOT)
  if (g_use_bf16_dot) paths["fp8"] = "bf16_dot";
#endif
  return paths;
}

// The instruction-set extensions (named as in /proc/cpuinfo) that the vector path of
// paged_decode_attention was compiled to use; empty: the portable path only.
std::vector<std::string> attention_isa() {
  std::vector<std::string> isa;
#if defined(PAGODA_DECODE_AVX512)
  isa.push_back("avx512f");
#elif defined(PAGODA_DECODE_AVX2)
  isa.push_back("avx2");
  isa.push_back("fma");
#endif
#if defined(__AVX512BF16__)
  isa.push_back("avx512_bf16");
#endif
#if defined(PAGODA_FP8_DOT) || defined(PAGODA_INT8_DOT)
  isa.push_back("avx512bw");
#endif
#if defined(PAGODA_INT8_DOT)
  isa.push_back("avx512_vnni");
#endif
  return isa;
}

}  // namespace

namespace pagoda_decode {
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                      double scale, int64_t sliding_window, std::optional<torch::Tensor> k_scale,
                      std::optional<torch::Tensor> v_scale) {
  paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                         sliding_window, k_scale, v_scale, std::nullopt, 0);
}

DecodeWork decode_work(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                       double scale, int64_t sliding_window, std::optional<torch::Tensor> k_scale,
                       std::optional<torch::Tensor> v_scale) {
  struct State {
    PreparedDecode d;
    std::vector<OneItem> items;
    Split split;
  };
  auto st = std::make_shared<State>();
  st->d = prepare_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                         sliding_window, k_scale, v_scale, std::nullopt, 0);
  const int64_t hk = st->d.p.num_kv_heads;
  const bool split = vector_path(st->d.p) &&
                     split_items(st->d.p, st->d.batch, 1, st->items, st->split);
  DecodeWork w;
  w.items = split ? static_cast<int64_t>(st->items.size()) : st->d.batch * hk;
  w.split = split;
  w.run = [st, split, hk](int64_t i) {
    const OneItem one = split ? st->items[i]
                              : OneItem{i / hk, static_cast<int>(i % hk),
                                        static_cast<int>(i % hk) + 1};
    visit_caches(st->d.k_cache, st->d.v_cache, [&](const auto* k, const auto* v) {
      dispatch_head_dim(st->d.p, k, v, st->d.batch, &one);
    });
  };
  return w;
}
}  // namespace pagoda_decode

// Defined in fused_ops_cpu.cpp and paged_prefill_cpu.cpp (the same extension).
void register_fused_ops(pybind11::module& m);
std::vector<std::string> fused_ops_isa();
void register_prefill_attention(pybind11::module& m);
std::vector<std::string> prefill_attention_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_fused_ops(m);
  register_prefill_attention(m);
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (in place into out)", pybind11::arg("out"),
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("sliding_window"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none(), pybind11::arg("q_sink") = pybind11::none(),
        pybind11::arg("num_sink_tokens") = 0);
  m.def("kernel_isa", [] {
    return std::map<std::string, std::vector<std::string>>{
        {"paged_attention", attention_isa()}, {"fused_ops", fused_ops_isa()},
        {"paged_prefill_attention", prefill_attention_isa()}};
  }, "op -> the /proc/cpuinfo flags its compiled vector path uses (empty: scalar only)");
  m.def("decode_code_paths", &code_paths,
        "cache dtype (int8, fp8) -> the decode path a bf16 q on it takes now (set_bf16_dot)");
  m.def(
      "set_kv_prefetch_l2", [](bool on) { pagoda_attn::g_kv_prefetch_l2.store(on); },
      "decode attention's K/V prefetches into L2 (prefetcht1) instead of L1 (prefetcht0)");
  m.def("kv_prefetch_l2", [] { return pagoda_attn::g_kv_prefetch_l2.load(); });
  m.def("decode_parts_run", [] { return g_parts_run.load(); },
        "part items of split decode ranges run since the extension loaded");
  m.def("decode_split_cpus", [] { return g_split_cpus; },
        "the CPU count decode attention's split decision uses (this process's affinity)");
  m.def("decode_split_len", [] { return g_split_len.load(); },
        "positions per part of a split decode range (0: ranges are not split)");
  m.def("set_decode_split_len", [](int64_t len) {
          TORCH_CHECK(len == 0 || (len > 0 && len % 16 == 0), "the part length must be 0 or a "
                      "positive multiple of 16, not ", len);
          return g_split_len.exchange(len);
        }, "sets decode_split_len (0: no split); returns the old length");
  m.def("set_bf16_dot", &set_bf16_dot,
        "Enable/disable the AVX512_BF16 dot product for bf16 caches; returns the path in use");
}
