// Fused element-wise CPU ops for the decoder layer: each replaces 4-12 small ATen ops
// (and their Python dispatch), which is where a small decode batch spends most of its time.
//
//   fused_add_rms_norm: residual += x; x = rms_norm(residual) * weight   (both in place)
//   rotary_and_cache:   rotate q and k of a fused qkv buffer in place (neox layout), then
//                       write k and v into the paged caches at their slots (quantized
//                       to int8 / fp8 codes with their scales for a quantized cache:
//                       kv_quant_cpu.h, from the rotated values rounded to the model dtype)
//   silu_and_mul:       [gate | up] -> silu(gate) * up
//
// Rounding: the residual sum is rounded to the model dtype (as transformers' bf16 modules
// do); the normalised value times the weight is rounded once, as torch's fused rms_norm
// does (transformers rounds before the weight multiply too: less accurate); silu is
// rounded before the product, as F.silu(gate) * up does. Math is float32.
//
// Vector paths (fused_vec_cpu.h; bf16 / fp16, written once over its primitives): AVX512F
// plus AVX512BW and AVX512VL (16 lanes; the masked 16-bit loads and stores of the 256-bit
// halves) where the build targets all three, else AVX2 + FMA + F16C (8 lanes), the same
// bits; otherwise scalar loops. fused_ops_isa() reports which, and the Python side sends
// these ops to the PyTorch reference on a CPU that lacks what was compiled (or where only
// the scalar loops were).
//
// NOTE: no FMA contraction, so float32 rotary equals the unfused PyTorch ops bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fused_ops_cpu.h"
#include "fused_vec_cpu.h"
#include "index_args_cpu.h"
#include "kv_quant_cpu.h"

namespace pagoda_fused {

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T from_f(float x) {
  return static_cast<T>(x);
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelGrain = 1 << 15;

// out = rms_norm(s) * weight, s = x (kAdd false) or rr += x rounded to T (kAdd true: the
// residual add, rr updated in place). out may be x.
template <bool kAdd, typename T>
void norm_one(T* out, const T* x, T* rr, const T* weight, int64_t hidden, float eps) {
  const T* s_src = kAdd ? rr : x;  // where the second pass reads s
#if defined(PAGODA_FUSED_VEC)
  if constexpr (kVec<T>) {
    // NOTE: 16 partial sums whatever the lane count (element i in sum i % 16), reduced
    // by vsum16's fixed tree: the AVX-512 and AVX2 paths give the same mean.
    VecF acc[kSumParts];
    for (auto& a : acc) a = vset1<VecF>(0.0f);
    for (int64_t i = 0; i < hidden; i += kLanes) {
      const int64_t n = hidden - i;
      VecF sum = vload(x + i, n);
      if constexpr (kAdd) {
        sum = vround<T>(vadd(sum, vload(rr + i, n)));
        vstore(rr + i, sum, n);
      }
      VecF& a = acc[(i / kLanes) % kSumParts];
      a = vfmadd(sum, sum, a);
    }
    const float mean = vsum16(acc) / static_cast<float>(hidden);
    const VecF inv = vset1<VecF>(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < hidden; i += kLanes) {
      const int64_t n = hidden - i;
      vstore(out + i, vmul(vload(weight + i, n), vmul(vload(s_src + i, n), inv)), n);
    }
    return;
  }
#endif
  double ss = 0.0;
  for (int64_t i = 0; i < hidden; ++i) {
    float f = to_f(x[i]);
    if constexpr (kAdd) {
      const T s = from_f<T>(f + to_f(rr[i]));
      rr[i] = s;
      f = to_f(s);
    }
    ss += static_cast<double>(f) * f;
  }
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / hidden + eps));
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = from_f<T>(to_f(weight[i]) * (to_f(s_src[i]) * inv));
  }
}

template <typename T>
void add_rms_norm_one(T* xr, T* rr, const T* weight, int64_t hidden, float eps) {
  norm_one<true>(xr, xr, rr, weight, hidden, eps);
}

template <typename T>
void add_rms_norm_impl(T* x, T* residual, const T* weight, int64_t rows, int64_t hidden,
                       float eps) {
  const bool par = rows * hidden >= kParallelGrain;
#pragma omp parallel for if (par) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    add_rms_norm_one(x + r * hidden, residual + r * hidden, weight, hidden, eps);
  }
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [H]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "x, residual and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                static_cast<float>(eps));
  });
}

template <typename T>
void rms_norm_impl(const T* x, T* out, const T* weight, int64_t rows, int64_t hidden, float eps) {
  const bool par = rows * hidden >= kParallelGrain;
#pragma omp parallel for if (par) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    norm_one<false>(out + r * hidden, x + r * hidden, static_cast<T*>(nullptr), weight, hidden,
                    eps);
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [H]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

