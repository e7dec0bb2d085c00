"""`pagoda bench prefix-cache`: a shared system prompt plus short distinct questions, with
automatic prefix caching on and off in the same run.

Each request is sent alone (after the previous one finished), so its time to first token
is its own prefill time, not queueing. Reported: prompt tokens actually computed (prompt
minus tokens served from the cache), mean and p50 TTFT, and the on/off ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda.benchmarks.roofline import describe_machine


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1000, help="shared prefix, in tokens")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def _workload(args: argparse.Namespace, vocab_lo: int, vocab_hi: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.system_len)]
    return [
        system + [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.question_len)]
        for _ in range(args.num_requests)
    ]


def _run(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, seed=args.seed)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ttfts, computed = [], 0
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"q{i}", {"prompt_token_ids": prompt}, params)
        first = None
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
                cached = out.num_cached_tokens
        ttfts.append(first)
        computed += len(prompt) - cached
    engine.check_integrity()
    stats = engine.get_stats()
    return {
        "prefix_caching": caching,
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_computed": computed,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_first_s": ttfts[0],
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }


def run_prefix_cache(args: argparse.Namespace) -> dict:
    prompts = _workload(args, 100, 40000)
    print(f"machine: {describe_machine()}")
    print(
        f"model: {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}  dtype: {args.dtype}  "
        f"requests: {args.num_requests} sent one at a time  shared prefix: {args.system_len} "
        f"tokens  question: {args.question_len} tokens  max_tokens: {args.max_tokens}  "
        f"seed: {args.seed}"
    )
    off = _run(args, prompts, caching=False)
    on = _run(args, prompts, caching=True)
    print(f"{'prefix caching':<16}{'computed':>10}{'of prompt':>11}{'TTFT mean':>12}"
          f"{'TTFT p50':>11}")
    for r in (off, on):
        print(f"{'on' if r['prefix_caching'] else 'off':<16}{r['prompt_tokens_computed']:>10}"
              f"{r['prompt_tokens']:>11}{r['ttft_mean_s'] * 1e3:>10.1f}ms"
              f"{r['ttft_p50_s'] * 1e3:>9.1f}ms")
    saved = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    speedup = off["ttft_p50_s"] / on["ttft_p50_s"]
    print(f"prefill tokens saved: {saved:.1%}   TTFT p50 off/on: {speedup:.1f}x "
          f"(targets: >= 80% and >= 5x)")
    return {"off": off, "on": on, "prefill_tokens_saved": saved, "ttft_p50_ratio": speedup}
