// The fused element-wise ops of fused_ops_cpu.cpp, for the other sources of the extension.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace pagoda_fused {

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                      torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      std::optional<torch::Tensor> k_scale,
                      std::optional<torch::Tensor> v_scale);

torch::Tensor silu_and_mul(torch::Tensor x);

// Each row's first maximum (int64 [rows]): the greedy token of a row of logits.
torch::Tensor argmax_rows(torch::Tensor x);

// Each row's token of the exponential race over softmax(logits / temperature) with the
// Exp(1) draws `exps` [rows, n], or for a row whose seeds[row] (int64 [rows]) is >= 0 with
// draws made in the kernel from that seed (temperature 0: the first maximum; none: 1).
// With top_k (int64 [rows]), top_p or min_p (float32 [rows]): the race over what
// truncate_rows leaves of logits / temperature.
torch::Tensor race_rows(torch::Tensor logits, std::optional<torch::Tensor> temperature,
                        std::optional<torch::Tensor> exps, std::optional<torch::Tensor> seeds,
                        std::optional<torch::Tensor> top_k = std::nullopt,
                        std::optional<torch::Tensor> top_p = std::nullopt,
                        std::optional<torch::Tensor> min_p = std::nullopt);

// In place: float32 rows x [rows, n] with each row's logit_bias entries (bias_rows, bias_ids
// int64 [E], bias_values float32 [E]) added, then its repetition penalty (float32 [rows])
// on the tokens `seen` (bool [rows, n]), then frequency * count + presence * (count > 0)
// (float32 [rows] each; counts float32 [rows, n]) taken off (layers/sampler.py's
// processing before the temperature). Returns x.
torch::Tensor penalize_rows(torch::Tensor x, std::optional<torch::Tensor> repetition,
                            std::optional<torch::Tensor> seen,
                            std::optional<torch::Tensor> frequency,
                            std::optional<torch::Tensor> presence,
                            std::optional<torch::Tensor> counts,
                            std::optional<torch::Tensor> bias_rows,
                            std::optional<torch::Tensor> bias_ids,
                            std::optional<torch::Tensor> bias_values);

// Refuses top_k (int64 [rows]), top_p or min_p (float32 [rows], in [0, 1]) as truncate_rows
// and race_rows would, with errors named after `op`.
void check_truncation(const char* op, int64_t rows, const std::optional<torch::Tensor>& top_k,
                      const std::optional<torch::Tensor>& top_p,
                      const std::optional<torch::Tensor>& min_p);

// In place: each row of scaled logits x [rows, n] float32 with the tokens its min_p, then
// top_k, then top_p cut set to -inf (layers/sampler.py's truncation). Returns x.
torch::Tensor truncate_rows(torch::Tensor x, std::optional<torch::Tensor> top_k,
                            std::optional<torch::Tensor> top_p,
                            std::optional<torch::Tensor> min_p);

// Where rotary_and_cache writes: plain caches of T, or codes (int8 / fp8 bits) and scales.
struct CacheDst {
  void* k;
  void* v;
  float* k_scale = nullptr;  // quantized only: [N * bs * Hk]
  float* v_scale = nullptr;
  c10::ScalarType dtype;
};

// rotary_and_cache's checks of the caches ([N, bs, Hk, D], contiguous, qkv's dtype or
// quantized with their scales), and where it writes.
CacheDst cache_dst(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   std::optional<torch::Tensor>& k_scale, std::optional<torch::Tensor>& v_scale,
                   int64_t num_kv_heads, int64_t head_dim);

// One token row of the ops above on the calling thread, with no checks and no parallel
// region: the one-region decode stack (decoder_layer_cpu.cpp) checks its arguments before
// its OpenMP region and calls these inside it. The same arithmetic, so the same bits.
void add_rms_norm_row(at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* weight,
                      int64_t hidden, float eps);
void rms_norm_row(const at::BFloat16* x, at::BFloat16* out, const at::BFloat16* weight,
                  int64_t hidden, float eps);
void silu_and_mul_row(const at::BFloat16* x, at::BFloat16* out, int64_t inter);
// Rotary on query heads [h * G, (h + 1) * G) and key head h of one token's qkv row (cos and
// sin: its position's rows), then its k and v head h into cache slot `slot` (none if < 0).
void rotary_cache_group(at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin,
                        const CacheDst& dst, int64_t slot, int64_t h, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim);

}  // namespace pagoda_fused
