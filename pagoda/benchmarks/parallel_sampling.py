"""`pagoda bench parallel-sampling`: KV memory of n samples of one prompt (one request with
`n`) against the same prompt sent as n separate requests, with prefix caching on and off.

The n samples of one request are n sequences in the scheduler. The first computes the
prompt; each later one forks from it once it has (pagoda/core/scheduler.py `_admit_fork`):
it shares the prompt's full blocks, gets a copy of the partly filled last block
(copy-on-write: its first token lands there) and computes only the last prompt token, for
its own first sample. So they share with prefix caching on or off; four separate requests
share only through the prefix cache, whose blocks are registered when a step commits, so
separate requests admitted in the same step share nothing. Peak = the most KV blocks in
use at any moment of the run (`KVCacheManager.peak_num_used_blocks`), output lengths
forced with `ignore_eos`.

Reported: peak blocks (and MiB) of each of the four runs, and the saving
1 - peak(n samples) / peak(n separate requests, prefix caching off).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

from pagoda.benchmarks.roofline import describe_machine, machine_line


def add_parallel_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per sample")
    p.add_argument("--n", type=int, default=4, help="samples of the prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write setup and results here")


def _prompt(args: argparse.Namespace) -> list[int]:
    # NOTE: ids above the special tokens of the embedded tokenizer's range.
    rng = random.Random(args.seed)
    return [rng.randrange(100, 40000) for _ in range(args.prompt_len)]


def _engine(args: argparse.Namespace, caching: bool) -> Any:
    """An engine with exactly enough blocks for n full-length sequences (no preemption)."""
    from pagoda import LLM

    max_len = args.prompt_len + args.max_tokens
    num_blocks = args.n * -(-max_len // args.block_size) + 1
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, seed=args.seed,
              block_size=args.block_size, max_model_len=max_len,
              num_gpu_blocks_override=num_blocks)
    return llm.llm_engine


def _run(engine: Any, args: argparse.Namespace, prompt: list[int], together: bool) -> dict:
    """One prompt as one request with n samples (`together`) or as n requests; the peak
    number of blocks in use, from an empty cache."""
    from pagoda import SamplingParams

    kv = engine.kv_cache_manager
    assert kv.reset_prefix_cache(), "blocks still in use"
    kv.reset_peak_num_used_blocks()
    tag = "n" if together else "sep"

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=args.max_tokens, temperature=1.0, seed=seed,
                              ignore_eos=True)

    start = time.perf_counter()
    if together:
        engine.add_request(tag, {"prompt_token_ids": prompt}, params(args.n, args.seed))
    else:
        # NOTE: seed + i is what the engine gives sample i of an n request.
        for i in range(args.n):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt},
                               params(1, args.seed + i))
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += sum(len(c.token_ids) for c in out.outputs)
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    peak = kv.peak_num_used_blocks
    return {
        "shape": f"n={args.n} in one request" if together else f"{args.n} separate requests",
        "prefix_caching": kv.enable_caching,
        "peak_blocks": peak,
        "peak_kv_mib": peak * engine.kv_block_bytes / (1 << 20),
        "num_output_tokens": num_tokens,
        "elapsed_s": elapsed,
    }


def run_parallel_sampling(args: argparse.Namespace) -> dict:
    if args.n < 2:
        raise ValueError(f"--n must be at least 2, got {args.n}")
    prompt = _prompt(args)
    machine = describe_machine()
    print(f"machine: {machine_line(machine)}")
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}  dtype: {args.dtype}  "
          f"prompt: {args.prompt_len} tokens  samples: n={args.n} x {args.max_tokens} tokens "
          f"(temperature 1, ignore_eos)  block size: {args.block_size}  seed: {args.seed}")
    runs = []
    for caching in (True, False):
        engine = _engine(args, caching)
        runs += [_run(engine, args, prompt, together=True),
                 _run(engine, args, prompt, together=False)]
        del engine
        gc.collect()
    print(f"{'run':<28}{'prefix caching':>15}{'peak blocks':>13}{'peak KV MiB':>13}"
          f"{'elapsed':>10}")
    for r in runs:
        print(f"{r['shape']:<28}{'on' if r['prefix_caching'] else 'off':>15}"
              f"{r['peak_blocks']:>13}{r['peak_kv_mib']:>13.1f}{r['elapsed_s']:>9.2f}s")
    n_on, _, n_off, sep_off = runs
    saving = 1 - n_on["peak_blocks"] / sep_off["peak_blocks"]
    saving_off = 1 - n_off["peak_blocks"] / sep_off["peak_blocks"]
    print(f"KV saving of n={args.n} (prefix caching on, the default) over {args.n} separate "
          f"requests (prefix caching off): {saving:.1%}  (vLLM reports up to 55%)")
    print(f"with prefix caching off for both: {saving_off:.1%} (n samples fork the prompt's "
          "blocks; separate requests share nothing)")
    setup = {k: v for k, v in vars(args).items() if k != "func"}
    report = {"setup": {**setup, "machine": machine}, "runs": runs,
              "saving": saving, "saving_prefix_caching_off": saving_off}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report
