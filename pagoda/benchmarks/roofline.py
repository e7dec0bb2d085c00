"""How fast this machine could possibly run a workload: a roofline from measured limits.

Two parts, kept apart so the arithmetic is testable on given numbers:

* `measure_*`: the machine's matmul FLOP/s (square 2048^3 and the model's own projection
  shapes) and its memory read bandwidth.
* `roofline()`: a lower bound on the time to run a workload, from the model's shape.

The cost model (a decoder-only transformer with a gated MLP, llama-style):

* Every forwarded token (prompt tokens and every output token but the last, which is
  sampled and never fed back) costs `2 * linear_params` FLOPs in the layers' projections.
* Every sampled token (one per output token) costs `2 * vocab * hidden` in the LM head;
  prompt positions other than the last need no logits.
* Attention costs `4 * num_layers * num_heads * head_dim` FLOPs per (query, key) pair
  (QK^T and PV); a token at position i sees i + 1 keys, so a request of prompt p and
  output o has (p + o - 1)(p + o) / 2 pairs.
* Each engine step reads the weights once (`weight_bytes`): layer projections, norms and
  the LM head, in the run's dtype or, for a GGUF file pagoda runs natively, at the file's
  bytes per weight; embedding lookups read only a few rows and are not counted.
* KV cache traffic: every forwarded token writes its K and V once; a prefill reads its
  own prompt's KV once (flash-style); each decode token reads its whole context once.

The schedule (a steady-state batch model): at most `concurrency` requests run at once
(`min(max_num_seqs, num_requests)`) and a step processes at most `max_num_batched_tokens`
tokens, so the number of steps is at least the largest of: output tokens / concurrency,
forwarded tokens / token budget, and the longest single output (a request makes one
token per step). In the steady state every step has the same mix, so the sum over steps
of max(compute, memory) equals max(total compute time, total memory time), with compute
at the peak rate (the best measured at any shape tried, attention included) and memory at
the measured read bandwidth, both with torch's current thread count. The peak is torch's
matmul in the run's dtype and, where pagoda runs a GGUF file's blocks natively, its GGUF
kernel on the file's types (`measure_gguf_kernel_ops`): int8 products, faster than a bf16
GEMM on a CPU without AMX, and a bound must hold for every system it is compared with.
Anything real is slower: this is a bound to measure against, not a prediction.

The single-request decode floor is one weight read per token: `weight_bytes / bandwidth`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ISA_OF_NOTE = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The dimensions that decide a llama-style model's FLOPs and bytes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @property
    def layer_linear_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp

    @property
    def linear_params(self) -> int:
        return self.num_layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + self.norm_params + embeddings

    @property
    def weight_params_read_per_step(self) -> int:
        return self.linear_params + self.norm_params + self.lm_head_params

    @property
    def kv_elems_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def attn_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.num_heads * self.head_dim


def shape_from_hf_config(config: Any) -> ModelShape:
    """Read a ModelShape from a transformers config (llama, qwen2, mistral, ...)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


@dataclass(slots=True, frozen=True)
class MachineLimits:
    flops_per_s: float  # peak matmul rate in the run's dtype
    bytes_per_s: float  # memory read bandwidth


@dataclass(slots=True, frozen=True)
class WorkloadCost:
    num_steps: int
    num_forwarded_tokens: int
    num_output_tokens: int
    linear_flops: float
    lm_head_flops: float
    attn_flops: float
    weight_bytes: float  # over all steps
    kv_bytes: float

    @property
    def total_flops(self) -> float:
        return self.linear_flops + self.lm_head_flops + self.attn_flops

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(slots=True, frozen=True)
class RooflineEstimate:
    cost: WorkloadCost
    compute_s: float
    memory_s: float
    time_s: float
    bound: str  # "compute" or "memory"
    output_tokens_per_s: float
    single_stream_s_per_token: float
    single_stream_tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cost"]["total_flops"] = self.cost.total_flops
        out["cost"]["total_bytes"] = self.cost.total_bytes
        return out


