// The fused element-wise ops of fused_ops_cpu.cpp, for the other sources of the extension.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace pagoda_fused {

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps);

void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                      torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      std::optional<torch::Tensor> k_scale,
                      std::optional<torch::Tensor> v_scale);

torch::Tensor silu_and_mul(torch::Tensor x);

}  // namespace pagoda_fused