template <typename T>
inline void rotate_head(T* h, const T* cos, const T* sin, int64_t half) {
#if defined(PAGODA_FUSED_VEC)
  if constexpr (kVec<T>) {
    for (int64_t i = 0; i < half; i += kLanes) {
      const int64_t n = half - i;
      const VecF x1 = vload(h + i, n), x2 = vload(h + half + i, n);
      const VecF c = vload(cos + i, n), s = vload(sin + i, n);
      vstore(h + i, vsub(vmul(x1, c), vmul(x2, s)), n);
      vstore(h + half + i, vadd(vmul(x2, c), vmul(x1, s)), n);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(h[i]);
    const float x2 = to_f(h[i + half]);
    const float c = to_f(cos[i]);
    const float s = to_f(sin[i]);
    const float a1 = x1 * c;
    const float b1 = x2 * s;
    const float a2 = x2 * c;
    const float b2 = x1 * s;
    h[i] = from_f<T>(a1 - b1);
    h[i + half] = from_f<T>(a2 + b2);
  }
}

// Head h of one token's k and v rows (k and v: that head's head_dim values) into slot
// `slot` of the caches.
template <typename T>
inline void write_slot_head(const T* k, const T* v, const CacheDst& dst, int64_t slot,
                            int64_t h, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = (slot * num_kv_heads + h) * head_dim, sc = slot * num_kv_heads + h;
  if (dst.k_scale == nullptr) {
    std::memcpy(static_cast<T*>(dst.k) + row, k, head_dim * sizeof(T));
    std::memcpy(static_cast<T*>(dst.v) + row, v, head_dim * sizeof(T));
  } else if (dst.dtype == at::kChar) {
    dst.k_scale[sc] = pagoda_kvq::quantize_row(k, static_cast<int8_t*>(dst.k) + row, head_dim);
    dst.v_scale[sc] = pagoda_kvq::quantize_row(v, static_cast<int8_t*>(dst.v) + row, head_dim);
  } else {
    dst.k_scale[sc] = pagoda_kvq::quantize_row(k, static_cast<uint8_t*>(dst.k) + row, head_dim);
    dst.v_scale[sc] = pagoda_kvq::quantize_row(v, static_cast<uint8_t*>(dst.v) + row, head_dim);
  }
}

// One token's k and v rows (Hk heads of head_dim) into slot `slot` of the caches.
template <typename T>
inline void write_slot(const T* k, const T* v, const CacheDst& dst, int64_t slot,
                       int64_t num_kv_heads, int64_t head_dim) {
  const int64_t kv_row = num_kv_heads * head_dim;
  if (dst.k_scale == nullptr) {
    std::memcpy(static_cast<T*>(dst.k) + slot * kv_row, k, kv_row * sizeof(T));
    std::memcpy(static_cast<T*>(dst.v) + slot * kv_row, v, kv_row * sizeof(T));
    return;
  }
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    write_slot_head(k + h * head_dim, v + h * head_dim, dst, slot, h, num_kv_heads, head_dim);
  }
}

template <typename T>
void rotary_and_cache_impl(T* qkv, const T* cos, const T* sin, const int64_t* positions,
                           const CacheDst& dst, const int64_t* slots, int64_t tokens,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t row_stride) {
  const int64_t half = head_dim / 2;
  const int64_t kv_row = num_kv_heads * head_dim;
  const bool par = tokens * row_stride >= kParallelGrain;
#pragma omp parallel for if (par) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = qkv + t * row_stride;
    const T* c = cos + positions[t] * half;
    const T* s = sin + positions[t] * half;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      rotate_head(row + h * head_dim, c, s, half);
    }
    const T* k = row + num_heads * head_dim;
    const T* v = k + kv_row;
    if (slots[t] < 0) continue;  // a padding token: no cache slot
    write_slot(k, v, dst, slots[t], num_kv_heads, head_dim);
  }
}

// The cache destination of rotary_and_cache: a plain cache of qkv's dtype, or int8 / uint8
// (fp8 bits) codes with their float32 [N, bs, Hk] scales.
CacheDst cache_dst(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   std::optional<torch::Tensor>& k_scale, std::optional<torch::Tensor>& v_scale,
                   int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "caches must be [N, bs, Hk, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dtype, "the caches must share a dtype");
  const bool quantized = dtype == at::kChar || dtype == at::kByte;
  CacheDst dst{k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, dtype};
  if (!quantized) {
    TORCH_CHECK(dtype == qkv.scalar_type(), "qkv, cos/sin and the caches must share a dtype");
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(),
                "k_scale / v_scale are for quantized caches only");
    return dst;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
              "a quantized (int8 / fp8) cache needs k_scale and v_scale");
  for (auto* sc : {&*k_scale, &*v_scale}) {
    TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                    sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) &&
                    sc->size(2) == k_cache.size(2),
                "k_scale and v_scale must be contiguous float32 [N, bs, Hk]");
  }
  dst.k_scale = k_scale->data_ptr<float>();
  dst.v_scale = v_scale->data_ptr<float>();
  return dst;
}

void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                      torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      std::optional<torch::Tensor> k_scale,
                      std::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(qkv.dim() == 3, "qkv must be [T, H + 2 * Hk, D]");
  const int64_t tokens = qkv.size(0);
  const int64_t head_dim = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * num_kv_heads, "qkv head count mismatch");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.stride(2) == 1 && qkv.stride(1) == head_dim, "qkv rows must be dense");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be [P, D / 2]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "qkv, cos/sin and the caches must share a dtype");
  const CacheDst dst = cache_dst(qkv, k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "positions must be [T]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              "slot_mapping must be [T]");
  auto pos = pagoda_index::as_long(positions);
  auto slots = pagoda_index::as_long(slot_mapping);
  const int64_t num_positions = cos.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < num_positions, "position ", p[t], " out of range");
    TORCH_CHECK(sl[t] < num_slots, "slot ", sl[t], " out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    rotary_and_cache_impl<scalar_t>(
        qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), p, dst,
        sl, tokens, num_heads, num_kv_heads, head_dim, qkv.stride(0));
  });
}

template <typename T>
void silu_and_mul_one(const T* g, T* o, int64_t inter) {
  const T* u = g + inter;
#if defined(PAGODA_FUSED_VEC)
  if constexpr (kVec<T>) {
    const VecF one = vset1<VecF>(1.0f), zero = vset1<VecF>(0.0f);
    for (int64_t i = 0; i < inter; i += kLanes) {
      const int64_t n = inter - i;
      const VecF gv = vload(g + i, n);
      const VecF e = vexp(vsub(zero, gv));
      const VecF act = vround<T>(vdiv(gv, vadd(one, e)));
      vstore(o + i, vmul(act, vload(u + i, n)), n);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < inter; ++i) {
    const float gf = to_f(g[i]);
    const T act = from_f<T>(gf / (1.0f + std::exp(-gf)));
    o[i] = from_f<T>(to_f(act) * to_f(u[i]));
  }
}

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter) {
  const bool par = rows * inter >= kParallelGrain;
#pragma omp parallel for if (par) schedule(static)
  for (int64_t r = 0; r < rows; ++r) silu_and_mul_one(x + r * 2 * inter, out + r * inter, inter);
}

void add_rms_norm_row(at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* weight,
                      int64_t hidden, float eps) {
  add_rms_norm_one(x, residual, weight, hidden, eps);
}

