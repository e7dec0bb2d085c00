// A Llama-family decoder layer's dense part, called once between two attention calls.
//
//   decoder_mlp(layer, attn, residual) -> x
//       x = o_proj(attn); (x, residual) = add_rms_norm(x, residual, post_norm)
//       x = down_proj(silu_and_mul(gate_up_proj(x)))
//   decoder_qkv(layer, x, cos, sin, positions, k_cache, v_cache, slot_mapping[, scales]) -> q, k, v
//       qkv = qkv_proj(x); rotary_and_cache(qkv, ...)   (x already normed)
//   decoder_mlp_qkv(layer, next, attn, residual, ...) -> the next layer's q, k, v
//       x = decoder_mlp(layer, attn, residual); (x, residual) = add_rms_norm(x, residual,
//       next.input_norm); decoder_qkv(next, x, ...)
//
// These are the kernels the Python layers call, in the same order on the same tensors (the
// GEMMs are mkldnn::_linear_pointwise on the oneDNN-packed weights, as
// quant/unquantized.py's packed_linear, or for a quantized projection (`QuantWeight`: the
// panel layout of ops/quant_layouts.py) the quant extension's q_linear, which
// ops/csrc/quant_cpu.cpp registers as the op pagoda_quant::q_linear, or q_linear_panels for
// the rows a GGUF layer's dense copy serves), so the result is bit
// for bit that of the Python path. What a call saves is the Python between the kernels: module calls, op dispatch and
// argument parsing, ~10 small calls per layer, which at one token per step cost as much as
// a third of the GEMMs' time. residual is updated in place.

#include "decode_attention_cpu.h"
#include "fused_ops_cpu.h"
#include "index_args_cpu.h"
#include "q_gemv_abi.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <optional>
#include <string_view>
#include <tuple>
#include <variant>
#include <vector>


namespace pagoda_layer {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>);

// x [T, K] @ W^T (+ b) on a oneDNN-packed weight: the op quant/unquantized.py calls.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& b) {
  // NOTE: found once; typed() checks the signature against the registered schema.
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<LinearFn>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(),
                 std::string_view(""));
}

// A quantized projection's panel layout (quant_layouts.BlockLayout): the q_linear arguments.
struct QuantWeight {
  torch::Tensor codes, scales, offsets;
  int64_t bits, block, group;
  bool zero_form;
  int64_t n;  // output features
  // The quant extension's GemvPlan of this layout (its address; 0: none): what the
  // one-region decode stack passes to pagoda_q_gemv_part (q_gemv_abi.h).
  int64_t plan = 0;
  // The layer's bf16 copy in q_linear_amx's panel layout (quant/gguf.py), read instead of
  // the codes by bf16 products of [dense_min_rows, dense_max_rows) rows through
  // pagoda_quant::q_linear_panels, as the Python layer's apply does.
  std::optional<torch::Tensor> dense;
  int64_t dense_min_rows = 0, dense_max_rows = 0;
};

// A projection's weight: oneDNN-packed [out, in], or quantized.
using Weight = std::variant<torch::Tensor, QuantWeight>;

using QLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, int64_t, int64_t, int64_t, bool, int64_t,
                             const std::optional<at::Tensor>&);

using PanelsFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                           const std::optional<at::Tensor>&);

// x [T, K] @ W^T (+ b), through the kernel the Python layers call for this weight.
at::Tensor project(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& b) {
  const auto* q = std::get_if<QuantWeight>(&w);
  if (q == nullptr) return packed_linear(x, std::get<torch::Tensor>(w), b);
  if (q->dense.has_value() && x.scalar_type() == at::kBFloat16) {
    const int64_t rows = x.numel() / x.size(-1);
    if (rows >= q->dense_min_rows && rows < q->dense_max_rows) {
      static const auto panels_op = c10::Dispatcher::singleton()
                                        .findSchemaOrThrow("pagoda_quant::q_linear_panels", "")
                                        .typed<PanelsFn>();
      return panels_op.call(x.reshape({-1, x.size(-1)}).contiguous(), *q->dense, q->n, b);
    }
  }
  // NOTE: looked up on first use: the quant extension is loaded before a QuantWeight exists.
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pagoda_quant::q_linear", "")
                             .typed<QLinearFn>();
  return op.call(x.reshape({-1, x.size(-1)}).contiguous(), q->codes, q->scales, q->offsets,
                 q->bits, q->block, q->group, q->zero_form, q->n, b);
}

struct DecoderLayer {
  torch::Tensor input_norm, post_norm;  // [hidden] RMSNorm weights
  Weight qkv_w, o_w, gate_up_w, down_w;  // [out, in]
  std::optional<torch::Tensor> qkv_b, o_b, gate_up_b, down_b;
  double eps;
  int64_t num_heads, num_kv_heads, head_dim;
};

