"""`pagoda bench kv-quant --micro`: one layer's decode attention through the op
(ops.paged_attention), per KV cache dtype and thread count: milliseconds per call and the
GB/s of K/V bytes (codes and scales) it reads, `--batch` sequences of `--context` tokens
in randomly placed blocks of 16, a bf16 q. Each round times every dtype in turn (A, B, C,
A, B, C, ...), so the ratios share the machine's load; the best round counts.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

CALLS_PER_ROUND = 8


def kv_bytes_read(layer: tuple[torch.Tensor, ...], tokens: int) -> int:
    """Bytes of K and V (codes and their scales) a decode call reads over `tokens` cached
    positions, all sequences together: every stored byte of those rows."""
    k_cache = layer[0]
    per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    if len(layer) == 4:  # quantized: a float32 scale per (token, kv head) for K and for V
        per_token += 2 * k_cache.shape[2] * layer[2].element_size()
    return per_token * tokens


def _call_ms(q, layer, tables, lens, context: int) -> float:
    from pagoda import ops

    k, v, *scales = layer
    scale = q.shape[-1] ** -0.5
    ops.paged_attention(q, k, v, tables, lens, scale, None, context, *scales)
    start = time.perf_counter()
    for _ in range(CALLS_PER_ROUND):
        ops.paged_attention(q, k, v, tables, lens, scale, None, context, *scales)
    return (time.perf_counter() - start) / CALLS_PER_ROUND * 1e3


def run_micro(args, shape) -> dict[str, Any]:
    """{threads: {kv dtype: {ms, gb_s, speedup}}} (speedup against the first dtype), printed
    as a table per thread count."""
    from pagoda.benchmarks.kv_quant import decode_inputs

    kvs = [k for k in args.kv_cache_dtypes.split(",") if k]
    layered, tables, lens, q = decode_inputs(kvs, shape, args.batch, args.context, 1)
    layers = {kv: caches[0] for kv, caches in layered.items()}
    before = torch.get_num_threads()
    report: dict[str, Any] = {}
    try:
        for threads in [int(t) for t in args.micro_threads.split(",") if t]:
            torch.set_num_threads(threads)
            best = dict.fromkeys(kvs, math.inf)
            for _ in range(args.repeats):
                for kv in kvs:
                    best[kv] = min(best[kv], _call_ms(q, layers[kv], tables, lens, args.context))
            report[str(threads)] = {
                kv: {"ms": ms, "gb_s": kv_bytes_read(layers[kv], args.batch * args.context)
                     / ms / 1e6, "speedup": best[kvs[0]] / ms}
                for kv, ms in best.items()}
    finally:
        torch.set_num_threads(before)
    _print_micro(report, args, shape)
    return report


def _print_micro(report: dict[str, Any], args, shape) -> None:
    from pagoda.benchmarks.kv_quant import BLOCK_SIZE

    print(f"== one layer's decode attention: {args.batch} x {args.context} tokens, "
          f"{shape.num_heads}/{shape.num_kv_heads} heads x {shape.head_dim}, block "
          f"{BLOCK_SIZE}, bf16 q; best of {args.repeats} rounds of {CALLS_PER_ROUND} calls ==")
    print(f"{'threads':>7} {'kv dtype':<10}{'ms':>9}{'GB/s':>8}{'speedup':>9}")
    for threads, rows in report.items():
        for kv, r in rows.items():
            print(f"{threads:>7} {kv:<10}{r['ms']:>9.3f}{r['gb_s']:>8.1f}{r['speedup']:>8.2f}x")
