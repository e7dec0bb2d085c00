// Decode attention over the paged KV cache, on the CPU.
//
// One work item is a request (or, with few requests, one kv head of a request): the
// G = H / Hk query heads that share a kv head are processed together, so every K/V row is
// read from memory once for all of them. K/V rows
// are read in place through the block table (no gather copy), and the softmax is computed
// online, one block at a time, so only one block of scores is ever materialised.
//
// Layouts (all contiguous):
//   q, out        [B, H, D]          float32 or bfloat16 (same dtype)
//   k/v_cache     [N, bs, Hk, D]     float32 or bfloat16 (same dtype)
//   block_tables  [B, max_blocks]    int64 (int32 is widened by the caller)
//   seq_lens      [B]                int64
// Query b attends to positions [max(0, seq_len - window), seq_len); window < 0 means none.

#include <torch/extension.h>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

#if defined(__AVX512F__)
// AVX-512 path, used when the head dim is a compile-time multiple of 16.
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline __m512 load16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

inline __mmask16 tail_mask(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}
#endif

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
};

inline float load_q(const Problem& p, int64_t i) {
  if (p.q_is_bf16) {
    return static_cast<float>(static_cast<const c10::BFloat16*>(p.q)[i]);
  }
  return static_cast<const float*>(p.q)[i];
}

inline void store_out(const Problem& p, int64_t i, float x) {
  if (p.q_is_bf16) {
    static_cast<c10::BFloat16*>(p.out)[i] = c10::BFloat16(x);
  } else {
    static_cast<float*>(p.out)[i] = x;
  }
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

#if defined(__AVX512F__)
// One block of the online softmax for query heads j = (kvh - kvh0) * G + g: scores, then
// the running max/sum update and rescale, then the weighted sum of V rows.
template <typename KV, int kD>
void block_step_avx512(const float* __restrict q, float* __restrict acc,
                       float* __restrict scores, float* __restrict m, float* __restrict l,
                       const KV* k_rows, const KV* v_rows, int n, int64_t row_stride, int kvh0,
                       int kvh1, int G, int bs) {
  constexpr int kV = kD / 16;
  for (int t = 0; t < n; ++t) {
    for (int kvh = kvh0; kvh < kvh1; ++kvh) {
      const KV* kr = k_rows + t * row_stride + kvh * kD;
      __m512 kv[kV];
      for (int i = 0; i < kV; ++i) kv[i] = load16(kr + 16 * i);
      for (int g = 0; g < G; ++g) {
        const int j = (kvh - kvh0) * G + g;
        const float* qj = q + j * kD;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
        for (int i = 1; i < kV; ++i) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * i), kv[i], dot);
        scores[j * bs + t] = _mm512_reduce_add_ps(dot);
      }
    }
  }

  const int nh = (kvh1 - kvh0) * G;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < nh; ++j) {
    float* sj = scores + j * bs;
    __m512 vmax = neg_inf;
    for (int c = 0; c < n; c += 16) {
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, tail_mask(n - c), sj + c));
    }
    const float mx = std::max(m[j], _mm512_reduce_max_ps(vmax));
    const float corr = exp_nonpos(m[j] - mx);  // exp(-inf) clamps to ~0 on the first block
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16) {
      const __mmask16 mask = tail_mask(n - c);
      const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sj + c), vmx));
      _mm512_mask_storeu_ps(sj + c, mask, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mask, e));
    }
    l[j] = l[j] * corr + _mm512_reduce_add_ps(vsum);
    m[j] = mx;
    if (corr != 1.0f) {
      const __m512 vc = _mm512_set1_ps(corr);
      float* aj = acc + j * kD;
      for (int i = 0; i < kV; ++i) {
        _mm512_storeu_ps(aj + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(aj + 16 * i), vc));
      }
    }
  }

  for (int t = 0; t < n; ++t) {
    for (int kvh = kvh0; kvh < kvh1; ++kvh) {
      const KV* vr = v_rows + t * row_stride + kvh * kD;
      __m512 vv[kV];
      for (int i = 0; i < kV; ++i) vv[i] = load16(vr + 16 * i);
      for (int g = 0; g < G; ++g) {
        const int j = (kvh - kvh0) * G + g;
        const __m512 w = _mm512_set1_ps(scores[j * bs + t]);
        float* aj = acc + j * kD;
        for (int i = 0; i < kV; ++i) {
          _mm512_storeu_ps(aj + 16 * i, _mm512_fmadd_ps(w, vv[i], _mm512_loadu_ps(aj + 16 * i)));
        }
      }
    }
  }
}
#endif