def min_num_steps(
    lengths: Sequence[tuple[int, int]], concurrency: int, max_num_batched_tokens: int
) -> int:
    """Fewest engine steps any schedule under these limits could take (see module doc)."""
    if not lengths:
        return 0
    num_output = sum(o for _, o in lengths)
    num_forwarded = sum(p + o - 1 for p, o in lengths)
    return max(
        math.ceil(num_output / max(1, concurrency)),
        math.ceil(num_forwarded / max(1, max_num_batched_tokens)),
        max(o for _, o in lengths),
    )


def _bytes_per_weight(dtype_bytes: int, weight_bytes_per_param: float | None) -> float:
    """A weight's bytes: a quantized file's own, else the run's dtype's."""
    return dtype_bytes if weight_bytes_per_param is None else weight_bytes_per_param


def workload_cost(
    lengths: Sequence[tuple[int, int]],
    shape: ModelShape,
    dtype_bytes: int,
    concurrency: int,
    max_num_batched_tokens: int,
    weight_bytes_per_param: float | None = None,
) -> WorkloadCost:
    """FLOPs and bytes a workload of (prompt_len, output_len) pairs needs at the least;
    weights at `weight_bytes_per_param` (a quantized file's) or else `dtype_bytes`."""
    wbytes = _bytes_per_weight(dtype_bytes, weight_bytes_per_param)
    num_forwarded = sum(p + o - 1 for p, o in lengths)
    num_output = sum(o for _, o in lengths)
    num_pairs = sum((p + o - 1) * (p + o) // 2 for p, o in lengths)
    # KV reads (in tokens): a prefill reads its prompt once; decode token j (1 <= j < o)
    # sits at position p + j - 1 and reads p + j cached tokens.
    kv_read_tokens = sum(p + (o - 1) * p + (o - 1) * o // 2 for p, o in lengths)
    kv_tokens = kv_read_tokens + num_forwarded  # + one write per forwarded token
    num_steps = min_num_steps(lengths, concurrency, max_num_batched_tokens)
    return WorkloadCost(
        num_steps=num_steps,
        num_forwarded_tokens=num_forwarded,
        num_output_tokens=num_output,
        linear_flops=2.0 * shape.linear_params * num_forwarded,
        lm_head_flops=2.0 * shape.lm_head_params * num_output,
        attn_flops=float(shape.attn_flops_per_pair) * num_pairs,
        weight_bytes=float(num_steps) * shape.weight_params_read_per_step * wbytes,
        kv_bytes=float(kv_tokens) * shape.kv_elems_per_token * dtype_bytes,
    )


def roofline(
    lengths: Sequence[tuple[int, int]],
    shape: ModelShape,
    limits: MachineLimits,
    dtype_bytes: int,
    concurrency: int,
    max_num_batched_tokens: int,
    weight_bytes_per_param: float | None = None,
) -> RooflineEstimate:
    """Lower bound on the workload's run time on a machine with `limits`."""
    cost = workload_cost(lengths, shape, dtype_bytes, concurrency, max_num_batched_tokens,
                         weight_bytes_per_param)
    compute_s = cost.total_flops / limits.flops_per_s
    memory_s = cost.total_bytes / limits.bytes_per_s
    time_s = max(compute_s, memory_s)
    wbytes = _bytes_per_weight(dtype_bytes, weight_bytes_per_param)
    single_s = shape.weight_params_read_per_step * wbytes / limits.bytes_per_s
    return RooflineEstimate(
        cost=cost,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=time_s,
        bound="compute" if compute_s >= memory_s else "memory",
        output_tokens_per_s=cost.num_output_tokens / time_s if time_s > 0 else math.inf,
        single_stream_s_per_token=single_s,
        single_stream_tokens_per_s=1.0 / single_s,
    )


def fraction_of_roofline(estimate: RooflineEstimate, measured_s: float) -> float:
    """Share of the best possible speed reached: bound time / measured time (<= 1)."""
    return estimate.time_s / measured_s


# ---------------------------------------------------------------- measurement (torch)


def _best_time(fn: Any, min_time_s: float, max_repeats: int = 50) -> float:
    """Best wall time of `fn()` over repeats lasting about `min_time_s` in all.

    NOTE: the best, not the mean, because the cores are shared and a neighbour's burst
    only ever makes a run slower.
    """
    fn()  # warm-up: first-call allocation and kernel selection
    best = math.inf
    start = time.perf_counter()
    for _ in range(max_repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start >= min_time_s:
            break
    return best


def measure_matmul_flops(m: int, k: int, n: int, dtype: str, min_time_s: float = 0.5) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul in `dtype`."""
    import torch

    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(tdtype)
    b = torch.randn(k, n, generator=gen).to(tdtype)
    out = torch.empty(m, n, dtype=tdtype)
    seconds = _best_time(lambda: torch.matmul(a, b, out=out), min_time_s)
    return 2.0 * m * k * n / seconds


def measure_gguf_kernel_ops(
    rows: Sequence[int], k: int, n: int, qtype: int, min_time_s: float = 0.5
) -> dict[int, float]:
    """Op/s (2 per row x weight) of pagoda's GGUF linear on one random [n, k] weight of
    `qtype`, per row count m of bf16 activations; empty where no CPU kernel runs that type."""
    import numpy as np
    import torch

    from pagoda.benchmarks.quant_kernels import random_gguf_weight
    from pagoda.ops import quant_layouts, wquant

    probe = torch.empty(0, dtype=torch.bfloat16)
    if (qtype not in quant_layouts.GGUF_BLOCK or k % quant_layouts.GGUF_BLOCK[qtype][0]
            or wquant.gguf_linear.kernel_for(probe) is None):
        return {}
    w = random_gguf_weight(qtype, n, k, np.random.default_rng(0))
    rates = {}
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        rates[m] = 2.0 * m * k * n / _best_time(lambda x=x: wquant.gguf_linear(x, w), min_time_s)
    return rates


def gguf_matrices(path: str | Path) -> tuple[list[int], float]:
    """A GGUF file's matrices (linears and the token table): their ggml types, and their
    bytes per weight, all together (what a step that runs them natively reads)."""
    from pagoda.models.gguf import open_gguf

    mats = [t for t in open_gguf(Path(path)).tensors if len(t.shape) == 2]
    nbytes = sum(int(t.n_bytes) for t in mats)
    return sorted({int(t.tensor_type) for t in mats}), nbytes / max(1, sum(
        int(t.n_elements) for t in mats))


def measure_read_bandwidth(num_bytes: int = 1 << 30, min_time_s: float = 1.0) -> float:
    """Bytes/s of summing a float32 tensor far larger than the caches."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = _best_time(lambda: x.sum(), min_time_s, max_repeats=20)
    return x.numel() * 4 / seconds


def measure_machine(
    dtype: str, shape: ModelShape | None = None, quick: bool = False,
    gguf_types: Sequence[int] = (),
) -> tuple[MachineLimits, dict[str, Any]]:
    """Measure peak matmul FLOP/s (bf16 and fp32) and read bandwidth; limits for `dtype`.

    With a shape, also the model's up-projection (hidden -> intermediate) at 1, 16 and 256
    rows, to show how far a decode step's small matmuls sit below the peak, and pagoda's
    GGUF kernel on each of `gguf_types` at 256 and 1,024 rows (the types a natively run
    GGUF file holds: its rate then counts toward the peak).
    """
    min_time = 0.2 if quick else 0.5
    details: dict[str, Any] = {"matmul_2048": {}, "model_shapes": {}, "gguf_kernel": {}}
    for dt in sorted({"bfloat16", "float32", dtype}):
        details["matmul_2048"][dt] = measure_matmul_flops(2048, 2048, 2048, dt, min_time)
    if shape is not None:
        k, n = shape.hidden_size, shape.intermediate_size
        for m in (1, 16, 256):
            key = f"{m}x{k}x{n}"
            details["model_shapes"][key] = measure_matmul_flops(m, k, n, dtype, min_time)
        for qtype in gguf_types:
            for m, rate in measure_gguf_kernel_ops((256, 1024), k, n, qtype, min_time).items():
                details["gguf_kernel"][f"{_ggml_name(qtype)} {m}x{k}x{n}"] = rate
    num_bytes = (256 << 20) if quick else (1 << 30)
    details["read_bandwidth"] = measure_read_bandwidth(num_bytes, 0.5 if quick else 1.0)
    details["bandwidth_bytes"] = num_bytes
    # NOTE: the peak is the best rate seen at any shape, so the bound stays a bound.
    peak = max(details["matmul_2048"][dtype], *details["model_shapes"].values(),
               *details["gguf_kernel"].values())
    limits = MachineLimits(flops_per_s=peak, bytes_per_s=details["read_bandwidth"])
    return limits, details


def _ggml_name(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name


# ---------------------------------------------------------------- reporting


def machine_line(m: dict[str, Any]) -> str:
    """`describe_machine()` in one line, for a benchmark's setup printout."""
    return (f"{m['cpu']}, {m['num_cpus']} CPUs ({m['cpus_usable']} usable), "
            f"{' '.join(m['isa']) or '-'}; torch {m['torch']} ({m['torch_threads']} threads)")


def describe_machine() -> dict[str, Any]:
    """What every number depends on: CPU, cores, memory, library versions, threads."""
    import os
    import platform

    import torch
    import transformers

    cpu, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": sorted(flags & _ISA_OF_NOTE),
        "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1) if pages else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }


def workload_roofline(
    lengths: Sequence[tuple[int, int]],
    shape: ModelShape,
    dtype: str,
    concurrency: int,
    max_num_batched_tokens: int,
    quick: bool = False,
    gguf_types: Sequence[int] = (),
    weight_bytes_per_param: float | None = None,
) -> dict[str, Any]:
    """Measure the machine (with torch's current threads), then bound the workload.
    A GGUF file that pagoda runs natively: its matrices' `gguf_types` (measure_machine) and
    `weight_bytes_per_param`, the fewest bytes any system compared reads."""
    limits, details = measure_machine(dtype, shape, quick=quick, gguf_types=gguf_types)
    estimate = roofline(lengths, shape, limits, DTYPE_BYTES[dtype], concurrency,
                        max_num_batched_tokens, weight_bytes_per_param)
    return {
        "shape": {**asdict(shape), "num_params": shape.num_params},
        "limits": asdict(limits),
        "measurements": details,
        "concurrency": concurrency,
        "max_num_batched_tokens": max_num_batched_tokens,
        "weight_bytes_per_param": weight_bytes_per_param,
        "estimate": estimate.to_dict(),
    }


def format_roofline(report: dict[str, Any]) -> str:
    """The measured limits and the bound, as a few printable lines."""
    d, est, c = report["measurements"], report["estimate"], report["estimate"]["cost"]
    square = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in d["matmul_2048"].items())
    shapes = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in d["model_shapes"].items())
    limits = f"matmul GFLOP/s: 2048^3 {square}; model shapes (M x K x N) {shapes}"
    if gguf := d.get("gguf_kernel"):
        rates = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in gguf.items())
        limits += f"; pagoda's GGUF kernel (type M x K x N) G op/s {rates}"
    memory = (
        f"read bandwidth {d['read_bandwidth'] / 1e9:.1f} GB/s; "
        f"params {report['shape']['num_params']:,}"
    )
    bound = (
        f"bound ({est['bound']}-bound): {est['time_s']:.2f} s = "
        f"{est['output_tokens_per_s']:,.0f} output tok/s; compute {est['compute_s']:.2f} s "
        f"({c['total_flops'] / 1e12:.2f} TFLOP), memory {est['memory_s']:.2f} s "
        f"({c['total_bytes'] / 1e9:.1f} GB in >= {c['num_steps']} steps at concurrency "
        f"{report['concurrency']})"
    )
    single = (
        f"single-request decode floor: {est['single_stream_s_per_token'] * 1e3:.2f} ms/token "
        f"= {est['single_stream_tokens_per_s']:,.0f} tok/s"
    )
    return f"{limits}\n{memory}\n{bound}\n{single}"
