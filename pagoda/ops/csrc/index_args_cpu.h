// The int64 index tensors the kernels take (positions, slots, block tables, lengths), read
// without a dispatcher call when they already are int64 and contiguous, as the runner
// always passes them: `t.to(at::kLong)` goes through the dispatcher even when it returns t,
// and the decode stack prepares every layer's attention each step (30 layers: 60 calls, all
// on a cache that the step's weight stream has just flushed).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace pagoda_index {

// t as a contiguous int64 tensor: t itself when it already is one, else a converted copy.
inline at::Tensor as_long(const at::Tensor& t) {
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return t;
  return t.to(at::kLong).contiguous();
}

// The one value of a one-element integer tensor on the CPU, as int64.
inline int64_t long_value(const at::Tensor& t) {
  TORCH_CHECK(t.numel() == 1, "expected one value, got ", t.numel());
  if (t.scalar_type() == at::kLong && t.device().is_cpu()) return *t.data_ptr<int64_t>();
  return t.to(at::kLong).item<int64_t>();
}

}  // namespace pagoda_index