void rms_norm_row(const at::BFloat16* x, at::BFloat16* out, const at::BFloat16* weight,
                  int64_t hidden, float eps) {
  norm_one<false>(out, x, static_cast<at::BFloat16*>(nullptr), weight, hidden, eps);
}

void silu_and_mul_row(const at::BFloat16* x, at::BFloat16* out, int64_t inter) {
  silu_and_mul_one(x, out, inter);
}

void rotary_cache_group(at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin,
                        const CacheDst& dst, int64_t slot, int64_t h, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, group = num_heads / num_kv_heads;
  for (int64_t j = h * group; j < (h + 1) * group; ++j) {
    rotate_head(qkv + j * head_dim, cos, sin, half);
  }
  at::BFloat16* k = qkv + (num_heads + h) * head_dim;
  rotate_head(k, cos, sin, half);
  if (slot < 0) return;  // a padding token: no cache slot
  write_slot_head(k, k + num_kv_heads * head_dim, dst, slot, h, num_kv_heads, head_dim);
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * I]");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t inter = x.size(1) / 2;
  auto out = torch::empty({x.size(0), inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                                inter);
  });
  return out;
}

#if defined(PAGODA_FUSED_VEC)
// kLanes values at p as float32 (bf16 / fp16 widened exactly).
template <typename T>
inline VecF vload_full(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return pagoda_vec::vload<VecF>(p);
  } else {
    return vload(p, kLanes);
  }
}

#if defined(PAGODA_FUSED_AVX512)
inline bool any_nan(VecF v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline uint32_t eq_bits(VecF v, float m) {
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ);
}
inline float hmax(VecF v) { return _mm512_reduce_max_ps(v); }
#else
inline bool any_nan(VecF v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline uint32_t eq_bits(VecF v, float m) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(m), _CMP_EQ_OQ));
}
inline float hmax(VecF v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, t[i]);
  return m;
}
#endif
#endif

// The index of the first maximum of x[0, n), as torch.argmax picks it: a NaN is the maximum
// (the first NaN wins); among equal values (-0 and +0 included) the first.
// The maximum of x[0, n) but its NaNs, which set `nan` (max_ps drops them).
template <typename T>
float row_max(const T* x, int64_t n, bool& nan) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  nan = false;
#if defined(PAGODA_FUSED_VEC)
  const int64_t full = n / kLanes * kLanes;
  if (full > 0) {
    VecF m = vset1<VecF>(best);
    for (; i < full; i += kLanes) {
      const VecF v = vload_full(x + i);
      nan = nan || any_nan(v);
      m = vmax(m, v);
    }
    best = hmax(m);
  }
#endif
  for (int64_t j = i; j < n; ++j) {
    const float v = to_f(x[j]);
    nan = nan || std::isnan(v);
    best = std::max(best, v);
  }
  return best;
}

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  // One pass for the maximum, one for its first place.
  bool nan = false;
  const float best = row_max(x, n, nan);
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(to_f(x[j]))) return j;
    }
  }
  int64_t j = 0;
#if defined(PAGODA_FUSED_VEC)
  for (; j + kLanes <= n; j += kLanes) {
    const uint32_t bits = eq_bits(vload_full(x + j), best);
    if (bits != 0) return j + __builtin_ctz(bits);
  }
#endif
  for (; j < n; ++j) {
    if (to_f(x[j]) == best) return j;
  }
  return 0;  // NOTE: n == 0 is refused by the caller
}

template <typename T>
void argmax_rows_impl(const T* x, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for if (rows * n >= 8 * kParallelGrain) schedule(static)
  for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * n, n);
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous [rows, n] matrix with n > 0");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "argmax_rows takes float32, bfloat16 or float16");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (dtype == at::kFloat) {
    argmax_rows_impl(x.data_ptr<float>(), x.size(0), x.size(1), o);
  } else if (dtype == at::kBFloat16) {
    argmax_rows_impl(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), o);
  } else {
    argmax_rows_impl(x.data_ptr<at::Half>(), x.size(0), x.size(1), o);
  }
  return out;
}

// A row's in-kernel Exp(1) draws (race_rows with a seed): element i's uniform is a counter
// hash of i keyed by the row's (seed, row) through splitmix64, two rounds of lowbias32
// (C. Wellons' 32-bit integer mixer); u = its top 24 bits * 2^-24 in [0, 1), E = -log(u).
// Counter-based: no state, any element in any order, the same on every thread. A vector
// of torch's mt19937 uniforms, then their log, took 7.3 ms of a 38 ms step at 32 rows
// (docs/architecture.md, session 41).
struct RaceKey {
  uint32_t k0, k1;
};

