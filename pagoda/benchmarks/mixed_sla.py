"""`pagoda bench mixed-sla`: interactive requests arriving over a batch job that saturates
the engine, under the fcfs and the priority scheduling policy, same seeded workload.

The batch job (sla_class "batch", a high priority number) is queued whole at the start:
more long requests than `--max-num-seqs`. Interactive requests (short prompts, short
outputs, sla_class "interactive") arrive on a Poisson process whose clock is the engine
step: `--interactive-rate` requests per step, so both policies see the very same arrivals
(a request due before step k is added just before step k runs; an idle engine skips ahead
to the next arrival). LLMEngine is stepped in this process.

| reported                 | meaning                                                       |
|--------------------------|---------------------------------------------------------------|
| TTFT (steps)             | engine steps from an interactive request's arrival through the|
|                          | one that produced its first token (1 = the very next step)    |
| TTFT (s)                 | arrival to first token, wall time (RequestOutput metrics)     |
| batch out tok/s          | batch output tokens / (start -> the last batch request ends)  |
| batch throughput lost    | 1 - priority / fcfs batch tok/s (and the same by steps: 1 -   |
|                          | fcfs steps / priority steps until the batch job is done)      |
| preemptions              | over the run, by the preempted request's class                |

Counting in steps makes the comparison independent of the machine's speed and load; the
seconds are what a user would see. Aging is off by default (`--aging-interval-s inf`):
this run compresses a long batch job into minutes, and a production aging interval would
measure the aging tick against the run's length rather than the policy.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.benchmarks.roofline import describe_machine, machine_line

POLICIES = ("fcfs", "priority")
_BLOCK_SIZE = 16


def add_mixed_sla_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-batch", type=int, default=24, help="requests of the batch job")
    p.add_argument("--batch-input-len", type=int, default=256)
    p.add_argument("--batch-output-len", type=int, default=128)
    p.add_argument("--batch-priority", type=int, default=10, help="lower is served first")
    p.add_argument("--num-interactive", type=int, default=32)
    p.add_argument("--interactive-input-len", type=int, default=32)
    p.add_argument("--interactive-output-len", type=int, default=8)
    p.add_argument("--interactive-rate", type=float, default=0.08,
                   help="interactive arrivals per engine step (Poisson)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks of 16 tokens (default: twice what --max-num-seqs "
                   "full-length sequences take)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--aging-interval-s", type=float, default=math.inf,
                   help="priority policy aging (default inf: none; see the module doc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write setup and results here")


@dataclass(slots=True)
class _Req:
    """One request of the workload and what its run measured."""

    req_id: str
    sla_class: str
    prompt: list[int]
    num_output: int
    arrival_step: int = 0
    first_step: int | None = None
    finish_step: int | None = None
    ttft_s: float | None = None
    finish_time: float | None = None
    num_tokens: int = 0


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[_Req]:
    """Batch requests (arrival step 0) then interactive ones (Poisson arrivals in steps)."""
    from pagoda.benchmarks.workload import make_workload

    batch = make_workload(args.num_batch, (args.batch_input_len,) * 2,
                          (args.batch_output_len,) * 2, args.seed, tokenizer=tokenizer)
    inter = make_workload(args.num_interactive, (args.interactive_input_len,) * 2,
                          (args.interactive_output_len,) * 2, args.seed + 1,
                          tokenizer=tokenizer)
    reqs = [_Req(f"batch-{i}", "batch", p, o) for i, (p, o) in enumerate(batch)]
    rng, clock = random.Random(args.seed), 0.0
    for i, (p, o) in enumerate(inter):
        clock += rng.expovariate(args.interactive_rate)
        reqs.append(_Req(f"inter-{i}", "interactive", p, o, arrival_step=int(clock)))
    return reqs


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the nearest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _engine(args: argparse.Namespace, policy: str) -> Any:
    from pagoda import LLM

    max_len = max(args.batch_input_len + args.batch_output_len,
                  args.interactive_input_len + args.interactive_output_len)
    # NOTE: twice the running sequences' need by default, so that a request preempted by
    # recompute usually finds its blocks still in the prefix cache when it resumes (as with
    # a large GPU pool); --num-kv-blocks can make it tight.
    num_blocks = args.num_kv_blocks or 2 * args.max_num_seqs * -(-max_len // _BLOCK_SIZE)
    llm = LLM(args.model, dtype=args.dtype, block_size=_BLOCK_SIZE,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              num_gpu_blocks_override=num_blocks, scheduling_policy=policy,
              preemption_mode=args.preemption_mode, aging_interval_s=args.aging_interval_s,
              seed=args.seed)
    return llm.llm_engine


def _warm_up(engine: Any, prompt: list[int]) -> None:
    from pagoda import SamplingParams

    # NOTE: shorter than a block, so that it leaves no prefix-cache hit behind.
    engine.add_request("warm-up", {"prompt_token_ids": prompt[: _BLOCK_SIZE // 2]},
                       SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def _add(engine: Any, req: _Req, batch_priority: int) -> None:
    from pagoda import SamplingParams
    from pagoda.engine.output_processor import OutputKind

    params = SamplingParams(max_tokens=req.num_output, ignore_eos=True, temperature=0.0)
    engine.add_request(req.req_id, {"prompt_token_ids": req.prompt}, params,
                       priority=batch_priority if req.sla_class == "batch" else 0,
                       output_kind=OutputKind.DELTA, sla_class=req.sla_class)


def simulate(engine: Any, workload: list[_Req], batch_priority: int) -> dict[str, Any]:
    """Run the workload on the step clock; fills in each `_Req`'s measurements."""
    reqs = {r.req_id: r for r in workload}
    pending = sorted(workload, key=lambda r: r.arrival_step)  # stable: batch first
    before = engine.get_stats()
    step, start = 0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= step:
            _add(engine, pending.pop(0), batch_priority)
        for out in engine.step():
            r = reqs[out.request_id]
            r.num_tokens += sum(len(c.token_ids) for c in out.outputs)
            if r.first_step is None and r.num_tokens:
                r.first_step = step
                m = out.metrics
                r.ttft_s = m.first_token_time - m.arrival_time
            if out.finished:
                r.finish_step, r.finish_time = step, time.perf_counter()
        step += 1
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    after = engine.get_stats()
    by_class = {c: n - before.sla_preemptions.get(c, 0)
                for c, n in after.sla_preemptions.items()}
    return {"elapsed_s": elapsed, "num_steps": step, "start": start,
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "preemptions_by_class": {c: n for c, n in by_class.items() if n}}