using QKV = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;

QKV decoder_qkv(const DecoderLayer& l, const torch::Tensor& x, const torch::Tensor& cos,
                const torch::Tensor& sin, const torch::Tensor& positions,
                const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& slot_mapping, std::optional<torch::Tensor> k_scale,
                std::optional<torch::Tensor> v_scale) {
  const int64_t nq = l.num_heads, nqk = l.num_heads + l.num_kv_heads;
  auto qkv = project(x, l.qkv_w, l.qkv_b).view({x.size(0), nqk + l.num_kv_heads, l.head_dim});
  pagoda_fused::rotary_and_cache(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping,
                                 l.num_heads, l.num_kv_heads, k_scale, v_scale);
  return {qkv.slice(1, 0, nq), qkv.slice(1, nq, nqk), qkv.slice(1, nqk)};
}

torch::Tensor decoder_mlp(const DecoderLayer& l, const torch::Tensor& attn,
                          const torch::Tensor& residual) {
  auto x = project(attn, l.o_w, l.o_b);
  pagoda_fused::fused_add_rms_norm(x, residual, l.post_norm, l.eps);
  auto act = pagoda_fused::silu_and_mul(project(x, l.gate_up_w, l.gate_up_b));
  return project(act, l.down_w, l.down_b);
}

QKV decoder_mlp_qkv(const DecoderLayer& l, const DecoderLayer& next, const torch::Tensor& attn,
                    const torch::Tensor& residual, const torch::Tensor& cos,
                    const torch::Tensor& sin, const torch::Tensor& positions,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& slot_mapping, std::optional<torch::Tensor> k_scale,
                    std::optional<torch::Tensor> v_scale) {
  auto x = decoder_mlp(l, attn, residual);
  pagoda_fused::fused_add_rms_norm(x, residual, next.input_norm, next.eps);
  return decoder_qkv(next, x, cos, sin, positions, k_cache, v_cache, slot_mapping, k_scale,
                     v_scale);
}

// Every layer of a decode-only step (one query row per request) in one call, attention
// included: the layers' own calls (decoder_qkv, paged decode attention, decoder_mlp_qkv,
// decoder_mlp) in the order the Python stack makes them, so the result is bit for bit its
// result. What it saves is the Python between them: one attention-backend call per layer,
// and the OpenMP workers' sleep (a wake-up costs tens of microseconds on a VM) in that gap.
struct DecoderStack {
  std::vector<DecoderLayer> layers;
  std::vector<double> scales;     // per layer: the attention's softmax scale
  std::vector<int64_t> windows;   // per layer: its sliding window, -1: none
  PagodaGemvPart gemv = nullptr;  // the quant extension's single-row product, if given
  // Per layer, the float32 biases of qkv, o, gate_up and down (undefined: none), as
  // q_linear converts them on each call.
  std::vector<std::array<torch::Tensor, 4>> float_biases;
  bool one_region = false;  // one_region_stack can run it
};

// Whether one_region_stack can run a stack: every projection quantized with a plan, the
// norms bfloat16 and every layer of one shape (the region's buffers are sized once).
bool one_region_ok(const DecoderStack& s) {
  if (s.gemv == nullptr) return false;
  const DecoderLayer& l0 = s.layers[0];
  for (const auto& l : s.layers) {
    for (const Weight* w : {&l.qkv_w, &l.o_w, &l.gate_up_w, &l.down_w}) {
      const auto* q = std::get_if<QuantWeight>(w);
      if (q == nullptr || q->plan == 0) return false;
    }
    if (l.input_norm.scalar_type() != at::kBFloat16 ||
        l.post_norm.scalar_type() != at::kBFloat16 || l.num_heads != l0.num_heads ||
        l.num_kv_heads != l0.num_kv_heads || l.head_dim != l0.head_dim ||
        l.input_norm.size(0) != l0.input_norm.size(0) ||
        std::get<QuantWeight>(l.gate_up_w).n != std::get<QuantWeight>(l0.gate_up_w).n) {
      return false;
    }
  }
  const int64_t hidden = l0.input_norm.size(0), nh = l0.num_heads, nkv = l0.num_kv_heads,
                d = l0.head_dim, gu = std::get<QuantWeight>(l0.gate_up_w).n;
  return nh % nkv == 0 && d % 2 == 0 && gu % 2 == 0 &&
         std::get<QuantWeight>(l0.qkv_w).n == (nh + 2 * nkv) * d &&
         std::get<QuantWeight>(l0.o_w).n == hidden &&
         std::get<QuantWeight>(l0.down_w).n == hidden;
}