// One work item: request b, kv heads [kvh0, kvh1) and their G query heads each. Blocks are
// the outer loop so that, when the item spans all kv heads, each block is read sequentially.
// kD > 0 fixes the head dim at compile time (full unrolling); kD == 0 reads it at run time.
template <typename KV, int kD>
void decode_one(const Problem& p, const KV* k_cache, const KV* v_cache, int64_t b, int kvh0,
                int kvh1, Scratch& s) {
  const int D = kD > 0 ? kD : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = (kvh1 - kvh0) * G;  // query heads in this item
  const int bs = p.block_size;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t seq_len = p.seq_lens[b];
  const int64_t start = p.window >= 0 ? std::max<int64_t>(0, seq_len - p.window) : 0;
  const int64_t q_base = (b * p.num_heads + static_cast<int64_t>(kvh0) * G) * D;

  float* __restrict q = s.q.data();
  float* __restrict acc = s.acc.data();
  float* __restrict scores = s.scores.data();
  float* __restrict row = s.row.data();
  for (int i = 0; i < nh * D; ++i) {
    q[i] = load_q(p, q_base + i) * p.scale;
    acc[i] = 0.0f;
  }
  for (int j = 0; j < nh; ++j) {
    s.m[j] = -std::numeric_limits<float>::infinity();
    s.l[j] = 0.0f;
  }

  const int64_t* table = p.block_tables + b * p.bt_stride;
  const int64_t last_blk = (seq_len - 1) / bs;
  for (int64_t blk = start / bs; blk * bs < seq_len; ++blk) {
    const int64_t t0 = std::max(start, blk * bs) - blk * bs;
    const int64_t t1 = std::min(seq_len, (blk + 1) * bs) - blk * bs;
    const int n = static_cast<int>(t1 - t0);
    // NOTE: block ids are random, so the hardware prefetcher cannot run ahead across
    // blocks; ask for the blocks kPrefetchBlocks ahead (the first iteration covers all).
    for (int64_t ahead = blk == start / bs ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks;
         ++ahead) {
      const int64_t nb = blk + ahead;
      if (nb > last_blk) break;
      const int64_t nt1 = std::min<int64_t>(bs, seq_len - nb * bs);
      prefetch_block(k_cache, p, table[nb], 0, nt1, kvh0, kvh1);
      prefetch_block(v_cache, p, table[nb], 0, nt1, kvh0, kvh1);
    }
    const int64_t first = (table[blk] * bs + t0) * row_stride;
    const KV* k_rows = k_cache + first;
    const KV* v_rows = v_cache + first;
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 16 == 0) {
      block_step_avx512<KV, kD>(q, acc, scores, s.m.data(), s.l.data(), k_rows, v_rows, n,
                                row_stride, kvh0, kvh1, G, bs);
      continue;
    }
#endif

    for (int t = 0; t < n; ++t) {
      for (int kvh = kvh0; kvh < kvh1; ++kvh) {
        const float* kr = RowLoader<KV>::load(k_rows + t * row_stride + kvh * D, row, D);
        for (int g = 0; g < G; ++g) {
          const int j = (kvh - kvh0) * G + g;
          const float* qj = q + j * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int i = 0; i < D; ++i) dot += qj[i] * kr[i];
          scores[j * bs + t] = dot;
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
        for (int g = 0; g < G; ++g) {
          const int j = (kvh - kvh0) * G + g;
          const float w = scores[j * bs + t];
          float* aj = acc + j * D;
#pragma omp simd
          for (int i = 0; i < D; ++i) aj[i] += w * vr[i];
        }
      }
    }
  }

  for (int j = 0; j < nh; ++j) {
    const float inv = s.l[j] > 0.0f ? 1.0f / s.l[j] : 0.0f;
    for (int i = 0; i < D; ++i) store_out(p, q_base + j * D + i, acc[j * D + i] * inv);
  }
}

template <typename KV, int kD>
void decode_all(const Problem& p, const KV* k_cache, const KV* v_cache, int64_t batch) {
  const int num_threads = at::get_num_threads();
  // NOTE: a whole request per item reads each block sequentially (best for the memory
  // system); with too few requests to keep the threads busy, split by kv head instead.
  const int heads_per_item = batch >= 4 * num_threads ? p.num_kv_heads : 1;
  const int items_per_req = p.num_kv_heads / heads_per_item;
  const int64_t num_items = batch * items_per_req;
  const int G = p.num_heads / p.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s(heads_per_item * G, p.head_dim, p.block_size);
    // NOTE: dynamic scheduling because context lengths (work per item) vary widely.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int kvh0 = static_cast<int>(item % items_per_req) * heads_per_item;
      decode_one<KV, kD>(p, k_cache, v_cache, item / items_per_req, kvh0,
                         kvh0 + heads_per_item, s);
    }
  }
}

template <typename KV>
void dispatch_head_dim(const Problem& p, const KV* k, const KV* v, int64_t batch) {
  switch (p.head_dim) {
    case 64:
      return decode_all<KV, 64>(p, k, v, batch);
    case 128:
      return decode_all<KV, 128>(p, k, v, batch);
    default:
      return decode_all<KV, 0>(p, k, v, batch);
  }
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [N, bs, Hk, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  const int64_t batch = q.size(0);
  const int num_heads = static_cast<int>(q.size(1));
  const int head_dim = static_cast<int>(q.size(2));
  const int num_kv_heads = static_cast<int>(k_cache.size(2));
  TORCH_CHECK(k_cache.size(3) == head_dim, "head dims differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables: [B, M]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch, "seq_lens: [B]");
  if (batch == 0) return;

  auto bt = block_tables.to(at::kLong).contiguous();
  auto sl = seq_lens.to(at::kLong).contiguous();
  const int block_size = static_cast<int>(k_cache.size(1));
  const int64_t max_len = bt.size(1) * block_size;
  const int64_t* lens = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_len, "seq_len ", lens[b], " out of range");
  }

  Problem p{q.data_ptr(), out.data_ptr(), q.scalar_type() == at::kBFloat16,
            bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), bt.size(1), num_heads,
            num_kv_heads, head_dim, block_size, static_cast<float>(scale), sliding_window};
  if (k_cache.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(p, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), batch);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    const auto* k = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const auto* v = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    dispatch_head_dim<uint16_t>(p, k, v, batch);
  } else {
    TORCH_CHECK(false, "caches must be float32 or bfloat16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (in place into out)");
}
