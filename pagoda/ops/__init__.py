"""The ops layers and attention backends call, each dispatched per device (registry.py)
with a plain PyTorch reference (reference.py) that runs on any device.

  rms_norm(x, weight, eps)                        -> normed x
  fused_add_rms_norm(x, residual, weight, eps)    -> (normed, x + residual); may reuse storage
  silu_and_mul(x)                                 -> silu(gate) * up of x = [gate | up]
  argmax_rows(x)                                  -> int64 [rows]: each row's first maximum
                                                     (the sampler's greedy pick)
  race_rows(logits, temperature, exps, seeds,     -> int64 [rows]: each row's token of the
            top_k=None, top_p=None, min_p=None)      exponential race (the sampler's random
                                                     pick; temperature 0: greedy) with the
                                                     draws exps, or a row's own from its seed,
                                                     over what truncate_rows leaves
  truncate_rows(x, top_k, top_p, min_p)           -> x with each row's min-p, top-k, top-p cut
                                                     to -inf (in place where it can)
  penalize_rows(x, repetition, seen, frequency,   -> x (in place) with each row's logit_bias
                presence, counts, bias_rows,         added, then its repetition, frequency
                bias_ids, bias_values)               and presence penalties
  rotary_and_cache(qkv, cos, sin, positions,      rotates q, k of qkv in place and writes
                   k_cache, v_cache, slot_mapping, k, v into their slots
                   num_heads, num_kv_heads)
  write_kv(k, v, k_cache, v_cache, slot_mapping)  writes k, v into their slots
  paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                  sliding_window=None, max_seq_len=None, k_scale=None, v_scale=None,
                  q_sink=None, num_sink_tokens=0) -> [B, H, D]; q_sink: attention sinks'
                  query for positions [0, num_sink_tokens) (attention/sinks.py)
  paged_prefill_attention(q, k_cache, v_cache, block_tables, query_starts, query_lens,
                  seq_lens, scale, sliding_window=None) -> [T, H, D]: several requests'
                  query rows, each causal over its paged context
The cache ops take a quantized cache's scales (k_scale, v_scale) as trailing arguments
(kv_quant.py: int8 / fp8 codes, a float32 scale per token and kv head).

The quantized-weight linears (wq_linear, int8_linear, fp8_linear, gguf_linear) and their
weight objects are in wquant.py. `decoder_layers_for(x)` gives a decoder layer's dense part
as whole-layer calls where they run (models/fused_decoder.py uses them).

Kernels per device: CPU -> the C++ kernels (cpu.py) where built and the dtype allows;
CUDA -> the reference for now.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from pagoda.ops import cpu, fp8_cuda, quant_cpu, reference, wquant
from pagoda.ops.reference import apply_rotary, gather_blocks, gather_kv
from pagoda.ops.registry import OPS, Kernel, Op, define_op

rms_norm = define_op("rms_norm", reference.rms_norm)
fused_add_rms_norm = define_op("fused_add_rms_norm", reference.fused_add_rms_norm)
silu_and_mul = define_op("silu_and_mul", reference.silu_and_mul)
argmax_rows = define_op("argmax_rows", reference.argmax_rows)
race_rows = define_op("race_rows", reference.race_rows)
truncate_rows = define_op("truncate_rows", reference.truncate_rows)
penalize_rows = define_op("penalize_rows", reference.penalize_rows)
rotary_and_cache = define_op("rotary_and_cache", reference.rotary_and_cache)
write_kv = define_op("write_kv", reference.write_kv)
paged_attention = define_op("paged_attention", reference.paged_attention)
paged_prefill_attention = define_op("paged_prefill_attention", reference.paged_prefill_attention)
cpu.register()
fp8_cuda.register()
quant_cpu.register()


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """This module when x's device has a rotary_and_cache kernel for x's dtype (so a caller
    takes the one-kernel path: rotate in place and write the cache), else None (the caller
    composes apply_rotary and the backend's cache write)."""
    return sys.modules[__name__] if rotary_and_cache.kernel_for(x) is not None else None


def decoder_layers_for(x: torch.Tensor) -> ModuleType | None:
    """The whole-layer kernels (`cpu.decoder_layers`) for activations like x, or None: the
    caller runs its layers op by op (the reference composition)."""
    return cpu.decoder_layers(x) if x.device.type == "cpu" else None


def prefill_attention_on_amx() -> bool:
    """Whether bf16 prefill attention's CPU kernel runs on AMX tiles in this process
    (cpu_kernels.configure_prefill_amx)."""
    from pagoda.ops import cpu_kernels

    return cpu_kernels.prefill_amx_enabled()


__all__ = [
    "OPS",
    "Kernel",
    "Op",
    "apply_rotary",
    "argmax_rows",
    "decoder_layers_for",
    "fused_add_rms_norm",
    "fused_ops_for",
    "gather_blocks",
    "gather_kv",
    "paged_attention",
    "paged_prefill_attention",
    "penalize_rows",
    "prefill_attention_on_amx",
    "race_rows",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
    "truncate_rows",
    "wquant",
    "write_kv",
]