DecoderStack make_stack(std::vector<DecoderLayer> layers, std::vector<double> scales,
                        std::vector<int64_t> windows, int64_t gemv_fn) {
  TORCH_CHECK(!layers.empty() && scales.size() == layers.size() &&
                  windows.size() == layers.size(),
              "DecoderStack: one scale and one window per layer");
  DecoderStack s{std::move(layers), std::move(scales), std::move(windows),
                 reinterpret_cast<PagodaGemvPart>(gemv_fn), {}, false};
  for (const auto& l : s.layers) {
    std::array<torch::Tensor, 4> b;
    const std::optional<torch::Tensor>* src[4] = {&l.qkv_b, &l.o_b, &l.gate_up_b, &l.down_b};
    for (int j = 0; j < 4; ++j) {
      if (src[j]->has_value()) b[j] = (*src[j])->to(at::kFloat).contiguous();
    }
    s.float_biases.push_back(b);
  }
  s.one_region = one_region_ok(s);
  return s;
}

// False when a test turns the one-region path off, to compare it with the per-op calls.
std::atomic<bool> g_one_region{true};

// Entry j (2: k_scale, 3: v_scale) of a layer's cache (k, v[, k_scale, v_scale]), if any.
std::optional<torch::Tensor> cache_scale(const std::vector<torch::Tensor>& cache, size_t j) {
  if (cache.size() == 4) return cache[j];
  return std::nullopt;
}

const float* bias_ptr(const torch::Tensor& b) {
  return b.defined() ? b.data_ptr<float>() : nullptr;
}

