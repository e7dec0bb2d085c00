"""`pagoda bench spec`: speculative decoding against no speculation, in the same run.

Workloads (benchmarks/spec_workload.py, through the model's chat template): (a) grounded,
answers that copy long spans of the prompt (repeat, correct, rename, quote); (b) open chat.
Each at concurrency 1, 4 and 16 (closed loop: max_num_seqs = concurrency, twice as many
requests), greedy, bf16 by default. Configurations: speculation off, ngram with the adaptive
rule, ngram with fixed k, and a draft model when `--draft-model` is given.

Reported per run: output tokens/s, speedup over off, acceptance rate (accepted / draft
tokens), mean accepted length (tokens per verification: 1 + accepted / verifications),
and whether the greedy output equals speculation off. The time of every step without a prefill
against its token count is fitted as t0 + t1 * tokens: the ratio t1 / t0 is what the adaptive rule uses
(spec_decode/adaptive.py TOKEN_COST_RATIO).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

from pagoda.benchmarks.roofline import describe_machine, machine_line
from pagoda.benchmarks.spec_workload import WORKLOADS


def add_spec_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--draft-model", default=None, help="also run method draft_model with it")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write setup and results here")


def _configs(args: argparse.Namespace) -> dict[str, dict | None]:
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    configs: dict[str, dict | None] = {"off": None, "ngram": ngram,
                                       "ngram fixed k": {**ngram, "adaptive": False}}
    if args.draft_model:
        configs["draft_model"] = {"method": "draft_model", "model": args.draft_model,
                                  "num_speculative_tokens": k}
    return configs


def _run(llm: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """All prompts through the engine, step by step: outputs, elapsed time, and each step's
    (scheduled tokens, seconds)."""
    from pagoda import SamplingParams

    engine = llm.llm_engine
    sched = engine.scheduler
    before = sched.get_stats()
    steps: list[tuple[int, float]] = []
    schedule = sched.schedule
    decode_only: list[bool] = []

    def timed_schedule():  # NOTE: the bench's own probe of each step's token count
        out = schedule()
        steps.append((out.total_num_scheduled_tokens, 0.0))
        decode_only.append(not out.scheduled_new_reqs)
        return out

    sched.schedule = timed_schedule
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps[-1] = (steps[-1][0], time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    sched.schedule = schedule
    engine.check_integrity()
    after = sched.get_stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    num_out = sum(len(t) for t in outputs.values())
    return {
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
        "output_tokens": num_out, "elapsed_s": elapsed, "tok_per_s": num_out / elapsed,
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_len": 1 + accepted / drafts if drafts else None,
        # NOTE: steps without a new request's prefill: the regime the adaptive rule is for.
        "steps": [s for s, d in zip(steps, decode_only) if d],
    }


def _fit(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = t0 + t1 * tokens over steps."""
    n = len(steps)
    mx = sum(x for x, _ in steps) / n
    my = sum(y for _, y in steps) / n
    var = sum((x - mx) ** 2 for x, _ in steps)
    t1 = sum((x - mx) * (y - my) for x, y in steps) / var if var else 0.0
    return my - t1 * mx, t1


def run_spec_decode(args: argparse.Namespace) -> dict:
    from pagoda import LLM
    from pagoda.entrypoints.chat_template import apply_chat_template

    machine = describe_machine()
    print(f"machine: {machine_line(machine)}")
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}  dtype: {args.dtype}"
          f"  greedy, max_tokens {args.max_tokens}  k = {args.num_speculative_tokens}  "
          f"concurrency {args.concurrency} (2x as many requests)  seed {args.seed}")
    runs, all_steps = [], []
    for name, spec in _configs(args).items():
        for c in args.concurrency:
            llm = LLM(args.model, dtype=args.dtype, max_num_seqs=c, seed=args.seed,
                      speculative_config=spec)
            tok = llm.get_tokenizer()
            # NOTE: a warm-up request first: the first steps pay one-off costs.
            _run(llm, [apply_chat_template(tok, [{"role": "user", "content": "Hi"}])],
                 argparse.Namespace(max_tokens=8))
            for workload in args.workloads:
                texts = WORKLOADS[workload]
                prompts = [apply_chat_template(tok, [{"role": "user", "content": t}])
                           for t in (texts * (2 * c // len(texts) + 1))[: 2 * c]]
                r = _run(llm, prompts, args)
                all_steps += r.pop("steps")
                runs.append({"config": name, "concurrency": c, "workload": workload, **r})
                print(f"  done: {name}, concurrency {c}, {workload}: "
                      f"{r['tok_per_s']:.1f} tok/s", flush=True)
            del llm
            gc.collect()
    base = {(r["workload"], r["concurrency"]): r for r in runs if r["config"] == "off"}
    for r in runs:
        off = base[(r["workload"], r["concurrency"])]
        r["speedup"] = r["tok_per_s"] / off["tok_per_s"]
        r["same_output"] = r["outputs"] == off["outputs"]
    _print(runs)
    t0, t1 = _fit(all_steps)
    print(f"decode step time fit over {len(all_steps)} steps: t0 = {t0 * 1e3:.2f} ms + "
          f"t1 = {t1 * 1e3:.3f} ms per token (t1 / t0 = {t1 / t0 if t0 else float('nan'):.4f})")
    for r in runs:
        del r["outputs"]
    setup = {k: v for k, v in vars(args).items() if k != "func"}
    report = {"setup": {**setup, "machine": machine}, "runs": runs,
              "step_fit": {"t0_s": t0, "t1_s": t1}}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report


def _print(runs: list[dict]) -> None:
    print(f"{'workload':<10}{'conc':>5} {'config':<15}{'tok/s':>8}{'speedup':>9}"
          f"{'accept':>8}{'mean len':>9}{'same output':>13}")
    for r in runs:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        mlen = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        print(f"{r['workload']:<10}{r['concurrency']:>5} {r['config']:<15}"
              f"{r['tok_per_s']:>8.1f}{r['speedup']:>8.2f}x{acc:>8}"
              f"{mlen:>9}{'yes' if r['same_output'] else 'NO':>13}")
