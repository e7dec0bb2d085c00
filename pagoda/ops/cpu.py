"""The C++ CPU kernels (csrc/) as registered kernels of the ops.

Which calls they take: the fused element-wise ops in bf16/fp16 only (float32 keeps the
reference, PyTorch's ops, the path that matches transformers bit for bit) on a CPU whose
AVX-512 F/BW/VL or AVX2 + FMA + F16C vector path was built; paged attention with a float32/bf16 q on any CPU the
extension builds on (decode rows: one query row at a time; prefill rows: tiles of query rows,
AVX-512 and head dims 32/64/96/128/256 only). Both also take quantized caches (int8 / fp8
codes with their scales, kv_quant.py), which they write and read natively. Anything else, and `PAGODA_DISABLE_CPU_KERNELS=1`, runs the reference.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from pagoda.ops import cpu_kernels
from pagoda.ops.kv_quant import CODE_MAX
from pagoda.ops.registry import OPS, Kernel

LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
_ATTENTION_DTYPES = frozenset({torch.float32, torch.bfloat16})
_ARGMAX_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_CACHE_DTYPES = _ATTENTION_DTYPES | frozenset(CODE_MAX)


def _fused_add_rms_norm(
    ext: ModuleType, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ext.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def _rms_norm(ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ext.rms_norm(x, weight, eps)


def _rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, _eps: float) -> bool:
    # NOTE: rows of the activations' dtype: the decoder's norms (the kernel checks the rest).
    return x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype


def _add_rms_norm_supports(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, _eps: float
) -> bool:
    # NOTE: the kernel checks the rest (shapes, weight layout) with a clear error.
    return (
        x.dim() == 2
        and x.is_contiguous()
        and residual.is_contiguous()
        and residual.dtype == x.dtype
        and weight.dtype == x.dtype
    )


def _silu_and_mul(ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
    return ext.silu_and_mul(x)


def _argmax_rows(ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
    return ext.argmax_rows(x)


def _argmax_supports(x: torch.Tensor) -> bool:
    return _matrix_contiguous(x) and x.shape[1] > 0


def _race_rows(ext: ModuleType, *args: torch.Tensor | None) -> torch.Tensor:
    return ext.race_rows(*args)


def _race_supports(logits: torch.Tensor, temperature: torch.Tensor | None,
                   exps: torch.Tensor | None, *_rest: torch.Tensor | None) -> bool:
    # NOTE: the kernel checks the shapes and dtypes itself (a clear error, not a fallback).
    return _argmax_supports(logits) and (exps is None or exps.device.type == "cpu")


def _truncate_rows(ext: ModuleType, *args: torch.Tensor | None) -> torch.Tensor:
    return ext.truncate_rows(*args)


def _truncate_supports(x: torch.Tensor, *cut: torch.Tensor | None) -> bool:
    return _argmax_supports(x) and all(c is None or c.device.type == "cpu" for c in cut)


def _penalize_rows(ext: ModuleType, *args: torch.Tensor | None) -> torch.Tensor:
    return ext.penalize_rows(*args)


def _penalize_supports(x: torch.Tensor, *tables: torch.Tensor | None) -> bool:
    # NOTE: the kernel checks shapes and dtypes itself (a clear error, not a fallback).
    return _matrix_contiguous(x) and all(t is None or t.device.type == "cpu" for t in tables)


def _rotary_and_cache(ext: ModuleType, *args) -> None:
    ext.rotary_and_cache(*args)


def _rotary_supports(qkv, cos, sin, positions, k_cache, v_cache, *_rest) -> bool:
    # NOTE: the kernel checks shapes and ranges itself (a clear error, not a fallback).
    return (
        cos.dtype == qkv.dtype
        and (k_cache.dtype == qkv.dtype or k_cache.dtype in CODE_MAX)
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _paged_attention(
    ext: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,
    num_sink_tokens: int = 0,
) -> torch.Tensor:
    q = q.contiguous()
    out = torch.empty_like(q)
    window = -1 if sliding_window is None else int(sliding_window)
    if q_sink is not None:
        q_sink = q_sink.contiguous()
    ext.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, float(scale), window, k_scale, v_scale,
        q_sink, int(num_sink_tokens),
    )
    return out


def _attention_supports(q, k_cache, v_cache, *_rest) -> bool:
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in _CACHE_DTYPES
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[1] % k_cache.shape[2] == 0
    )


# The head dims the tiled prefill kernel is compiled for (others: the decode kernel's rows).
PREFILL_HEAD_DIMS = frozenset({32, 64, 96, 128, 256})


def _paged_prefill_attention(
    ext: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    q = q.contiguous()
    out = torch.empty_like(q)  # NOTE: the op leaves rows of no request unspecified
    window = -1 if sliding_window is None else int(sliding_window)
    ext.paged_prefill_attention(
        out, q, k_cache, v_cache, block_tables, query_starts, query_lens, seq_lens,
        float(scale), window, k_scale, v_scale,
    )
    return out


def _prefill_supports(q, k_cache, v_cache, *_rest) -> bool:
    return _attention_supports(q, k_cache, v_cache) and q.shape[2] in PREFILL_HEAD_DIMS


def _matrix_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_contiguous()


def fused_layers_disabled() -> bool:
    return os.environ.get("PAGODA_DISABLE_FUSED_LAYERS", "0") not in ("", "0")


def decoder_layers(x: torch.Tensor) -> ModuleType | None:
    """The extension, for its whole-layer calls (`DecoderLayer`, `decoder_qkv`,
    `decoder_mlp`, `decoder_mlp_qkv`: csrc/decoder_layer_cpu.cpp), where they may run for
    activations like x: a CPU tensor in bf16/fp16, the fused ops' kernels allowed on this
    CPU, `PAGODA_DISABLE_FUSED_LAYERS` unset; else None."""
    if x.device.type != "cpu" or x.dtype not in LOW_PRECISION or fused_layers_disabled():
        return None
    ext = cpu_kernels.kernel_for("fused_ops")
    return ext if ext is not None and hasattr(ext, "DecoderLayer") else None


def register() -> None:
    fused = functools.partial(cpu_kernels.kernel_for, "fused_ops")
    attention = functools.partial(cpu_kernels.kernel_for, "paged_attention")
    # NOTE: the same arithmetic as fused_add_rms_norm's (and the decode stack's first norm).
    OPS["rms_norm"].register(
        "cpu", Kernel("cpp", _rms_norm, LOW_PRECISION, fused, _rms_norm_supports)
    )
    OPS["fused_add_rms_norm"].register(
        "cpu", Kernel("cpp", _fused_add_rms_norm, LOW_PRECISION, fused, _add_rms_norm_supports)
    )
    OPS["silu_and_mul"].register(
        "cpu", Kernel("cpp", _silu_and_mul, LOW_PRECISION, fused, _matrix_contiguous)
    )
    OPS["argmax_rows"].register(
        "cpu", Kernel("cpp", _argmax_rows, _ARGMAX_DTYPES, fused, _argmax_supports)
    )
    OPS["race_rows"].register(
        "cpu", Kernel("cpp", _race_rows, _ARGMAX_DTYPES, fused, _race_supports)
    )
    OPS["truncate_rows"].register(
        "cpu", Kernel("cpp", _truncate_rows, frozenset({torch.float32}), fused, _truncate_supports)
    )
    OPS["penalize_rows"].register(
        "cpu", Kernel("cpp", _penalize_rows, frozenset({torch.float32}), fused, _penalize_supports)
    )
    OPS["rotary_and_cache"].register(
        "cpu", Kernel("cpp", _rotary_and_cache, LOW_PRECISION, fused, _rotary_supports)
    )
    OPS["paged_attention"].register(
        "cpu",
        Kernel("cpp", _paged_attention, _ATTENTION_DTYPES, attention, _attention_supports),
    )
    prefill = functools.partial(cpu_kernels.kernel_for, "paged_prefill_attention")
    OPS["paged_prefill_attention"].register(
        "cpu",
        Kernel("cpp_tiled", _paged_prefill_attention, _ATTENTION_DTYPES, prefill,
               _prefill_supports),
    )