def summarize(workload: list[_Req], run: dict[str, Any]) -> dict[str, Any]:
    inter = [r for r in workload if r.sla_class == "interactive"]
    batch = [r for r in workload if r.sla_class == "batch"]
    steps = [float(r.first_step - r.arrival_step + 1) for r in inter]
    secs = [r.ttft_s for r in inter]
    batch_tokens = sum(r.num_tokens for r in batch)
    batch_s = max((r.finish_time for r in batch), default=run["start"]) - run["start"]
    return {
        "interactive_ttft_steps": {"p50": percentile(steps, 50), "p99": percentile(steps, 99),
                                   "max": max(steps, default=math.nan)},
        "interactive_ttft_s": {"p50": percentile(secs, 50), "p99": percentile(secs, 99),
                               "max": max(secs, default=math.nan)},
        "batch_output_tokens": batch_tokens,
        "batch_s": batch_s,
        "batch_steps": max((r.finish_step for r in batch), default=-1) + 1,
        "batch_output_tokens_per_s": batch_tokens / batch_s if batch_s > 0 else math.nan,
        "num_steps": run["num_steps"],
        "elapsed_s": run["elapsed_s"],
        "num_preemptions": run["num_preemptions"],
        "preemptions_by_class": run["preemptions_by_class"],
        "valid": all(r.num_tokens == r.num_output for r in workload),
    }


def run_policy(
    args: argparse.Namespace, policy: str, workload: list[_Req] | None
) -> tuple[dict[str, Any], list[_Req]]:
    """Load an engine with `policy`, build the workload if not given (from its tokenizer),
    run it; (summary, the workload with its measurements)."""
    engine = _engine(args, policy)
    if workload is None:
        workload = build_workload(args, engine.tokenizer)
    fresh = [_Req(r.req_id, r.sla_class, r.prompt, r.num_output, r.arrival_step)
             for r in workload]
    _warm_up(engine, fresh[0].prompt)
    run = simulate(engine, fresh, args.batch_priority)
    del engine
    gc.collect()
    return {"policy": policy, **summarize(fresh, run)}, fresh


