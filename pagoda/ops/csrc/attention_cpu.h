// Helpers shared by the paged attention kernels (paged_attention_cpu.cpp: one query row at
// a time; paged_prefill_cpu.cpp: tiles of query rows): the cache rows as fp32 vectors, the
// vector exp of the online softmax, the rows of one tile of 16 positions found through a
// block table, and the argument checks both kernels share. The vector helpers are written
// once over vec_lanes_cpu.h's widths: 16 lanes (AVX-512) and 8 (AVX2 + FMA), the same bits.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGODA_ATTN_VEC 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "kv_quant_cpu.h"
#include "vec_lanes_cpu.h"

namespace pagoda_attn {

// False when a test has turned the bf16 dot-product paths off (to exercise the fallback).
inline std::atomic<bool> g_use_bf16_dot{true};

// Where the decode kernel's software prefetches of K/V rows land: false = L1 (T0 hint),
// true = L2 (T1 hint). Set once per process from the CPU's vendor (cpu_kernels.py,
// configure_kv_prefetch). NOTE (measured): on an AMD EPYC Zen 4 one core with T0 prefetches
// read 12 GB/s, as many lines as its L1 can have in flight; T1 ones, which the L2's larger
// miss queue tracks, 22 GB/s. On the AMX Xeons L2 hints were slower.
inline std::atomic<bool> g_kv_prefetch_l2{false};

// int8 codes, and uint8 = fp8 e4m3fn codes, carry a scale per (token, kv head).
template <typename KV>
constexpr bool kQuantized = std::is_same_v<KV, int8_t> || std::is_same_v<KV, uint8_t>;

// A quantized cache's scales: both given, float32 [N, bs, Hk] and contiguous; a plain
// cache has none. Returns whether the cache is quantized.
inline bool check_scales(const torch::Tensor& k_cache,
                         const std::optional<torch::Tensor>& k_scale,
                         const std::optional<torch::Tensor>& v_scale) {
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == at::kChar || dtype == at::kByte;
  TORCH_CHECK(k_scale.has_value() == quantized && v_scale.has_value() == quantized,
              quantized ? "a quantized (int8 / fp8) cache needs k_scale and v_scale"
                        : "k_scale / v_scale are for quantized caches only");
  if (!quantized) return false;
  for (const auto* sc : {&*k_scale, &*v_scale}) {
    TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                    sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) &&
                    sc->size(2) == k_cache.size(2),
                "k_scale and v_scale must be contiguous float32 [N, bs, Hk]");
  }
  return true;
}

// What both kernels read off their arguments once checked (check_attention_args).
struct AttentionShape {
  int num_heads, num_kv_heads, head_dim, block_size;
  bool quantized;
};

// The arguments the decode and prefill kernels share, checked with a clear error: q and out
// [rows, H, D] (q_layout names rows in the messages) of one dtype, float32 or bfloat16;
// contiguous caches [N, bs, Hk, D] of one dtype, Hk dividing H; scales where quantized.
inline AttentionShape check_attention_args(const torch::Tensor& out, const torch::Tensor& q,
                                           const torch::Tensor& k_cache,
                                           const torch::Tensor& v_cache,
                                           const std::optional<torch::Tensor>& k_scale,
                                           const std::optional<torch::Tensor>& v_scale,
                                           const char* q_layout) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be ", q_layout);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [N, bs, Hk, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  AttentionShape shape{static_cast<int>(q.size(1)), static_cast<int>(k_cache.size(2)),
                       static_cast<int>(q.size(2)), static_cast<int>(k_cache.size(1)),
                       check_scales(k_cache, k_scale, v_scale)};
  TORCH_CHECK(k_cache.size(3) == shape.head_dim, "head dims differ");
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  return shape;
}

// The block ids of table row r that positions [start, end) read lie inside the cache.
// NOTE: only those, so entries past them (table padding) or before a window may hold anything.
inline void check_block_ids(const int64_t* row, int64_t r, int64_t start, int64_t end,
                            int64_t block_size, int64_t num_blocks) {
  for (int64_t j = start / block_size; j * block_size < end; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "block_tables[", r, ", ", j, "] = ",
                row[j], " is out of range for a KV cache of ", num_blocks, " blocks");
  }
}