inline RaceKey race_key(int64_t seed, int64_t row) {
  uint64_t z = static_cast<uint64_t>(seed) + static_cast<uint64_t>(row + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return {static_cast<uint32_t>(z), static_cast<uint32_t>(z >> 32)};
}

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

#if defined(PAGODA_FUSED_VEC)
#if defined(PAGODA_FUSED_AVX512)
using VecI = __m512i;
inline VecI iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline VecI iadd(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI isub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI imul(VecI a, VecI b) { return _mm512_mullo_epi32(a, b); }
inline VecI ixor(VecI a, VecI b) { return _mm512_xor_si512(a, b); }
inline VecI iand(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI ior(VecI a, VecI b) { return _mm512_or_si512(a, b); }
template <int N>
inline VecI isrl(VecI a) { return _mm512_srli_epi32(a, N); }
inline VecF itof(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecI fbits(VecF a) { return _mm512_castps_si512(a); }
inline VecF bitsf(VecI a) { return _mm512_castsi512_ps(a); }
inline VecI lane_ids() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// (x > c ? a_true : a_false) per lane.
inline VecF vselect_gt(VecF x, VecF c, VecF a_true, VecF a_false) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c, _CMP_GT_OQ), a_false, a_true);
}
#else
using VecI = __m256i;
inline VecI iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline VecI iadd(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI isub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline VecI imul(VecI a, VecI b) { return _mm256_mullo_epi32(a, b); }
inline VecI ixor(VecI a, VecI b) { return _mm256_xor_si256(a, b); }
inline VecI iand(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI ior(VecI a, VecI b) { return _mm256_or_si256(a, b); }
template <int N>
inline VecI isrl(VecI a) { return _mm256_srli_epi32(a, N); }
inline VecF itof(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecI fbits(VecF a) { return _mm256_castps_si256(a); }
inline VecF bitsf(VecI a) { return _mm256_castsi256_ps(a); }
inline VecI lane_ids() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline VecF vselect_gt(VecF x, VecF c, VecF a_true, VecF a_false) {
  return _mm256_blendv_ps(a_false, a_true, _mm256_cmp_ps(x, c, _CMP_GT_OQ));
}
#endif

inline VecI vlowbias32(VecI x) {
  x = ixor(x, isrl<16>(x));
  x = imul(x, iset1(0x7feb352du));
  x = ixor(x, isrl<15>(x));
  x = imul(x, iset1(0x846ca68bu));
  return ixor(x, isrl<16>(x));
}

// ln(u) of a normal float32 u > 0 (Cephes' logf: u = m 2^e, m in [sqrt(1/2), sqrt(2)),
// a degree-8 polynomial in m - 1; about 1 ulp). u = 0 gives -88 (2^-127's log): its E then
// loses the race as an infinite one would, all but surely.
inline VecF vlog(VecF u) {
  const VecI bits = fbits(u);
  VecF e = itof(isub(isrl<23>(bits), iset1(127)));
  VecF m = bitsf(ior(iand(bits, iset1(0x007FFFFFu)), iset1(0x3F800000u)));
  const VecF big = vset1<VecF>(1.41421356237f);
  e = vselect_gt(m, big, vadd(e, vset1<VecF>(1.0f)), e);
  m = vselect_gt(m, big, vmul(m, vset1<VecF>(0.5f)), m);
  const VecF f = vsub(m, vset1<VecF>(1.0f));
  const VecF z = vmul(f, f);
  VecF p = vset1<VecF>(7.0376836292e-2f);
  p = vfmadd(p, f, vset1<VecF>(-1.1514610310e-1f));
  p = vfmadd(p, f, vset1<VecF>(1.1676998740e-1f));
  p = vfmadd(p, f, vset1<VecF>(-1.2420140846e-1f));
  p = vfmadd(p, f, vset1<VecF>(1.4249322787e-1f));
  p = vfmadd(p, f, vset1<VecF>(-1.6668057665e-1f));
  p = vfmadd(p, f, vset1<VecF>(2.0000714765e-1f));
  p = vfmadd(p, f, vset1<VecF>(-2.4999993993e-1f));
  p = vfmadd(p, f, vset1<VecF>(3.3333331174e-1f));
  VecF y = vmul(vmul(p, f), z);
  y = vfmadd(e, vset1<VecF>(-2.12194440e-4f), y);
  y = pagoda_vec::vfnmadd(z, vset1<VecF>(0.5f), y);
  return vfmadd(e, vset1<VecF>(0.693359375f), vadd(f, y));
}

// Exp(1) draws of elements i .. i + kLanes - 1 of a row keyed by k.
inline VecF vrace_exps(RaceKey k, int64_t i) {
  VecI h = iadd(lane_ids(), iset1(static_cast<uint32_t>(i) + k.k0));
  h = vlowbias32(ixor(vlowbias32(h), iset1(k.k1)));
  const VecF u = vmul(itof(isrl<8>(h)), vset1<VecF>(0x1p-24f));
  return vsub(vset1<VecF>(0.0f), vlog(u));
}
#endif

inline float race_exp_scalar(RaceKey k, int64_t i) {
  const uint32_t h = lowbias32(lowbias32(static_cast<uint32_t>(i) + k.k0) ^ k.k1);
  const float u = static_cast<float>(h >> 8) * 0x1p-24f;
  return u > 0.0f ? -std::log(u) : 88.0f;
}

// Truncation (layers/sampler.py's order): min-p, then top-k, then top-p, of a row of
// scaled logits x[0, n) in place, the tokens cut set to -inf. A token's weight is
// w_i = exp(x_i - max x), its probability times the row's sum. min-p cuts w_i below
// min_p * w_max; top-k keeps the k first in rank (x descending, then index ascending); top-p
// keeps a token while the weight of the kept tokens ranked above it is below p times their
// sum (the smallest set of first-ranked tokens whose probability reaches p). A row with a
// NaN or an infinite maximum is left as it is (the race takes its argmax). The sum is taken
// in 16 fixed lanes and each weight by the same vector code, so the AVX-512 and AVX2 builds
// cut the same tokens; the torch reference (ops/reference.py) differs only where a rounding
// decides. Per row the sort is of the few tokens that hold the cut: those within a depth
// of the maximum (kCutDepths), and of many such, one value bucket (narrow_to_bucket).
struct Truncation {
  const int64_t* top_k = nullptr;  // [rows]; <= 0 or >= n: off
  const float* top_p = nullptr;    // [rows]; 1: off
  const float* min_p = nullptr;    // [rows]; 0: off

  bool any() const { return top_k != nullptr || top_p != nullptr || min_p != nullptr; }
  int64_t k(int64_t r, int64_t n) const {
    return top_k != nullptr && top_k[r] > 0 && top_k[r] < n ? top_k[r] : 0;
  }
  float p(int64_t r) const { return top_p != nullptr ? top_p[r] : 1.0f; }
  float min(int64_t r) const { return min_p != nullptr ? min_p[r] : 0.0f; }
  bool cuts(int64_t r, int64_t n) const { return k(r, n) > 0 || p(r) < 1.0f || min(r) > 0.0f; }
};

struct RankedToken {
  float x;
  int64_t i;
};

// a ranks before b: a larger value, or the same value and a smaller index.
inline bool ranks_before(const RankedToken& a, const RankedToken& b) {
  return a.x > b.x || (a.x == b.x && a.i < b.i);
}

// How far below the row's maximum, in turn, the candidates a cut is looked for among reach:
// a value floor, so that they are the first in rank (a weight floor would trust exp's
// polynomial to be monotonic to the last bit).
constexpr float kCutDepths[] = {5.0f, 10.0f, 17.0f, std::numeric_limits<float>::infinity()};

struct CutScratch {
  std::vector<float> w;
  std::vector<RankedToken> ranked;
  std::vector<double> bucket_w;
};

// The finite tokens of value >= floor, into s.ranked (unsorted).
inline void gather_ranked(const float* x, int64_t n, float floor, CutScratch& s) {
  s.ranked.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] >= floor && x[i] > -std::numeric_limits<float>::infinity()) {
      s.ranked.push_back({x[i], i});
    }
  }
}

// Above this many candidates top-p sorts one value bucket of them (narrow_to_bucket).
constexpr int64_t kSortedCandidates = 1024;
constexpr int64_t kBuckets = 2048;

inline float lowest_ranked(const CutScratch& s) {
  float lo = std::numeric_limits<float>::infinity();
  for (const auto& t : s.ranked) lo = std::min(lo, t.x);
  return lo;
}

// Many candidates (values from the maximum m down to a lower lowest): their weights summed
// per value bucket, kBuckets of equal width from m down, in rank order of the buckets, to
// the one where the sum reaches `target`; s.ranked keeps that bucket's tokens only. Returns
// the weight of the buckets above it, or -1 where every bucket together stays below target.
// Sorting one bucket, not thousands of tokens of a flat row, is what keeps top-p cheap there.
inline double narrow_to_bucket(const float* w, float m, double target, CutScratch& s) {
  const double scale = kBuckets / (static_cast<double>(m) - lowest_ranked(s));
  auto bucket = [&](float x) {
    return std::min<int64_t>(kBuckets - 1,
                             static_cast<int64_t>((static_cast<double>(m) - x) * scale));
  };
  s.bucket_w.assign(kBuckets, 0.0);
  for (const auto& t : s.ranked) s.bucket_w[bucket(t.x)] += w[t.i];
  double above = 0.0;
  int64_t b = 0;
  for (; b < kBuckets && above + s.bucket_w[b] < target; ++b) above += s.bucket_w[b];
  if (b == kBuckets) return -1.0;
  s.ranked.erase(std::remove_if(s.ranked.begin(), s.ranked.end(),
                                [&](const RankedToken& t) { return bucket(t.x) != b; }),
                 s.ranked.end());
  return above;
}

// Cuts every token that ranks after `last` (weight 0 too).
inline void cut_after(float* x, float* w, int64_t n, RankedToken last) {
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] < last.x || (x[i] == last.x && i > last.i)) {
      x[i] = -std::numeric_limits<float>::infinity();
      w[i] = 0.0f;
    }
  }
}

