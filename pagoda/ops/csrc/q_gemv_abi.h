// The one call the two CPU extensions share without linking to each other: a single
// activation row times a quantized weight, one thread's share of it.
//
// quant_cpu.cpp defines it (with the weight's `GemvPlan`, a Python object that holds the
// panel layout's tensors); decoder_layer_cpu.cpp's one-region decode stack calls it from
// inside its own OpenMP region, every thread of the team once per projection, and gets it
// through Python as two addresses (the plan's and the function's).
#pragma once

#include <cstdint>

extern "C" {
// y = x @ W^T (+ bias) for the tiles of thread `tid` of `nth` (q_linear's single-row split,
// so the same bits as q_linear): x [1, K] and y [1, N] bfloat16 when `bf16`, else float32;
// bias float32 [N] or null. Each calling thread quantizes x itself (a thread-local buffer):
// no thread waits on another inside the call.
typedef void (*PagodaGemvPart)(const void* plan, const void* x, void* y, int bf16,
                               const float* bias, int tid, int nth);
}