// A single-token decode step of a quantized bf16 stack in one OpenMP region.
//
// The per-op calls of decoder_decode_stack open ~5 regions a layer, and between them the
// master thread alone runs the glue (dispatch, tensor set-up, the norms, the activation
// quantization) while the other threads wait. Here every thread runs the whole stack: each
// does the element-wise glue itself on private copies (the residual, the normed x, the
// activations: a few KiB, microseconds), takes its share of each projection's output tiles
// (pagoda_q_gemv_part: q_linear's single-row split) and of the kv heads (rotary, cache
// write and attention of its heads), with a barrier after each phase whose output the next
// phase reads whole. The kernels and their order per value are those of the per-op path,
// so the result is the same bits. Everything that can throw is checked before the region.
torch::Tensor one_region_stack(const DecoderStack& s, const torch::Tensor& x,
                               const torch::Tensor& residual, const torch::Tensor& cos,
                               const torch::Tensor& sin, const torch::Tensor& positions,
                               const std::vector<std::vector<torch::Tensor>>& kv,
                               const torch::Tensor& slot_mapping,
                               const torch::Tensor& block_tables,
                               const torch::Tensor& seq_lens) {
  const DecoderLayer& l0 = s.layers[0];
  const int64_t hidden = l0.input_norm.size(0), nh = l0.num_heads, nkv = l0.num_kv_heads,
                hd = l0.head_dim, gu_n = std::get<QuantWeight>(l0.gate_up_w).n,
                inter = gu_n / 2;
  const auto bf16 = at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == bf16 && residual.scalar_type() == bf16 && x.is_contiguous() &&
                  residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.size(1) == hidden,
              "decoder_decode_stack: x and residual must be contiguous bf16 [1, ", hidden, "]");
  TORCH_CHECK(cos.scalar_type() == bf16 && sin.scalar_type() == bf16 && cos.dim() == 2 &&
                  cos.size(1) == hd / 2 && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "decoder_decode_stack: cos and sin must be contiguous bf16 [P, D / 2]");
  TORCH_CHECK(positions.numel() == 1 && slot_mapping.numel() == 1,
              "decoder_decode_stack: one position and one slot for one token");
  const int64_t pos = pagoda_index::long_value(positions);
  const int64_t slot = pagoda_index::long_value(slot_mapping);
  TORCH_CHECK(pos >= 0 && pos < cos.size(0), "position ", pos, " out of range");

  auto opts = x.options();
  auto qkv = at::empty({(nh + 2 * nkv) * hd}, opts);
  auto attn = at::empty({1, nh, hd}, opts);
  auto y = at::empty({hidden}, opts);
  auto gu = at::empty({gu_n}, opts);
  auto out = at::empty({1, hidden}, opts);
  const auto q = qkv.narrow(0, 0, nh * hd).view({1, nh, hd});
  const size_t n = s.layers.size();
  std::vector<pagoda_fused::CacheDst> dst;
  std::vector<pagoda_decode::DecodeWork> work;
  for (size_t i = 0; i < n; ++i) {
    auto k_cache = kv[i][0], v_cache = kv[i][1];
    auto ks = cache_scale(kv[i], 2), vs = cache_scale(kv[i], 3);
    dst.push_back(pagoda_fused::cache_dst(qkv, k_cache, v_cache, ks, vs, nkv, hd));
    TORCH_CHECK(slot < k_cache.size(0) * k_cache.size(1), "slot ", slot, " out of range");
    work.push_back(pagoda_decode::decode_work(attn, q, k_cache, v_cache, block_tables,
                                              seq_lens, s.scales[i], s.windows[i], ks, vs));
  }

  const int threads = at::get_num_threads();
  // Per thread: the residual, the normed x and the SiLU * up activations.
  std::vector<at::BFloat16> priv(static_cast<size_t>(threads) * (2 * hidden + inter));
  auto* qkv_p = qkv.data_ptr<at::BFloat16>();
  auto* attn_p = attn.data_ptr<at::BFloat16>();
  auto* y_p = y.data_ptr<at::BFloat16>();
  auto* gu_p = gu.data_ptr<at::BFloat16>();
  auto* out_p = out.data_ptr<at::BFloat16>();
  const auto* cos_p = cos.data_ptr<at::BFloat16>() + pos * (hd / 2);
  const auto* sin_p = sin.data_ptr<at::BFloat16>() + pos * (hd / 2);
  const auto* x_p = x.data_ptr<at::BFloat16>();
  auto* res_p = residual.data_ptr<at::BFloat16>();
  const size_t row_bytes = hidden * sizeof(at::BFloat16);
  const PagodaGemvPart gemv = s.gemv;
  auto plan = [](const Weight& w) {
    return reinterpret_cast<const void*>(std::get<QuantWeight>(w).plan);
  };
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    at::BFloat16* rp = priv.data() + tid * (2 * hidden + inter);
    at::BFloat16* xp = rp + hidden;
    at::BFloat16* act = xp + hidden;
    std::memcpy(rp, res_p, row_bytes);
    // NOTE: x_p may be res_p, which only tid 0 writes, after the last barrier.
    pagoda_fused::rms_norm_row(x_p, xp, l0.input_norm.data_ptr<at::BFloat16>(), hidden,
                               static_cast<float>(l0.eps));
    const at::BFloat16* in = xp;  // the first layer's normed input
    for (size_t i = 0; i < n; ++i) {
      const DecoderLayer& l = s.layers[i];
      const auto& b = s.float_biases[i];
      gemv(plan(l.qkv_w), in, qkv_p, 1, bias_ptr(b[0]), tid, nth);
#pragma omp barrier
      const pagoda_decode::DecodeWork& wk = work[i];
      for (int64_t h = tid; h < nkv; h += nth) {
        pagoda_fused::rotary_cache_group(qkv_p, cos_p, sin_p, dst[i], slot, h, nh, nkv, hd);
        if (!wk.split) wk.run(h);  // item h: kv head h
      }
      if (wk.split) {
        // NOTE: a part of head h may run on another thread than h's rotary and cache write.
#pragma omp barrier
        for (int64_t it = tid; it < wk.items; it += nth) wk.run(it);
      }
#pragma omp barrier
      gemv(plan(l.o_w), attn_p, y_p, 1, bias_ptr(b[1]), tid, nth);
#pragma omp barrier
      std::memcpy(xp, y_p, row_bytes);
      pagoda_fused::add_rms_norm_row(xp, rp, l.post_norm.data_ptr<at::BFloat16>(), hidden,
                                     static_cast<float>(l.eps));
      gemv(plan(l.gate_up_w), xp, gu_p, 1, bias_ptr(b[2]), tid, nth);
#pragma omp barrier
      pagoda_fused::silu_and_mul_row(gu_p, act, inter);
      gemv(plan(l.down_w), act, y_p, 1, bias_ptr(b[3]), tid, nth);
#pragma omp barrier
      if (i + 1 < n) {
        const DecoderLayer& next = s.layers[i + 1];
        std::memcpy(xp, y_p, row_bytes);
        pagoda_fused::add_rms_norm_row(xp, rp, next.input_norm.data_ptr<at::BFloat16>(),
                                       hidden, static_cast<float>(next.eps));
        in = xp;
      }
    }
    if (tid == 0) {
      std::memcpy(out_p, y_p, row_bytes);
      std::memcpy(res_p, rp, row_bytes);
    }
  }
  return out;
}