// The sum of w[0, n) in 16 lanes (each lane's order fixed), then the lanes in order.
inline double lane_sum16(const float* w, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += w[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += w[i + j];
  double sum = 0.0;
  for (float a : acc) sum += a;
  return sum;
}

void truncate_row(float* x, int64_t n, int64_t k, float p, float min_p, CutScratch& s) {
  if (k <= 0 && !(p < 1.0f) && !(min_p > 0.0f)) return;
  bool nan = false;
  const float m = row_max(x, n, nan);
  if (nan || std::isinf(m)) return;
  s.w.resize(n);
  float* w = s.w.data();
  constexpr float kFloor = -127.0f;  // see row_race
  int64_t i = 0;
#if defined(PAGODA_FUSED_VEC)
  const VecF vm = vset1<VecF>(m), floor = vset1<VecF>(kFloor);
  for (; i + kLanes <= n; i += kLanes) {
    pagoda_vec::vstore(w + i, vexp(vmax(vsub(pagoda_vec::vload<VecF>(x + i), vm), floor)));
  }
  if (i < n) {
    alignas(64) float xt[kLanes], wt[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      xt[j] = i + j < n ? x[i + j] : -std::numeric_limits<float>::infinity();
    }
    pagoda_vec::vstore(wt, vexp(vmax(vsub(pagoda_vec::vload<VecF>(xt), vm), floor)));
    std::memcpy(w + i, wt, (n - i) * sizeof(float));
  }
#else
  for (; i < n; ++i) w[i] = std::exp(std::max(x[i] - m, kFloor));
#endif
  if (min_p > 0.0f) {
    float w_max = 0.0f;
    for (int64_t j = 0; j < n; ++j) w_max = std::max(w_max, w[j]);
    const float threshold = w_max * min_p;
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] < threshold) {
        x[j] = -std::numeric_limits<float>::infinity();
        w[j] = 0.0f;
      }
    }
  }
  if (k > 0) {
    for (float depth : kCutDepths) {
      gather_ranked(x, n, m - depth, s);
      if (static_cast<int64_t>(s.ranked.size()) >= k) break;
    }
    if (static_cast<int64_t>(s.ranked.size()) > k) {
      std::nth_element(s.ranked.begin(), s.ranked.begin() + (k - 1), s.ranked.end(),
                       ranks_before);
      cut_after(x, w, n, s.ranked[k - 1]);
    }
  }
  if (!(p < 1.0f)) return;
  const double target = static_cast<double>(p) * lane_sum16(w, n);
  for (float depth : kCutDepths) {
    const bool whole = std::isinf(depth);
    gather_ranked(x, n, m - depth, s);
    double above = 0.0;
    const bool bucketed = static_cast<int64_t>(s.ranked.size()) > kSortedCandidates &&
                          lowest_ranked(s) < m;
    if (bucketed) {
      above = narrow_to_bucket(w, m, target, s);
      if (above < 0.0) {
        if (whole) return;  // rounding kept the sum below p's share: nothing is cut
        continue;
      }
    }
    std::sort(s.ranked.begin(), s.ranked.end(), ranks_before);
    const int64_t count = static_cast<int64_t>(s.ranked.size());
    for (int64_t r = 0; r <= count; ++r) {
      // NOTE: a bucket whose sum reached the target cuts after its last token even where
      // the running sum, in another order, falls short by a rounding.
      if ((r > 0 && above >= target) || (bucketed && r == count)) {
        cut_after(x, w, n, s.ranked[r - 1]);
        return;
      }
      if (r < count) above += w[s.ranked[r].i];
    }
    if (whole) return;
  }
}