def compare(fcfs: dict[str, Any], prio: dict[str, Any]) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return {
        "ttft_p99_fcfs_over_priority_steps": ratio(fcfs["interactive_ttft_steps"]["p99"],
                                                   prio["interactive_ttft_steps"]["p99"]),
        "ttft_p99_fcfs_over_priority_s": ratio(fcfs["interactive_ttft_s"]["p99"],
                                               prio["interactive_ttft_s"]["p99"]),
        "batch_throughput_lost_pct": 100 * (1 - ratio(prio["batch_output_tokens_per_s"],
                                                      fcfs["batch_output_tokens_per_s"])),
        "batch_throughput_lost_pct_steps": 100 * (1 - ratio(fcfs["batch_steps"],
                                                            prio["batch_steps"])),
    }


def print_report(results: list[dict[str, Any]], cmp: dict[str, float]) -> None:
    print(f"{'':<10}{'interactive TTFT (steps)':>25}{'interactive TTFT (s)':>26}"
          f"{'batch job':>18}")
    print(f"{'policy':<10}{'p50':>9}{'p99':>8}{'max':>8}{'p50':>10}{'p99':>8}{'max':>8}"
          f"{'out tok/s':>13}{'steps':>8}  preemptions")
    for r in results:
        st, s = r["interactive_ttft_steps"], r["interactive_ttft_s"]
        pre = ", ".join(f"{c} {n}" for c, n in sorted(r["preemptions_by_class"].items()))
        note = "" if r["valid"] else "  INVALID: output token count differs"
        print(f"{r['policy']:<10}{st['p50']:>9.1f}{st['p99']:>8.1f}{st['max']:>8.0f}"
              f"{s['p50']:>10.3f}{s['p99']:>8.3f}{s['max']:>8.3f}"
              f"{r['batch_output_tokens_per_s']:>13.1f}{r['batch_steps']:>8}  "
              f"{r['num_preemptions']}{f' ({pre})' if pre else ''}{note}")
    print(f"interactive TTFT p99, fcfs / priority: "
          f"{cmp['ttft_p99_fcfs_over_priority_steps']:.1f}x in steps, "
          f"{cmp['ttft_p99_fcfs_over_priority_s']:.1f}x in seconds")
    print(f"batch throughput lost under priority: {cmp['batch_throughput_lost_pct']:.1f}% "
          f"(out tok/s), {cmp['batch_throughput_lost_pct_steps']:.1f}% (steps to finish it)")


def run_mixed_sla(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_batch", "num_interactive", "batch_input_len", "batch_output_len",
                 "interactive_input_len", "interactive_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.interactive_rate > 0:
        raise ValueError("--interactive-rate must be > 0")
    machine = describe_machine()
    print(f"machine : {machine_line(machine)}")
    print(f"model   : {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}, {args.dtype}")
    print(f"workload: batch job {args.num_batch} x ({args.batch_input_len} in, "
          f"{args.batch_output_len} out), priority {args.batch_priority}, all at step 0; "
          f"interactive {args.num_interactive} x ({args.interactive_input_len} in, "
          f"{args.interactive_output_len} out), Poisson {args.interactive_rate}/step; "
          f"greedy, ignore_eos, seed {args.seed}")
    print(f"engine  : max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, KV blocks {args.num_kv_blocks or 'default'}, "
          f"preemption {args.preemption_mode}, aging {args.aging_interval_s} s", flush=True)
    results, workload = [], None
    for policy in POLICIES:
        print(f"-- running {policy} ...", flush=True)
        result, workload = run_policy(args, policy, workload)
        results.append(result)
    cmp = compare(*results)
    print_report(results, cmp)
    setup = {k: v for k, v in vars(args).items() if k != "func"}
    setup["aging_interval_s"] = str(args.aging_interval_s)  # NOTE: inf is not JSON
    report = {"setup": {**setup, "machine": machine,
                        "interactive_arrival_steps": [r.arrival_step for r in workload
                                                      if r.sla_class == "interactive"]},
              "results": results, "comparison": cmp}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report
