"""`pagoda bench omp-policy`: decode speed under each OpenMP waiting policy, on a quiet
machine and beside a competing process, to choose omp_env.py's default by measurement.

libgomp reads its waiting policy once, when torch loads it, so every setting runs in its
own child process (this file with `--child`), with the policy variables of the parent's
environment replaced. Each child loads the engine (bf16, prefix caching off), then times
- single stream: one request's decode steps -> ms per token (mean and median step);
- batched: `--batch` requests decoding together -> output tokens/s of the decode steps.
Settings run in turn, and the whole round `--rounds` times (A B C A B C ...), so a drift of
the machine's load spreads over all of them. `--load spin` adds a process spinning on one
core (the case that collapses a spinning OpenMP team); `--load omp` a multi-threaded torch
job in a session of its own, as a separate service's job would run (Linux then shares the
cores per session, which collapsed even the short spin until the worker's team adapted,
worker/omp_team.py; the `-fixed` setting keeps the team fixed); `--load both` runs each
round without and with the spinner, `--load all` with each load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# name -> the environment that selects it (beside the engine's own setting, omp_env.py)
SETTINGS = {
    "spin-3000": {"GOMP_SPINCOUNT": "3000"},
    "spin-3000-fixed": {"GOMP_SPINCOUNT": "3000", "PAGODA_OMP_ADAPT": "0"},
    "spin-30k": {"GOMP_SPINCOUNT": "30000"},
    "spin-300k": {"GOMP_SPINCOUNT": "300000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
_POLICY_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "PAGODA_OMP_ADAPT")
LOADS = {"none": ["none"], "spin": ["spin"], "omp": ["omp"], "both": ["none", "spin"],
         "all": ["none", "spin", "omp"]}


def add_omp_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {', '.join(SETTINGS)}")
    p.add_argument("--load", choices=list(LOADS), default="both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-json", default=None)


def child_env(setting: str) -> dict[str, str]:
    """The parent's environment with the policy variables replaced by `setting`'s."""
    env = {k: v for k, v in os.environ.items() if k not in _POLICY_VARS}
    env.update(SETTINGS[setting])
    return env


def _decode_step_times(engine: Any, num: int, prompt_len: int, tokens: int) -> list[float]:
    """Seconds of each decode step of `num` fresh requests (their prefill untimed)."""
    from pagoda import SamplingParams
    from pagoda.benchmarks.workload import make_workload

    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0.0)
    work = make_workload(num, (prompt_len, prompt_len), (1, 1), 0, tokenizer=engine.tokenizer)
    for i, (prompt, _) in enumerate(work):
        engine.add_request(f"r{num}-{i}", {"prompt_token_ids": prompt}, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[:-1] or times  # NOTE: the last step only finishes stragglers


def _child(args: argparse.Namespace) -> None:
    from pagoda import LLM

    max_len = args.prompt_len + args.decode_tokens + 32
    engine = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=False,
                 max_model_len=max_len, max_num_seqs=max(args.batch, 1),
                 kv_cache_memory_bytes=512 << 20).llm_engine
    _decode_step_times(engine, 1, 16, 4)  # NOTE: warm-up (kernels, allocator)
    single = _decode_step_times(engine, 1, args.prompt_len, args.decode_tokens)
    batch = _decode_step_times(engine, args.batch, args.prompt_len, args.decode_tokens)
    print("RESULT " + json.dumps({
        "single_ms_per_token": 1000 * statistics.fmean(single),
        "single_median_ms": 1000 * statistics.median(single),
        "batch_tokens_per_s": args.batch * len(batch) / sum(batch),
        "batch_median_step_ms": 1000 * statistics.median(batch),
    }), flush=True)


def _run_child(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pagoda.benchmarks.omp_policy", "--child",
            "--decode-tokens", str(args.decode_tokens), "--batch", str(args.batch),
            "--prompt-len", str(args.prompt_len)] + (["--model", args.model] if args.model else [])
    proc = subprocess.run(argv, env=child_env(setting), capture_output=True, text=True,
                          check=False, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}


def _spinner() -> subprocess.Popen:
    """A process that keeps one core busy (pinned to the first CPU where possible)."""
    code = ("import os\ntry:\n    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "except (AttributeError, OSError):\n    pass\nwhile True:\n    pass\n")
    return subprocess.Popen([sys.executable, "-c", code])


def _omp_job() -> subprocess.Popen:
    """A torch job on every core (matmuls in a loop) in a session of its own."""
    code = ("import os, torch\ntorch.set_num_threads(os.cpu_count() or 1)\n"
            "a = torch.randn(512, 512)\nwhile True:\n    a @ a\n")
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# NOTE: looked up at call time (tests replace the two functions).
_LOAD_PROCESS = {"spin": lambda: _spinner(), "omp": lambda: _omp_job()}


def _aggregate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return {"error": samples[0]["error"] if samples else "no run"}
    return {k: statistics.median(s[k] for s in ok) for k in ok[0]} | {"num_runs": len(ok)}


def run_omp_policy(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting under every load, `rounds` times interleaved; prints the table."""
    from pagoda.cpu_features import cpu_info

    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    loads = LOADS[args.load]
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for load in loads:
            maker = _LOAD_PROCESS.get(load)
            spinner = maker() if maker is not None else None
            try:
                for setting in settings:
                    result = _run_child(setting, args)
                    print(f"-- {load} / {setting}: {json.dumps(result)[:300]}", flush=True)
                    samples.setdefault((load, setting), []).append(result)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    results = {f"{load} / {setting}": _aggregate(s) for (load, setting), s in samples.items()}
    report = {"cpu": cpu_info()[0], "num_cpus": os.cpu_count(), "batch": args.batch,
              "decode_tokens": args.decode_tokens, "rounds": args.rounds, "results": results}
    print_omp_table(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def print_omp_table(report: dict[str, Any]) -> None:
    print(f"== pagoda bench omp-policy: {report['cpu']}, {report['num_cpus']} CPUs, medians "
          f"of {report['rounds']} rounds; load spin = one extra process busy on a core, "
          f"omp = a torch job on every core in its own session ==")
    print(f"{'load / setting':<24}{'1-stream ms/tok':>16}{'median':>9}"
          f"{'batch ' + str(report['batch']) + ' tok/s':>16}{'median step ms':>16}")
    for name, r in report["results"].items():
        if "error" in r:
            print(f"{name:<24}{r['error'][:100]}")
            continue
        print(f"{name:<24}{r['single_ms_per_token']:>16.2f}{r['single_median_ms']:>9.2f}"
              f"{r['batch_tokens_per_s']:>16.1f}{r['batch_median_step_ms']:>16.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagoda bench omp-policy", description=__doc__)
    add_omp_policy_args(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
    else:
        run_omp_policy(args)


if __name__ == "__main__":
    main()