// The sampler's processing before the temperature (layers/sampler.py: logit_bias, then the
// penalties), of float32 rows x [rows, n] in place: a row's bias entries added; a token in
// the row's prompt or output (`seen`) divided by the repetition penalty where positive,
// multiplied where not; then frequency * count + presence * (count > 0) taken off, count
// the token's occurrences in the output. The sampler's CPU path and a decode burst run
// this code, so their tokens agree; the torch reference (ops/reference.py) rounds alike but
// where the compiler fuses the frequency's product with the sum.
struct Penalties {
  const float* repetition = nullptr;  // [rows]; with seen
  const bool* seen = nullptr;         // [rows, n]
  const float* frequency = nullptr;   // [rows]; with presence and counts
  const float* presence = nullptr;    // [rows]
  const float* counts = nullptr;      // [rows, n]
  const int64_t* bias_rows = nullptr;  // [entries]; with bias_ids and bias_values
  const int64_t* bias_ids = nullptr;
  const float* bias_values = nullptr;
  int64_t num_bias = 0;
};

void penalize_row(float* x, int64_t r, int64_t n, const Penalties& p) {
  for (int64_t j = 0; j < p.num_bias; ++j) {
    if (p.bias_rows[j] == r) x[p.bias_ids[j]] += p.bias_values[j];
  }
  if (p.repetition != nullptr) {
    const float pen = p.repetition[r];
    const bool* seen = p.seen + r * n;
    for (int64_t i = 0; i < n; ++i) {
      if (seen[i]) x[i] = x[i] > 0.0f ? x[i] / pen : x[i] * pen;
    }
  }
  if (p.frequency != nullptr) {
    const float f = p.frequency[r], pres = p.presence[r];
    const float* c = p.counts + r * n;
    for (int64_t i = 0; i < n; ++i) {
      x[i] -= f * c[i] + pres * static_cast<float>(c[i] > 0.0f);
    }
  }
}

// Refuses x unless it is a contiguous float32 [rows, n] matrix with n > 0 (op: the caller).
void check_float_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) > 0,
              op, ": x must be a contiguous float32 [rows, n] matrix with n > 0");
}

torch::Tensor penalize_rows(torch::Tensor x, std::optional<torch::Tensor> repetition,
                            std::optional<torch::Tensor> seen,
                            std::optional<torch::Tensor> frequency,
                            std::optional<torch::Tensor> presence,
                            std::optional<torch::Tensor> counts,
                            std::optional<torch::Tensor> bias_rows,
                            std::optional<torch::Tensor> bias_ids,
                            std::optional<torch::Tensor> bias_values) {
  check_float_rows(x, "penalize_rows");
  const int64_t rows = x.size(0), n = x.size(1);
  auto check = [&](const std::optional<torch::Tensor>& t, const char* name, at::ScalarType dt,
                   bool matrix) {
    if (!t.has_value()) return;
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->device().is_cpu() &&
                    (matrix ? t->dim() == 2 && t->size(0) == rows && t->size(1) == n
                            : t->dim() == 1 && t->size(0) == rows),
                "penalize_rows: ", name, " must be a contiguous ", c10::toString(dt), " [",
                rows, matrix ? ", n" : "", "] CPU tensor");
  };
  check(repetition, "repetition", at::kFloat, false);
  check(seen, "seen", at::kBool, true);
  check(frequency, "frequency", at::kFloat, false);
  check(presence, "presence", at::kFloat, false);
  check(counts, "counts", at::kFloat, true);
  TORCH_CHECK(repetition.has_value() == seen.has_value(),
              "penalize_rows: repetition comes with seen");
  TORCH_CHECK(frequency.has_value() == presence.has_value() &&
                  frequency.has_value() == counts.has_value(),
              "penalize_rows: frequency, presence and counts come together");
  TORCH_CHECK(bias_rows.has_value() == bias_ids.has_value() &&
                  bias_rows.has_value() == bias_values.has_value(),
              "penalize_rows: bias_rows, bias_ids and bias_values come together");
  Penalties p;
  if (repetition.has_value()) {
    p.repetition = repetition->data_ptr<float>();
    p.seen = seen->data_ptr<bool>();
  }
  if (frequency.has_value()) {
    p.frequency = frequency->data_ptr<float>();
    p.presence = presence->data_ptr<float>();
    p.counts = counts->data_ptr<float>();
  }
  if (bias_rows.has_value()) {
    const int64_t entries = bias_rows->numel();
    TORCH_CHECK(bias_rows->scalar_type() == at::kLong && bias_ids->scalar_type() == at::kLong &&
                    bias_values->scalar_type() == at::kFloat && bias_rows->dim() == 1 &&
                    bias_ids->sizes() == bias_rows->sizes() &&
                    bias_values->sizes() == bias_rows->sizes() && bias_rows->is_contiguous() &&
                    bias_ids->is_contiguous() && bias_values->is_contiguous() &&
                    bias_rows->device().is_cpu() && bias_ids->device().is_cpu() &&
                    bias_values->device().is_cpu(),
                "penalize_rows: the bias must be contiguous CPU [E] int64 rows, int64 ids and "
                "float32 values");
    p.bias_rows = bias_rows->data_ptr<int64_t>();
    p.bias_ids = bias_ids->data_ptr<int64_t>();
    p.bias_values = bias_values->data_ptr<float>();
    p.num_bias = entries;
    for (int64_t j = 0; j < entries; ++j) {
      TORCH_CHECK(p.bias_rows[j] >= 0 && p.bias_rows[j] < rows && p.bias_ids[j] >= 0 &&
                      p.bias_ids[j] < n,
                  "penalize_rows: bias entry ", j, " (row ", p.bias_rows[j], ", token ",
                  p.bias_ids[j], ") is outside [", rows, ", ", n, "]");
    }
  }
  float* xp = x.data_ptr<float>();
#pragma omp parallel for if (rows * n >= 8 * kParallelGrain) schedule(static)
  for (int64_t r = 0; r < rows; ++r) penalize_row(xp + r * n, r, n, p);
  return x;
}

