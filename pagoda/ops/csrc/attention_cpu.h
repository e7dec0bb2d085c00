// Helpers shared by the paged attention kernels (paged_attention_cpu.cpp: one query row at
// a time; paged_prefill_cpu.cpp: tiles of query rows): the cache rows as fp32 vectors, the
// vector exp of the online softmax, the rows of one tile of 16 positions found through a
// block table, and the argument checks both kernels share. The 16-lane (AVX-512) helpers
// serve both kernels; the 8-lane (AVX2 + FMA) ones the prefill kernel's AVX2 build.
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

namespace pagoda_attn {

// False when a test has turned the bf16 dot-product paths off (to exercise the fallback).
inline std::atomic<bool> g_use_bf16_dot{true};

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

#if defined(__AVX512F__)

// One row of kD values as kD / 16 fp32 vectors: natural order for float rows; for bf16 rows,
// each 32 values give two vectors (even elements, odd elements).
template <int kD>
inline void load_row_f32(const float* src, __m512* f) {
  for (int i = 0; i < kD / 16; ++i) f[i] = _mm512_loadu_ps(src + 16 * i);
}

template <int kD>
inline void load_row_f32(const uint16_t* src, __m512* f) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < kD / 32; ++c) {
    const __m512i x = _mm512_loadu_si512(src + 32 * c);
    f[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    f[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
  }
}

// int8 codes: 16 at a time sign-extended to int32, then converted (exact).
template <int kD>
inline void load_row_f32(const int8_t* src, __m512* f) {
  for (int i = 0; i < kD / 16; ++i) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
    f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
  }
}

// fp8 e4m3fn codes as value * 2^-120 (kv_quant_cpu.h: kFp8Unit): the sign-extended byte
// shifted left by 20 has the sign in bits 31..27 and exponent/mantissa in bits 26..20;
// keeping bit 31 and bits 26..20 is the float32. Subnormal codes give float32 denormals,
// which the FMAs take exactly (nothing here sets denormals-are-zero).
template <int kD>
inline void load_row_f32(const uint8_t* src, __m512* f) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  for (int i = 0; i < kD / 16; ++i) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepi8_epi32(x), 20);
    f[i] = _mm512_castsi512_ps(_mm512_and_si512(w, keep));
  }
}

// 16 lanes of exp_nonpos (same polynomial); scalef multiplies by 2^n without bit tricks.
inline __m512 exp16_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// 8-lane forms of load_row_f32 (kD / 8 vectors, natural order; bf16 rows are widened by
// their callers) and of exp16_nonpos: per lane the same operations, so the same bits.
template <int kD>
inline void load_row_f32(const float* src, __m256* f) {
  for (int i = 0; i < kD / 8; ++i) f[i] = _mm256_loadu_ps(src + 8 * i);
}

template <int kD>
inline void load_row_f32(const int8_t* src, __m256* f) {
  for (int i = 0; i < kD / 8; ++i) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
    f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  }
}

template <int kD>
inline void load_row_f32(const uint8_t* src, __m256* f) {
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  for (int i = 0; i < kD / 8; ++i) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepi8_epi32(x), 20);
    f[i] = _mm256_castsi256_ps(_mm256_and_si256(w, keep));
  }
}

// 2^n as 4 doubles, n (integral, in [-126, 0] here) from 4 int32 lanes.
inline __m256d pow2_pd(__m128i n) {
  const __m256i e = _mm256_add_epi64(_mm256_cvtepi32_epi64(n), _mm256_set1_epi64x(1023));
  return _mm256_castsi256_pd(_mm256_slli_epi64(e, 52));
}

// exp16_nonpos on 8 lanes. scalef's p * 2^n is formed exactly in double (p is a normal
// float, n >= -126) and rounded once to float32 (a subnormal result too), as scalef rounds it.
inline __m256 exp8_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256d lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(p)),
                                   pow2_pd(_mm256_castsi256_si128(ni)));
  const __m256d hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)),
                                   pow2_pd(_mm256_extracti128_si256(ni, 1)));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}
#endif  // __AVX2__ && __FMA__

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
