"""`pagoda bench kv-quant`: what a quantized KV cache (--kv-cache-dtype int8 / fp8) buys and
costs against the model-dtype cache, in one run:

- decode attention time per step: the paged-attention op alone (the kernel the engine
  calls), every layer of the model's shape, `--batch` sequences of `--context` tokens in
  randomly placed blocks, best of `--repeats` rounds that each time every dtype in turn;
  `--micro`: one layer only, ms and GB/s per dtype at 1 and 2 threads (kv_quant_micro.py);
- KV bytes per token and conversations of `--conversation-tokens` held per GiB;
- perplexity through the engine's prompt logprobs on a real text (sliding windows), and its
  delta against the model-dtype cache;
- per host compression format (--kv-host-compression): bytes per token, conversations per
  GiB of host memory, and perplexity with every block of earlier prefill chunks passed
  through the format before each step (the worst case: all history comes back from the
  host), plus what a lossless pass (zlib) would add.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def add_kv_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--kv-cache-dtypes", default="auto,int8,fp8",
                   help="comma-separated --kv-cache-dtype values (the first is the baseline)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="perplexity text (a plain text file)")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="tokens scored (0: skip)")
    p.add_argument("--ppl-window", type=int, default=512)
    p.add_argument("--conversation-tokens", type=int, default=2048)
    p.add_argument("--host-compressions", default="none,int8,int4",
                   help="comma-separated --kv-host-compression values to measure ('' skips)")
    p.add_argument("--output-json")
    p.add_argument("--micro", action="store_true",
                   help="only one layer's decode attention op: ms and GB/s of K/V read per "
                        "dtype and thread count (--micro-threads), dtypes alternated per round")
    p.add_argument("--micro-threads", default="1,2", help="comma-separated thread counts")


def _random_cache(kv: str, shape, num_blocks: int, block_size: int, g: torch.Generator):
    """One layer's cache tensors in the spec's layout, filled like real K/V."""
    from pagoda.config import resolve_kv_cache_dtype
    from pagoda.ops.kv_quant import is_quantized, quantize

    dtype = resolve_kv_cache_dtype(kv, torch.bfloat16)
    full = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k, v = (torch.randn(full, generator=g) for _ in range(2))
    if not is_quantized(dtype):
        return (k.to(dtype), v.to(dtype))
    (kc, ks), (vc, vs) = quantize(k, dtype), quantize(v, dtype)
    return (kc, vc, ks, vs)


BLOCK_SIZE = 16


def decode_inputs(kvs: list[str], shape, batch: int, context: int, num_layers: int):
    """A decode step's attention inputs, seeded: per kv dtype `num_layers` caches, block
    tables placing `batch` sequences of `context` tokens in random blocks of BLOCK_SIZE (no
    block 0), their lengths, and a bf16 q [batch, heads, head_dim]."""
    g = torch.Generator().manual_seed(0)
    per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    layers = {kv: [_random_cache(kv, shape, num_blocks, BLOCK_SIZE, g)
                   for _ in range(num_layers)] for kv in kvs}
    tables = (torch.randperm(num_blocks - 1, generator=g)[: batch * per_seq] + 1).view(
        batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=g).to(torch.bfloat16)
    return layers, tables, lens, q


def decode_attention_ms(kvs: list[str], shape, batch: int, context: int,
                        repeats: int) -> dict[str, tuple[float, float]]:
    """{kv dtype: (wall, process CPU) milliseconds of one decode step's attention over all
    layers}, each the best of `repeats` rounds that time every dtype in turn (A, B, A, B:
    the ratios share the machine's load). NOTE: CPU time is what a shared, oversubscribed
    machine can still measure; wall time is the figure on a quiet one."""
    from pagoda import ops

    layers, tables, lens, q = decode_inputs(kvs, shape, batch, context, shape.num_layers)
    scale = shape.head_dim**-0.5

    def step(kv: str) -> None:
        for k, v, *scales in layers[kv]:
            ops.paged_attention(q, k, v, tables, lens, scale, None, context, *scales)

    best = {kv: (math.inf, math.inf) for kv in kvs}
    for kv in kvs:
        step(kv)
    for _ in range(repeats):
        for kv in kvs:
            start, start_cpu = time.perf_counter(), time.process_time()
            step(kv)
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            best[kv] = (min(best[kv][0], wall * 1e3), min(best[kv][1], cpu * 1e3))
    return best


def _windows_perplexity(llm, ids: list[int], window: int) -> float:
    """Perplexity of ids scored in consecutive windows (each window's first token unscored),
    through the engine's prompt logprobs."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    windows = [{"prompt_token_ids": ids[i:i + window]} for i in range(0, len(ids), window)]
    nll, count = 0.0, 0
    for out in llm.generate(windows, params, use_tqdm=False):
        for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            nll -= lp[tok].logprob
            count += 1
    return math.exp(nll / count)


def perplexity(model: str | None, kv: str, ids: list[int], window: int) -> float:
    """exp(mean NLL) of `ids` in windows of `window` tokens (each scores all but its first)."""
    from pagoda import LLM

    llm = LLM(model=model, dtype="bfloat16", max_model_len=window + 1, kv_cache_dtype=kv,
              enable_prefix_caching=False)
    return _windows_perplexity(llm, ids, window)


def round_trip_perplexity(model: str | None, compression: str, ids: list[int], window: int,
                          chunk: int = 128) -> tuple[float, dict[str, float]]:
    """Perplexity (windows of `window` tokens, prefilled in chunks of `chunk`) with the
    whole device cache passed through `compression` and back before every step, so each
    chunk attends to its predecessors as restored from the host; and zlib on the last
    compressed copy of the blocks in use (ratio, MB/s at level 1)."""
    import zlib

    from pagoda import LLM
    from pagoda.worker.kv_compress import convert_blocks, host_layer_tensors, pool_format

    num_blocks = window // 16 + 4
    llm = LLM(model=model, dtype="bfloat16", max_model_len=window + 1,
              enable_prefix_caching=False, max_num_batched_tokens=chunk, max_num_seqs=1,
              num_gpu_blocks_override=num_blocks)
    worker = llm.llm_engine.executor.worker
    (spec,) = worker.kv_cache_specs()
    fmt = pool_format(spec)
    host = [tuple(torch.empty((num_blocks, *shape), dtype=dtype)
                  for shape, dtype in host_layer_tensors(spec, compression))
            for _ in worker.kv_caches]
    idx = torch.arange(1, num_blocks)
    real = worker.execute_model

    def through_host(out):
        for layer, host_layer in zip(worker.kv_caches, host, strict=True):
            convert_blocks(layer, host_layer, idx, idx, fmt, compression)
            convert_blocks(host_layer, layer, idx, idx, compression, fmt)
        return real(out)

    if compression != "none":
        worker.execute_model = through_host
    ppl = _windows_perplexity(llm, ids, window)
    # NOTE: "none" keeps the device's own blocks (bf16: viewed as int16 to reach numpy).
    pools = worker.kv_caches if compression == "none" else host
    raw = b"".join(t[idx].contiguous().view(torch.uint8).numpy().tobytes()
                   for layer in pools for t in layer)
    start = time.perf_counter()
    packed = zlib.compress(raw, 1)
    seconds = time.perf_counter() - start
    lossless = {"zlib1_ratio": len(raw) / len(packed), "zlib1_mb_s": len(raw) / seconds / 1e6}
    return ppl, lossless


def _host_rows(args, shape, ids) -> dict[str, dict[str, Any]]:
    from pagoda.config import resolve_kv_cache_dtype
    from pagoda.core.kv_cache_spec import group_layers
    from pagoda.worker.kv_compress import host_bytes_per_block

    (spec,) = group_layers([None] * shape.num_layers, BLOCK_SIZE, shape.num_kv_heads,
                           shape.head_dim, resolve_kv_cache_dtype("auto", torch.bfloat16))
    rows = {}
    for compression in [c for c in args.host_compressions.split(",") if c]:
        per_token = host_bytes_per_block([spec], compression) // 16
        row: dict[str, Any] = {
            "host_bytes_per_token": per_token,
            "conversations_per_host_gib": (1 << 30) / (per_token * args.conversation_tokens),
        }
        if ids:
            row["perplexity"], lossless = round_trip_perplexity(args.model, compression, ids,
                                                               args.ppl_window)
            row.update(lossless)
        rows[compression] = row
        print("host", compression, json.dumps(row), flush=True)
    return rows


def run_kv_quant(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda import LLM
    from pagoda.benchmarks import roofline as rl
    from pagoda.benchmarks.hf_baseline import load_config, resolve_model

    kvs = [k for k in args.kv_cache_dtypes.split(",") if k]
    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    shape = rl.shape_from_hf_config(load_config(src))
    if args.micro:
        from pagoda.benchmarks.kv_quant_micro import run_micro

        return {"setup": {"model": src.label, "machine": rl.describe_machine()["cpu"]},
                "micro": run_micro(args, shape)}
    ids: list[int] = []
    if args.ppl_tokens:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        tokenizer = LLM(model=args.model, max_model_len=64).get_tokenizer()
        ids = tokenizer.encode(text)[: args.ppl_tokens]
    from pagoda.config import resolve_kv_cache_dtype
    from pagoda.core.kv_cache_spec import group_layers

    times = decode_attention_ms(kvs, shape, args.batch, args.context, args.repeats)
    rows = {}
    for kv in kvs:
        (spec,) = group_layers([None] * shape.num_layers, BLOCK_SIZE, shape.num_kv_heads,
                               shape.head_dim, resolve_kv_cache_dtype(kv, torch.bfloat16))
        wall, cpu = times[kv]
        row = {
            "attention_ms": wall,
            "attention_cpu_ms": cpu,
            "kv_bytes_per_token": spec.bytes_per_token,
            "conversations_per_gib": (1 << 30) / (spec.bytes_per_token
                                                  * args.conversation_tokens),
        }
        if ids:
            row["perplexity"] = perplexity(args.model, kv, ids, args.ppl_window)
        rows[kv] = row
        print(kv, json.dumps(row), flush=True)
    _print_table(rows, kvs[0], args, shape)
    host = _host_rows(args, shape, ids)
    if host:
        _print_host_table(host)
    report = {"setup": {"model": src.label, "batch": args.batch, "context": args.context,
                        "text": args.text, "ppl_tokens": len(ids),
                        "machine": rl.describe_machine()["cpu"]},
              "results": rows, "host_compression": host}
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


def _print_table(rows: dict[str, dict[str, Any]], base: str, args, shape) -> None:
    b = rows[base]
    print(f"== KV cache formats: {shape.num_layers} layers, {shape.num_heads}/"
          f"{shape.num_kv_heads} heads x {shape.head_dim}; decode attention at "
          f"{args.batch} x {args.context} tokens ==")
    print(f"{'kv dtype':<10}{'attn ms':>9}{'speedup':>9}{'cpu ms':>9}{'speedup':>9}"
          f"{'B/token':>9}{'conv/GiB':>10}{'ppl':>10}{'ppl delta':>11}")
    for kv, r in rows.items():
        ppl = r.get("perplexity")
        delta = f"{(ppl / b['perplexity'] - 1):+.2%}" if ppl else "-"
        print(f"{kv:<10}{r['attention_ms']:>9.2f}{b['attention_ms'] / r['attention_ms']:>8.2f}x"
              f"{r['attention_cpu_ms']:>9.2f}"
              f"{b['attention_cpu_ms'] / r['attention_cpu_ms']:>8.2f}x"
              f"{r['kv_bytes_per_token']:>9}{r['conversations_per_gib']:>10.1f}"
              f"{(f'{ppl:.3f}' if ppl else '-'):>10}{delta:>11}")


def _print_host_table(rows: dict[str, dict[str, Any]]) -> None:
    base = rows.get("none", {}).get("perplexity")
    print("== host pool formats (swap, host tier): history restored before every step ==")
    print(f"{'format':<8}{'B/token':>9}{'conv/GiB':>10}{'ppl':>10}{'ppl delta':>11}"
          f"{'zlib-1 ratio':>14}{'zlib MB/s':>11}")
    for name, r in rows.items():
        ppl = r.get("perplexity")
        delta = f"{ppl / base - 1:+.2%}" if ppl and base else "-"
        zr, zs = r.get("zlib1_ratio"), r.get("zlib1_mb_s")
        print(f"{name:<8}{r['host_bytes_per_token']:>9}{r['conversations_per_host_gib']:>10.1f}"
              f"{(f'{ppl:.3f}' if ppl else '-'):>10}{delta:>11}"
              f"{(f'{zr:.3f}' if zr else '-'):>14}{(f'{zs:.0f}' if zs else '-'):>11}")