// Row r's token of the exponential race (layers/sampler.py: race_sample): the first maximum
// over i of exp(x_i - max x) / e_i, x = logits / t (a rounded division, as torch's div):
// with e_i i.i.d. Exp(1) draws, token i wins with probability softmax(x)_i. The draws are
// `e` or, where it is null, made here from `key` (race_exp). t == 0 takes the logits' first
// maximum (a greedy row); so does a row with a NaN (its first NaN, as argmax) or an infinite
// maximum. Every element goes through the same vector code (a tail as one padded block), so
// the AVX-512 and AVX2 builds pick the same tokens.
template <typename T>
int64_t row_race(const T* l, const float* e, RaceKey key, int64_t n, float t,
                 std::vector<float>& score) {
  if (t == 0.0f) return row_argmax(l, n);
  bool nan = false;
  const float best = row_max(l, n, nan);
  if (nan || std::isinf(best)) return row_argmax(l, n);
  // NOTE: rounding is monotonic, so max(l) / t is the maximum of the rounded quotients.
  const float m = best / t;
  // NOTE: exp of the clamped difference is 0 in float below -104; the clamp keeps -inf
  // (a masked token) out of the polynomial, where it would give NaN.
  constexpr float kFloor = -127.0f;
  score.resize(n);
  int64_t i = 0;
#if defined(PAGODA_FUSED_VEC)
  const VecF vt = vset1<VecF>(t), vm = vset1<VecF>(m), floor = vset1<VecF>(kFloor);
  auto block = [&](VecF x, VecF ev) {
    return vdiv(vexp(vmax(vsub(vdiv(x, vt), vm), floor)), ev);
  };
  auto exps_at = [&](int64_t j) {
    return e != nullptr ? pagoda_vec::vload<VecF>(e + j) : vrace_exps(key, j);
  };
  for (; i + kLanes <= n; i += kLanes) {
    pagoda_vec::vstore(score.data() + i, block(vload_full(l + i), exps_at(i)));
  }
  if (i < n) {
    alignas(64) float lt[kLanes], et[kLanes], st[kLanes];
    pagoda_vec::vstore(et, e != nullptr ? vset1<VecF>(1.0f) : vrace_exps(key, i));
    for (int64_t k = 0; k < kLanes; ++k) {
      lt[k] = i + k < n ? to_f(l[i + k]) : -std::numeric_limits<float>::infinity();
      if (e != nullptr && i + k < n) et[k] = e[i + k];
    }
    pagoda_vec::vstore(st, block(pagoda_vec::vload<VecF>(lt), pagoda_vec::vload<VecF>(et)));
    std::memcpy(score.data() + i, st, (n - i) * sizeof(float));
  }
#else
  for (; i < n; ++i) {
    const float ei = e != nullptr ? e[i] : race_exp_scalar(key, i);
    score[i] = std::exp(std::max(to_f(l[i]) / t - m, kFloor)) / ei;
  }
#endif
  return row_argmax(score.data(), n);
}

template <typename T>
void race_rows_impl(const T* l, const float* t, const float* e, const int64_t* seeds,
                    const Truncation& cut, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for if (rows * n >= 8 * kParallelGrain) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    // NOTE: per thread, kept: a vocabulary's scores (~200 KB) would otherwise be mapped
    // and unmapped by the allocator at every call.
    thread_local std::vector<float> score, scaled;
    thread_local CutScratch scratch;
    const bool own = seeds != nullptr && seeds[r] >= 0;
    const float* er = own ? nullptr : e + r * n;
    const RaceKey key = own ? race_key(seeds[r], r) : RaceKey{0, 0};
    const float tr = t == nullptr ? 1.0f : t[r];
    const T* lr = l + r * n;
    if (tr == 0.0f || !cut.cuts(r, n)) {
      out[r] = row_race(lr, er, key, n, tr, score);
      continue;
    }
    // NOTE: the logits divided as the sampler's torch div divides them, then cut and raced
    // at temperature 1 (an exact division): what the sampler's stages pick, step by step.
    scaled.resize(n);
    for (int64_t i = 0; i < n; ++i) scaled[i] = to_f(lr[i]) / tr;
    truncate_row(scaled.data(), n, cut.k(r, n), cut.p(r), cut.min(r), scratch);
    out[r] = row_race(scaled.data(), er, key, n, 1.0f, score);
  }
}

// Checks the optional per-row truncation settings of an op named `op` over `rows` rows.
Truncation truncation_args(const char* op, int64_t rows,
                           const std::optional<torch::Tensor>& top_k,
                           const std::optional<torch::Tensor>& top_p,
                           const std::optional<torch::Tensor>& min_p) {
  Truncation cut;
  if (top_k.has_value()) {
    TORCH_CHECK(top_k->scalar_type() == at::kLong && top_k->dim() == 1 &&
                    top_k->size(0) == rows && top_k->is_contiguous() && top_k->device().is_cpu(),
                op, ": top_k must be a contiguous int64 [", rows, "] CPU tensor");
    cut.top_k = top_k->data_ptr<int64_t>();
  }
  for (const auto* arg : {&top_p, &min_p}) {
    if (!arg->has_value()) continue;
    const auto& v = **arg;
    const char* name = arg == &top_p ? "top_p" : "min_p";
    TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 1 && v.size(0) == rows &&
                    v.is_contiguous() && v.device().is_cpu(),
                op, ": ", name, " must be a contiguous float32 [", rows, "] CPU tensor");
    const float* f = v.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(f[r] >= 0.0f && f[r] <= 1.0f, op, ": ", name, " must be in [0, 1], got ",
                  f[r], " in row ", r);
    }
    (arg == &top_p ? cut.top_p : cut.min_p) = f;
  }
  return cut;
}

void check_truncation(const char* op, int64_t rows, const std::optional<torch::Tensor>& top_k,
                      const std::optional<torch::Tensor>& top_p,
                      const std::optional<torch::Tensor>& min_p) {
  truncation_args(op, rows, top_k, top_p, min_p);
}

