"""`pagoda bench multi-turn`: multi-turn conversations interleaved with bursts of unrelated
traffic, on a KV cache too small to keep the histories between turns, with the prefix
cache's host tier off and on in the same run (same seed, same workload).

Each conversation starts with its own system prompt; every turn sends the history so far
(previous prompt + the generated reply) plus a new user message, as token ids. After each
turn a burst of distinct prompts runs (all at once) and pushes the device cache around.
Turns are sent alone (after everything before them finished), so a turn's time to first
token is its own prefill, plus the host -> device copies of what it loads.

Reported per run: prompt tokens of the turns and how many were recomputed (prompt minus
tokens served from the prefix cache), the tokens loaded from the host tier, TTFT p50/p99
of turns >= 2 (turn 1 has no history to keep), and the off/on ratios.

NOTE: replies are greedy with ignore_eos, so every run has the same prompt lengths. In
float32 the replies of the two runs are identical; in bfloat16 they may differ (KV computed
in other prefill shapes rounds differently), and then the histories differ in content, not
in size. "replies identical" says which.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

from pagoda.benchmarks.roofline import describe_machine


def add_multi_turn_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=300,
                   help="each conversation's own first prompt, in tokens")
    p.add_argument("--user-len", type=int, default=150, help="new user message per turn")
    p.add_argument("--reply-len", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--burst-size", type=int, default=2,
                   help="distinct prompts in the burst after each turn")
    p.add_argument("--burst-len", type=int, default=256)
    p.add_argument("--burst-max-tokens", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=160,
                   help="KV cache blocks (16 tokens each by default): small enough that a "
                   "conversation's history is evicted before its next turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-offloading-size", type=float, default=0.5,
                   help="GiB of host memory for the host tier in the 'on' run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def make_workload(args: argparse.Namespace, vocab_lo: int, vocab_hi: int) -> dict[str, Any]:
    """Every prompt token of the run, drawn up front from the seed: per conversation a
    system prompt and one user message per turn; per turn and conversation a burst."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_lo, vocab_hi) for _ in range(n)]

    convs = range(args.num_conversations)
    return {
        "system": [tokens(args.system_len) for _ in convs],
        "user": [[tokens(args.user_len) for _ in range(args.num_turns)] for _ in convs],
        "bursts": [[[tokens(args.burst_len) for _ in range(args.burst_size)] for _ in convs]
                   for _ in range(args.num_turns)],
    }


def _check_sizes(args: argparse.Namespace) -> None:
    longest = (args.system_len + args.num_turns * (args.user_len + args.reply_len))
    if longest > args.max_model_len:
        raise ValueError(
            f"the last turn needs {longest} tokens (system + turns x (user + reply)), more "
            f"than --max-model-len {args.max_model_len}"
        )
    if args.burst_len + args.burst_max_tokens > args.max_model_len:
        raise ValueError("--burst-len + --burst-max-tokens exceeds --max-model-len")
    if not args.kv_offloading_size > 0:
        raise ValueError("--kv-offloading-size must be > 0 (the 'on' run needs a host tier)")