// x: the stack's input [T, hidden], before the first layer's input norm (which runs here);
// residual [T, hidden]: x's values, updated in place (it may be x itself);
// kv[i]: layer i's (k_cache, v_cache[, k_scale, v_scale]); block_tables [T, M] and
// seq_lens [T] (request t's context after this step). Returns the last layer's output.
torch::Tensor decoder_decode_stack(const DecoderStack& s, const torch::Tensor& x,
                                   const torch::Tensor& residual, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& positions,
                                   const std::vector<std::vector<torch::Tensor>>& kv,
                                   const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens) {
  const size_t n = s.layers.size();
  TORCH_CHECK(kv.size() == n, "decoder_decode_stack: ", kv.size(), " KV caches for ", n,
              " layers");
  for (const auto& c : kv) {
    TORCH_CHECK(c.size() == 2 || c.size() == 4,
                "decoder_decode_stack: a layer's cache is (k, v) or (k, v, k_scale, v_scale)");
  }
  auto scale_of = [&](size_t i, size_t j) { return cache_scale(kv[i], j); };
  const int64_t t = x.size(0);
  if (s.one_region && t == 1 && x.scalar_type() == at::kBFloat16 && g_one_region) {
    return one_region_stack(s, x, residual, cos, sin, positions, kv, slot_mapping,
                            block_tables, seq_lens);
  }
  const DecoderLayer& l0 = s.layers[0];
  const auto normed = pagoda_fused::rms_norm(x, l0.input_norm, l0.eps);
  auto [q, k, v] = decoder_qkv(l0, normed, cos, sin, positions, kv[0][0], kv[0][1],
                               slot_mapping, scale_of(0, 2), scale_of(0, 3));
  for (size_t i = 0;; ++i) {
    const DecoderLayer& l = s.layers[i];
    auto qc = q.contiguous();
    auto out = at::empty_like(qc);
    pagoda_decode::decode_attention(out, qc, kv[i][0], kv[i][1], block_tables, seq_lens,
                                    s.scales[i], s.windows[i], scale_of(i, 2), scale_of(i, 3));
    auto attn = out.view({t, l.num_heads * l.head_dim});
    if (i + 1 == n) return decoder_mlp(l, attn, residual);
    std::tie(q, k, v) = decoder_mlp_qkv(l, s.layers[i + 1], attn, residual, cos, sin, positions,
                                        kv[i + 1][0], kv[i + 1][1], slot_mapping,
                                        scale_of(i + 1, 2), scale_of(i + 1, 3));
  }
}

using DequantRowsFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           int64_t, int64_t, bool, int64_t, const at::Tensor&);

// The rows of a token table for `ids` (int64 [B]), [B, hidden] in bf16: a dense table's
// rows as F.embedding copies them, or a quantized table's through the quant extension's
// dequant_rows (what quant_cpu.dequantize_rows calls for a lookup).
at::Tensor embed_rows(const Weight& table, const at::Tensor& ids, int64_t hidden) {
  const auto* q = std::get_if<QuantWeight>(&table);
  if (q == nullptr) return std::get<torch::Tensor>(table).index_select(0, ids);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pagoda_quant::dequant_rows", "")
                             .typed<DequantRowsFn>();
  auto out = at::empty({ids.size(0), hidden}, at::TensorOptions().dtype(at::kBFloat16));
  op.call(out, q->codes, q->scales, q->offsets, q->bits, q->group, q->zero_form, q->n, ids);
  return out;
}