// fn(k, v) with the caches' data as the element type the kernels read: float, bf16 bits
// (uint16_t), int8 codes or fp8 e4m3fn bits (uint8_t); any other dtype is refused.
template <typename Fn>
inline void visit_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, Fn&& fn) {
  switch (k_cache.scalar_type()) {
    case at::kChar:
      return fn(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    case at::kByte:
      return fn(k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>());
    case at::kFloat:
      return fn(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    case at::kBFloat16:
      return fn(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
    default:
      TORCH_CHECK(false, "caches must be float32, bfloat16, int8 or uint8 (fp8 e4m3fn bits)");
  }
}

#if defined(PAGODA_ATTN_VEC)
// Positions per K/V tile (both kernels, every vector width).
constexpr int kTile = 16;

// What a quantized row's scale is multiplied by for the rows load_row_f32 gives.
template <typename KV>
constexpr float kCodeUnit = std::is_same_v<KV, uint8_t> ? pagoda_kvq::kFp8Unit : 1.0f;
#endif

#if defined(PAGODA_ATTN_VEC)
// One row of kD values as kD / kLanes fp32 vectors V (__m512, or __m256 where the build has
// AVX2 + FMA: vec_lanes_cpu.h): natural order for float rows and codes; for bf16 rows each
// 32 values give the even elements, then the odd ones (16 lanes: one vector each; 8 lanes:
// two each), so that vector i of 8 lanes holds lanes 8 (i % 2) .. 8 (i % 2) + 7 of vector
// i / 2 of 16 lanes on every row type.
template <int kD, typename V>
inline void load_row_f32(const float* src, V* f) {
  constexpr int kL = sizeof(V) / sizeof(float);
  for (int i = 0; i < kD / kL; ++i) f[i] = pagoda_vec::vload<V>(src + kL * i);
}

template <int kD, typename V>
inline void load_row_f32(const uint16_t* src, V* f) {
  constexpr int kL = sizeof(V) / sizeof(float), kN = 16 / kL;  // loads per 32 values
  for (int c = 0; c < kD / 32; ++c) {
    for (int k = 0; k < kN; ++k) {
      pagoda_vec::vload_bf16_pairs<V>(src + 32 * c + 2 * kL * k, f[2 * kN * c + k],
                                      f[2 * kN * c + kN + k]);
    }
  }
}

// int8 codes: sign-extended to int32, then converted (exact).
template <int kD, typename V>
inline void load_row_f32(const int8_t* src, V* f) {
  constexpr int kL = sizeof(V) / sizeof(float);
  for (int i = 0; i < kD / kL; ++i) f[i] = pagoda_vec::vload_i8<V>(src + kL * i);
}

// fp8 e4m3fn codes as value * 2^-120 (kv_quant_cpu.h: kFp8Unit; pagoda_vec::vload_fp8).
template <int kD, typename V>
inline void load_row_f32(const uint8_t* src, V* f) {
  constexpr int kL = sizeof(V) / sizeof(float);
  for (int i = 0; i < kD / kL; ++i) f[i] = pagoda_vec::vload_fp8<V>(src + kL * i);
}

// exp(x) for x <= 0 on every lane (paged_attention_cpu.cpp's exp_nonpos: the same
// polynomial); the final p * 2^n is scalef on AVX-512 and an exact double product rounded
// once on AVX2 (n is in [-126, 0]): the same bits on both widths. NOTE: forced inline: in
// the decode kernel's large tile loops GCC otherwise calls it, through the PLT.
template <typename V>
__attribute__((always_inline)) inline V vexp_nonpos(V x) {
  using pagoda_vec::vset1;
  x = pagoda_vec::vmax(x, vset1<V>(-87.0f));
  const V n = pagoda_vec::vrint(pagoda_vec::vmul(x, vset1<V>(1.44269504088896341f)));
  V r = pagoda_vec::vfnmadd(n, vset1<V>(0.693145751953125f), x);
  r = pagoda_vec::vfnmadd(n, vset1<V>(1.42860682030941723e-6f), r);
  V p = vset1<V>(1.0f / 720.0f);
  p = pagoda_vec::vfmadd(p, r, vset1<V>(1.0f / 120.0f));
  p = pagoda_vec::vfmadd(p, r, vset1<V>(1.0f / 24.0f));
  p = pagoda_vec::vfmadd(p, r, vset1<V>(1.0f / 6.0f));
  p = pagoda_vec::vfmadd(p, r, vset1<V>(0.5f));
  p = pagoda_vec::vfmadd(p, r, vset1<V>(1.0f));
  p = pagoda_vec::vfmadd(p, r, vset1<V>(1.0f));
  return pagoda_vec::vscale2_in_range(p, n);
}
#endif  // PAGODA_ATTN_VEC

#if defined(PAGODA_ATTN_VEC)

// The rows of one tile: positions [16 * tile + lo, 16 * tile + hi) are valid; off[t] is
// the element offset of lane t's cache row (kv head 0). Invalid lanes repeat a valid row,
// so every lane can be loaded; their scores are masked and their V rows never read.
struct TileRows {
  int64_t off[kTile];
  int64_t slot[kTile];  // lane t's token slot (block id * block_size + row): its scales
  int lo, hi;
  uint16_t mask;  // bit t: lane t valid (an AVX-512 __mmask16)
};

inline void tile_rows(int64_t bs, const int64_t* table, int64_t row_stride, int64_t tile,
                      int64_t start, int64_t seq_len, TileRows& tr) {
  const int64_t pos0 = tile * kTile;
  tr.lo = static_cast<int>(std::max(start, pos0) - pos0);
  tr.hi = static_cast<int>(std::min(seq_len, pos0 + kTile) - pos0);
  tr.mask = static_cast<uint16_t>(((1u << tr.hi) - 1u) & ~((1u << tr.lo) - 1u));
  if (bs % kTile == 0) {
    // NOTE: the tile lies in one block, so its slots are consecutive: no table walk per row.
    const int64_t slot0 = table[pos0 / bs] * bs + pos0 % bs;
    for (int t = 0; t < kTile; ++t) {
      tr.slot[t] = slot0 + std::clamp(t, tr.lo, tr.hi - 1);
      tr.off[t] = tr.slot[t] * row_stride;
    }
    return;
  }
  int64_t blk = (pos0 + tr.lo) / bs;
  int64_t r = pos0 + tr.lo - blk * bs;
  int64_t base = table[blk] * bs;
  for (int t = tr.lo; t < tr.hi; ++t) {
    tr.slot[t] = base + r;
    tr.off[t] = (base + r) * row_stride;
    if (++r == bs && t + 1 < tr.hi) {
      r = 0;
      base = table[++blk] * bs;
    }
  }
  for (int t = 0; t < tr.lo; ++t) tr.off[t] = tr.off[tr.lo], tr.slot[t] = tr.slot[tr.lo];
  for (int t = tr.hi; t < kTile; ++t) tr.off[t] = tr.off[tr.lo], tr.slot[t] = tr.slot[tr.lo];
}
#endif  // PAGODA_ATTN_VEC

}  // namespace pagoda_attn
