// Decode attention for the extension's other sources (decoder_layer_cpu.cpp): defined in
// paged_attention_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace pagoda_decode {

// paged_decode_attention without attention sinks.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                      double scale, int64_t sliding_window, std::optional<torch::Tensor> k_scale,
                      std::optional<torch::Tensor> v_scale);

// The same call prepared (its arguments checked) for a caller's OpenMP region, as `items`
// work items: run(i) runs item i on the calling thread, without throwing. Unsplit, item
// b * Hk + h is request b's kv head h; with `split` (some range split into parts, as the
// kernel's for_each_item does), every item may read any kv head's query and newest cache
// row, so all must be written before the first item runs; the last part of a head merges it.
struct DecodeWork {
  std::function<void(int64_t item)> run;
  int64_t items = 0;
  bool split = false;
};

DecodeWork decode_work(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                       double scale, int64_t sliding_window, std::optional<torch::Tensor> k_scale,
                       std::optional<torch::Tensor> v_scale);

}  // namespace pagoda_decode