torch::Tensor truncate_rows(torch::Tensor x, std::optional<torch::Tensor> top_k,
                            std::optional<torch::Tensor> top_p,
                            std::optional<torch::Tensor> min_p) {
  check_float_rows(x, "truncate_rows");
  const int64_t rows = x.size(0), n = x.size(1);
  const Truncation cut = truncation_args("truncate_rows", rows, top_k, top_p, min_p);
  float* xp = x.data_ptr<float>();
#pragma omp parallel for if (rows * n >= 8 * kParallelGrain) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    thread_local CutScratch scratch;
    truncate_row(xp + r * n, n, cut.k(r, n), cut.p(r), cut.min(r), scratch);
  }
  return x;
}

torch::Tensor race_rows(torch::Tensor logits, std::optional<torch::Tensor> temperature,
                        std::optional<torch::Tensor> exps, std::optional<torch::Tensor> seeds,
                        std::optional<torch::Tensor> top_k, std::optional<torch::Tensor> top_p,
                        std::optional<torch::Tensor> min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "race_rows: logits must be a contiguous [rows, n] matrix with n > 0");
  const int64_t rows = logits.size(0);
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "race_rows: logits must be float32, bfloat16 or float16");
  const float* ep = nullptr;
  if (exps.has_value()) {
    TORCH_CHECK(exps->scalar_type() == at::kFloat && exps->sizes() == logits.sizes() &&
                    exps->is_contiguous(),
                "race_rows: exps must be contiguous float32 of the logits' shape");
    ep = exps->data_ptr<float>();
  }
  const int64_t* sp = nullptr;
  if (seeds.has_value()) {
    TORCH_CHECK(seeds->scalar_type() == at::kLong && seeds->dim() == 1 &&
                    seeds->size(0) == rows && seeds->is_contiguous(),
                "race_rows: seeds must be a contiguous int64 [rows]");
    sp = seeds->data_ptr<int64_t>();
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ep != nullptr || (sp != nullptr && sp[r] >= 0),
                "race_rows: row ", r, " has neither exps nor a seed (>= 0)");
  }
  const float* t = nullptr;
  if (temperature.has_value()) {
    TORCH_CHECK(temperature->scalar_type() == at::kFloat && temperature->dim() == 1 &&
                    temperature->size(0) == rows && temperature->is_contiguous(),
                "race_rows: temperature must be a contiguous float32 [rows]");
    t = temperature->data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(t[r] >= 0.0f && std::isfinite(t[r]),
                  "race_rows: temperature must be finite and non-negative, got ", t[r]);
    }
  }
  const Truncation cut = truncation_args("race_rows", rows, top_k, top_p, min_p);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1);
  if (dtype == at::kFloat) {
    race_rows_impl(logits.data_ptr<float>(), t, ep, sp, cut, rows, n, o);
  } else if (dtype == at::kBFloat16) {
    race_rows_impl(logits.data_ptr<at::BFloat16>(), t, ep, sp, cut, rows, n, o);
  } else {
    race_rows_impl(logits.data_ptr<at::Half>(), t, ep, sp, cut, rows, n, o);
  }
  return out;
}

}  // namespace pagoda_fused

std::vector<std::string> fused_ops_isa() {
#if defined(PAGODA_FUSED_AVX512)
  std::vector<std::string> isa{"avx512f", "avx512bw", "avx512vl"};
#if defined(__AVX512BF16__)
  isa.push_back("avx512_bf16");
#endif
  return isa;
#elif defined(PAGODA_FUSED_AVX2)
  return {"avx2", "fma", "f16c"};
#else
  return {};
#endif
}

// Defined in decoder_layer_cpu.cpp (the same extension): whole-layer calls built on these ops.
void register_decoder_layer(pybind11::module& m);

void register_fused_ops(pybind11::module& m) {
  register_decoder_layer(m);
  m.def("fused_add_rms_norm", &pagoda_fused::fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight (both in place)");
  m.def("rms_norm", &pagoda_fused::rms_norm, "rms_norm(x) * weight per row, a new tensor");
  m.def("rotary_and_cache", &pagoda_fused::rotary_and_cache,
        "Rotate q and k of a fused qkv buffer in place, then write k and v to the caches",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("positions"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slot_mapping"), pybind11::arg("num_heads"),
        pybind11::arg("num_kv_heads"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none());
  m.def("silu_and_mul", &pagoda_fused::silu_and_mul, "[gate | up] -> silu(gate) * up");
  m.def("argmax_rows", &pagoda_fused::argmax_rows,
        "int64 [rows]: each row's first maximum, as torch.argmax (NaN the maximum)");
  m.def("race_rows", &pagoda_fused::race_rows,
        "int64 [rows]: each row's token of the exponential race over softmax(logits / t) "
        "with the Exp(1) draws `exps`, or a row's own draws keyed by seeds[row] >= 0 "
        "(t 0: the first maximum; no t: 1), after truncate_rows' cut where top_k, top_p or "
        "min_p is given",
        pybind11::arg("logits"), pybind11::arg("temperature"), pybind11::arg("exps"),
        pybind11::arg("seeds") = pybind11::none(), pybind11::arg("top_k") = pybind11::none(),
        pybind11::arg("top_p") = pybind11::none(), pybind11::arg("min_p") = pybind11::none());
  m.def("penalize_rows", &pagoda_fused::penalize_rows,
        "in place, float32 rows x [rows, n]: each row's logit_bias entries added, then its "
        "repetition penalty on the `seen` tokens, then frequency * count + presence * "
        "(count > 0) taken off (each group optional); returns x",
        pybind11::arg("x"), pybind11::arg("repetition") = pybind11::none(),
        pybind11::arg("seen") = pybind11::none(), pybind11::arg("frequency") = pybind11::none(),
        pybind11::arg("presence") = pybind11::none(), pybind11::arg("counts") = pybind11::none(),
        pybind11::arg("bias_rows") = pybind11::none(),
        pybind11::arg("bias_ids") = pybind11::none(),
        pybind11::arg("bias_values") = pybind11::none());
  m.def("truncate_rows", &pagoda_fused::truncate_rows,
        "in place, each row of scaled logits x [rows, n] float32 cut (to -inf) by its "
        "min_p, then top_k, then top_p (each an optional per-row tensor); returns x",
        pybind11::arg("x"), pybind11::arg("top_k") = pybind11::none(),
        pybind11::arg("top_p") = pybind11::none(), pybind11::arg("min_p") = pybind11::none());
}