def _run_alone(engine, req_id: str, prompt: list[int], params) -> tuple[float, list[int], int]:
    """Send one request with nothing else in flight: (TTFT s, output ids, cached tokens)."""
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    ttft, token_ids, cached = None, [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            token_ids, cached = out.outputs[0].token_ids, out.num_cached_tokens
    return ttft, list(token_ids), cached


def _run_burst(engine, req_id: str, prompts: list[list[int]], params) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{req_id}.{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()


def _run(args: argparse.Namespace, workload: dict[str, Any], offloading_gib: float) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size,
              max_model_len=args.max_model_len, num_gpu_blocks_override=args.num_gpu_blocks,
              kv_offloading_size=offloading_gib, seed=args.seed)
    engine = llm.llm_engine
    reply = SamplingParams(max_tokens=args.reply_len, temperature=0.0, ignore_eos=True)
    burst = SamplingParams(max_tokens=args.burst_max_tokens, temperature=0.0, ignore_eos=True)
    histories = list(workload["system"])
    turns, replies = [], []
    start = time.perf_counter()
    for t in range(args.num_turns):
        for c in range(args.num_conversations):
            prompt = histories[c] + workload["user"][c][t]
            host_hits = engine.get_stats().prefix_cache_host_hits
            ttft, out_ids, cached = _run_alone(engine, f"c{c}.t{t}", prompt, reply)
            turns.append({"conversation": c, "turn": t + 1, "prompt_tokens": len(prompt),
                          "cached_tokens": cached, "ttft_s": ttft,
                          "host_hit_tokens": engine.get_stats().prefix_cache_host_hits
                          - host_hits})
            replies.append(out_ids)
            histories[c] = prompt + out_ids
            _run_burst(engine, f"burst{t}.{c}", workload["bursts"][t][c], burst)
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    stats = engine.get_stats()
    tier = engine.kv_cache_manager.host_tier
    later = [x["ttft_s"] for x in turns if x["turn"] >= 2]
    result = {
        "kv_offloading_size_gib": offloading_gib,
        "host_tier_blocks": tier.num_slots if tier else 0,
        "device_blocks": engine.num_blocks,
        "turn_prompt_tokens": sum(x["prompt_tokens"] for x in turns),
        "turn_tokens_recomputed": sum(x["prompt_tokens"] - x["cached_tokens"] for x in turns),
        "turn_host_hit_tokens": sum(x["host_hit_tokens"] for x in turns),
        "host_hit_tokens": stats.prefix_cache_host_hits,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "host_offloaded_blocks": tier.num_offloaded if tier else 0,
        "host_loaded_blocks": tier.num_loaded if tier else 0,
        "ttft_turn2plus_p50_s": percentile(later, 50),
        "ttft_turn2plus_p99_s": percentile(later, 99),
        "elapsed_s": elapsed,
        "turns": turns,
        "replies": replies,
    }
    del llm, engine, tier  # NOTE: free this run's KV cache and host tier before the next
    gc.collect()
    return result


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_multi_turn(args: argparse.Namespace) -> dict:
    _check_sizes(args)
    workload = make_workload(args, 100, 40000)
    print(f"machine: {describe_machine()}")
    print(
        f"model: {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}  dtype: {args.dtype}  "
        f"conversations: {args.num_conversations} x {args.num_turns} turns  system: "
        f"{args.system_len}  user: {args.user_len}  reply: {args.reply_len} tokens  burst "
        f"after each turn: {args.burst_size} x {args.burst_len} tokens (max_tokens "
        f"{args.burst_max_tokens})  KV cache: {args.num_gpu_blocks} blocks of "
        f"{args.block_size}  host tier (on): {args.kv_offloading_size} GiB  seed: {args.seed}"
    )
    off = _run(args, workload, 0.0)
    on = _run(args, workload, args.kv_offloading_size)
    print(f"{'host tier':<11}{'turn prompt':>12}{'recomputed':>12}{'host hits':>11}"
          f"{'TTFT p50':>11}{'TTFT p99':>11}   (TTFT of turns >= 2)")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:<11}{r['turn_prompt_tokens']:>12}{r['turn_tokens_recomputed']:>12}"
              f"{r['turn_host_hit_tokens']:>11}{r['ttft_turn2plus_p50_s'] * 1e3:>9.1f}ms"
              f"{r['ttft_turn2plus_p99_s'] * 1e3:>9.1f}ms")
    ratios = {
        "recomputed_off_over_on": _ratio(off["turn_tokens_recomputed"],
                                         on["turn_tokens_recomputed"]),
        "ttft_p50_off_over_on": _ratio(off["ttft_turn2plus_p50_s"], on["ttft_turn2plus_p50_s"]),
        "ttft_p99_off_over_on": _ratio(off["ttft_turn2plus_p99_s"], on["ttft_turn2plus_p99_s"]),
    }
    same = off.pop("replies") == on.pop("replies")
    print(f"recomputed off/on: {ratios['recomputed_off_over_on']:.2f}x   TTFT p50 off/on: "
          f"{ratios['ttft_p50_off_over_on']:.2f}x   TTFT p99 off/on: "
          f"{ratios['ttft_p99_off_over_on']:.2f}x   replies identical: {same}")
    report = {"setup": {k: v for k, v in vars(args).items() if k != "func"},
              "off": off, "on": on, "ratios": ratios, "replies_identical": same}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report