// Up to `max_steps` decode steps of B requests in one call: per step the stack
// (decoder_decode_stack), the final add + RMSNorm, the head's product and each row's token
// (its first maximum; with `temperature` [B] float32, the exponential race of race_rows with
// step i's draws: exps[i] of `exps` [>= max_steps, B, V] float32, or for a row whose
// seeds[i][row] of `seeds` [>= max_steps, B] int64 is >= 0 the kernel's own draws from it;
// temperature 0 a greedy row; with top_k, top_p or min_p [B], the race over what their
// cut leaves; first, with penalties or a logit_bias, the logits as penalize_rows leaves
// them, its `seen` and `counts` [B, V] updated with each step's tokens in place), then
// the chosen tokens' embeddings are the next step's input. The same kernels on the same
// tensors as a step through the engine (the model's forward, compute_logits, the sampler,
// the embedding's lookup), so the same tokens; what a step saves is the engine's and the
// runner's host work, which at a few tokens a step runs on cold caches.
// x: the first tokens' embeddings [B, hidden] bf16 (the caller's lookup); pos0 [B] int64:
// their positions; block_table [B, M] int64: the requests' blocks, row b covering
// pos0[b] + max_steps - 1; stop_ids: tokens that end a request (after a step in which any
// row chose one, no step runs); interrupt: a uint8 [1] flag that another thread may raise
// while the call runs (the engine's, when a command arrives): no step starts after it is
// seen, so a new request waits for one step, not for the burst. Returns [steps, B], the
// tokens chosen, at least one step and at most max_steps, the last a step with a stop
// token, the max_steps-th or the one before the flag was seen.
torch::Tensor decoder_decode_burst(const DecoderStack& s, const torch::Tensor& x,
                                   const torch::Tensor& cos, const torch::Tensor& sin,
                                   const torch::Tensor& pos0,
                                   const std::vector<std::vector<torch::Tensor>>& kv,
                                   const torch::Tensor& block_table, int64_t block_size,
                                   const torch::Tensor& norm_w, double norm_eps,
                                   const Weight& head, const Weight& embed,
                                   const torch::Tensor& stop_ids, int64_t max_steps,
                                   const std::optional<torch::Tensor>& interrupt,
                                   const std::optional<torch::Tensor>& temperature,
                                   const std::optional<torch::Tensor>& exps,
                                   const std::optional<torch::Tensor>& seeds,
                                   const std::optional<torch::Tensor>& top_k,
                                   const std::optional<torch::Tensor>& top_p,
                                   const std::optional<torch::Tensor>& min_p,
                                   const std::optional<torch::Tensor>& repetition,
                                   const std::optional<torch::Tensor>& seen,
                                   const std::optional<torch::Tensor>& frequency,
                                   const std::optional<torch::Tensor>& presence,
                                   const std::optional<torch::Tensor>& counts,
                                   const std::optional<torch::Tensor>& bias_rows,
                                   const std::optional<torch::Tensor>& bias_ids,
                                   const std::optional<torch::Tensor>& bias_values) {
  const int64_t hidden = s.layers[0].input_norm.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= 1 &&
                  x.size(1) == hidden,
              "decoder_decode_burst: x must be bf16 [B, ", hidden, "]");
  const int64_t rows = x.size(0);
  TORCH_CHECK(pos0.scalar_type() == at::kLong && pos0.dim() == 1 && pos0.size(0) == rows &&
                  pos0.is_contiguous(),
              "decoder_decode_burst: pos0 must be a contiguous int64 [", rows, "]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.size(0) == rows && block_table.is_contiguous(),
              "decoder_decode_burst: block_table must be a contiguous int64 [", rows, ", M]");
  const int64_t* p0 = pos0.data_ptr<int64_t>();
  const int64_t width = block_table.size(1);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(max_steps >= 1 && p0[b] >= 0 && block_size >= 1, "decoder_decode_burst: ",
                max_steps, " steps from position ", p0[b], " with blocks of ", block_size);
    TORCH_CHECK((p0[b] + max_steps - 1) / block_size < width, "decoder_decode_burst: ",
                width, " blocks of ", block_size, " do not hold position ",
                p0[b] + max_steps - 1);
  }
  TORCH_CHECK(stop_ids.scalar_type() == at::kLong && stop_ids.dim() == 1 &&
                  stop_ids.is_contiguous(),
              "decoder_decode_burst: stop_ids must be a contiguous int64 [S]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == hidden,
              "decoder_decode_burst: the final norm's weight must be [", hidden, "]");
  TORCH_CHECK(!interrupt.has_value() ||
                  (interrupt->scalar_type() == at::kByte && interrupt->numel() == 1 &&
                   interrupt->device().is_cpu()),
              "decoder_decode_burst: interrupt must be a uint8 [1] CPU tensor");
  TORCH_CHECK(temperature.has_value() == (exps.has_value() || seeds.has_value()),
              "decoder_decode_burst: temperature comes with exps or seeds");
  TORCH_CHECK(temperature.has_value() ||
                  !(top_k.has_value() || top_p.has_value() || min_p.has_value()),
              "decoder_decode_burst: top_k, top_p and min_p come with a temperature");
  pagoda_fused::check_truncation("decoder_decode_burst", rows, top_k, top_p, min_p);
  if (seeds.has_value()) {
    TORCH_CHECK(seeds->scalar_type() == at::kLong && seeds->dim() == 2 &&
                    seeds->size(0) >= max_steps && seeds->size(1) == rows &&
                    seeds->is_contiguous(),
                "decoder_decode_burst: seeds must be contiguous int64 [>= ", max_steps, ", ",
                rows, "]");
  }
  if (exps.has_value()) {
    TORCH_CHECK(exps->scalar_type() == at::kFloat && exps->dim() == 3 &&
                    exps->size(0) >= max_steps && exps->size(1) == rows &&
                    exps->is_contiguous(),
                "decoder_decode_burst: exps must be contiguous float32 [>= ", max_steps, ", ",
                rows, ", V]");
  }
  // NOTE: read with an atomic load: another thread writes the byte while this call runs.
  const uint8_t* flag = interrupt.has_value() ? interrupt->data_ptr<uint8_t>() : nullptr;
  if (const auto* dense = std::get_if<torch::Tensor>(&embed)) {
    TORCH_CHECK(dense->scalar_type() == at::kBFloat16 && dense->dim() == 2 &&
                    dense->size(1) == hidden,
                "decoder_decode_burst: a dense token table must be bf16 [V, ", hidden, "]");
  }
  const auto longs = at::TensorOptions().dtype(at::kLong);
  auto positions = at::empty({rows}, longs), slots = at::empty({rows}, longs),
       seq_lens = at::empty({rows}, longs);
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* stops = stop_ids.data_ptr<int64_t>();
  const int64_t num_stops = stop_ids.size(0);
  const bool penalized = repetition.has_value() || frequency.has_value() ||
                         bias_rows.has_value();
  TORCH_CHECK(!(seen.has_value() && !seen->is_contiguous()) &&
                  !(counts.has_value() && !counts->is_contiguous()),
              "decoder_decode_burst: seen and counts must be contiguous");
  bool* seen_p = repetition.has_value() && seen.has_value() ? seen->data_ptr<bool>() : nullptr;
  float* counts_p =
      frequency.has_value() && counts.has_value() ? counts->data_ptr<float>() : nullptr;
  std::vector<int64_t> tokens;
  auto residual = x.clone();  // NOTE: the stack's input, which it updates as the residual
  int64_t steps = 0;
  for (int64_t i = 0; i < max_steps; ++i) {
    for (int64_t b = 0; b < rows; ++b) {
      pos[b] = p0[b] + i;
      slot[b] = table[b * width + pos[b] / block_size] * block_size + pos[b] % block_size;
      lens[b] = pos[b] + 1;
    }
    auto out = decoder_decode_stack(s, residual, residual, cos, sin, positions, kv, slots,
                                    block_table, seq_lens);
    pagoda_fused::fused_add_rms_norm(out, residual, norm_w, norm_eps);
    auto logits = project(out, head, std::nullopt);
    if (penalized) {
      logits = logits.to(at::kFloat).contiguous();
      pagoda_fused::penalize_rows(logits, repetition, seen, frequency, presence, counts,
                                  bias_rows, bias_ids, bias_values);
    }
    const auto chosen =
        temperature.has_value()
            ? pagoda_fused::race_rows(
                  logits, temperature,
                  exps.has_value() ? std::optional<torch::Tensor>(exps->select(0, i))
                                   : std::nullopt,
                  seeds.has_value() ? std::optional<torch::Tensor>(seeds->select(0, i))
                                    : std::nullopt,
                  top_k, top_p, min_p)
            : pagoda_fused::argmax_rows(logits);
    const int64_t* c = chosen.data_ptr<int64_t>();
    bool stop = false;
    for (int64_t b = 0; b < rows; ++b) {
      tokens.push_back(c[b]);
      // NOTE: the next step's penalties see this token (penalize_rows checked the shapes).
      if (seen_p != nullptr) seen_p[b * logits.size(1) + c[b]] = true;
      if (counts_p != nullptr) counts_p[b * logits.size(1) + c[b]] += 1.0f;
      stop = stop || std::find(stops, stops + num_stops, c[b]) != stops + num_stops;
    }
    ++steps;
    if (stop) break;
    if (flag != nullptr && __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0) break;
    if (i + 1 < max_steps) residual = embed_rows(embed, chosen, hidden);
  }
  return torch::tensor(tokens, longs).view({steps, rows});
}

DecoderLayer make_layer(torch::Tensor input_norm, torch::Tensor post_norm, Weight qkv_w,
                        Weight o_w, Weight gate_up_w, Weight down_w,
                        std::optional<torch::Tensor> qkv_b, std::optional<torch::Tensor> o_b,
                        std::optional<torch::Tensor> gate_up_b,
                        std::optional<torch::Tensor> down_b, double eps, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim) {
  for (const auto* w : {&qkv_w, &o_w, &gate_up_w, &down_w}) {
    const auto* dense = std::get_if<torch::Tensor>(w);
    TORCH_CHECK(dense == nullptr || dense->is_mkldnn(),
                "DecoderLayer: the projection weights must be oneDNN-packed or QuantWeight");
  }
  TORCH_CHECK(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes(),
              "DecoderLayer: the norm weights must be [hidden]");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "DecoderLayer: head counts and head_dim must be positive");
  return DecoderLayer{input_norm, post_norm, qkv_w, o_w, gate_up_w, down_w, qkv_b, o_b,
                      gate_up_b, down_b, eps, num_heads, num_kv_heads, head_dim};
}

}  // namespace pagoda_layer

void register_decoder_layer(pybind11::module& m) {
  namespace py = pybind11;
  using pagoda_layer::DecoderLayer;
  using pagoda_layer::QuantWeight;
  py::class_<QuantWeight>(m, "QuantWeight",
                          "A quantized projection's panel layout (ops/quant_layouts.py)")
      .def(py::init([](torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                       int64_t bits, int64_t block, int64_t group, bool zero_form, int64_t n,
                       int64_t plan, std::optional<torch::Tensor> dense,
                       int64_t dense_min_rows, int64_t dense_max_rows) {
             TORCH_CHECK(!dense.has_value() || dense_min_rows < dense_max_rows,
                         "QuantWeight: a dense copy needs rows [dense_min_rows, "
                         "dense_max_rows) to serve");
             return QuantWeight{codes, scales, offsets, bits, block, group, zero_form, n,
                                plan, dense, dense_min_rows, dense_max_rows};
           }),
           py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
           py::arg("block"), py::arg("group"), py::arg("zero_form"), py::arg("n"),
           py::arg("plan") = 0, py::arg("dense") = py::none(), py::arg("dense_min_rows") = 0,
           py::arg("dense_max_rows") = 0);
  py::class_<DecoderLayer>(m, "DecoderLayer",
                           "One decoder layer's norm weights and projections")
      .def(py::init(&pagoda_layer::make_layer), py::arg("input_norm"), py::arg("post_norm"),
           py::arg("qkv_w"), py::arg("o_w"), py::arg("gate_up_w"), py::arg("down_w"),
           py::arg("qkv_b"), py::arg("o_b"), py::arg("gate_up_b"), py::arg("down_b"),
           py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"));
  // NOTE: the GIL is released as ATen's own ops release it: a prefill layer's GEMMs take
  // tens of ms, which a server's HTTP thread must not wait on.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decoder_qkv", &pagoda_layer::decoder_qkv, release(),
        "qkv_proj of a normed x, then rotary + KV cache write; returns q, k, v views");
  m.def("decoder_mlp", &pagoda_layer::decoder_mlp, release(),
        "o_proj, add + post-attention RMSNorm (residual in place), gate_up, SiLU*mul, down");
  m.def("decoder_mlp_qkv", &pagoda_layer::decoder_mlp_qkv, release(),
        "decoder_mlp of one layer, then the next layer's add + RMSNorm and decoder_qkv");
  py::class_<pagoda_layer::DecoderStack>(m, "DecoderStack",
                                         "Every layer of a model with its attention's scale and window")
      .def(py::init(&pagoda_layer::make_stack), py::arg("layers"), py::arg("scales"),
           py::arg("windows"), py::arg("gemv_fn") = 0)
      .def_property_readonly("one_region",
                             [](const pagoda_layer::DecoderStack& s) { return s.one_region; });
  m.def("set_one_region",
        [](bool enable) { return pagoda_layer::g_one_region.exchange(enable); },
        "turns the one-region single-token decode stack on or off; returns the old setting");
  m.def("decoder_decode_stack", &pagoda_layer::decoder_decode_stack, release(),
        "a decode-only step's layers, attention included, in one call; returns the last "
        "layer's output (residual updated in place)");
  m.def("decoder_decode_burst", &pagoda_layer::decoder_decode_burst, release(),
        "up to max_steps decode steps of B requests (stack, final norm, head, argmax or "
        "the race with the drawn exps over what the truncation leaves, the next tokens' "
        "embeddings), none started once `interrupt` is raised or after a stop token; "
        "returns the tokens chosen [steps, B]",
        py::arg("stack"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("pos0"),
        py::arg("kv"), py::arg("block_table"), py::arg("block_size"), py::arg("norm_w"),
        py::arg("norm_eps"), py::arg("head"), py::arg("embed"), py::arg("stop_ids"),
        py::arg("max_steps"), py::arg("interrupt") = py::none(),
        py::arg("temperature") = py::none(), py::arg("exps") = py::none(),
        py::arg("seeds") = py::none(), py::arg("top_k") = py::none(),
        py::arg("top_p") = py::none(), py::arg("min_p") = py::none(),
        py::arg("repetition") = py::none(), py::arg("seen") = py::none(),
        py::arg("frequency") = py::none(), py::arg("presence") = py::none(),
        py::arg("counts") = py::none(), py::arg("bias_rows") = py::none(),
        py::arg("bias_ids") = py::none(), py::arg("bias_values") = py::none());
}
