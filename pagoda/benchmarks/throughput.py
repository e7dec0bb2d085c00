"""`pagoda bench throughput`: offline throughput of pagoda against its peers, one run.

Every system gets the same seeded workload (random prompt token ids, output lengths that
are forced with `ignore_eos`, greedy): pagoda's `LLM.generate`, transformers `generate`
with static batches (`hf_baseline.py`), and vLLM's CPU build when its interpreter exists
(`vllm_peer.py`). Model loading and a tiny warm-up stay out of every timing. The machine's
roofline (`roofline.py`) says how close to the best possible each system came.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagoda.benchmarks import workload as wl_mod
from pagoda.benchmarks.hf_baseline import (
    ModelSource,
    load_config,
    load_tokenizer,
    resolve_model,
    run_hf,
)
from pagoda.benchmarks.workload import Workload, make_workload, workload_stats

SYSTEMS = ("pagoda", "transformers", "vllm")


def _int_pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return (int(lo), int(hi or lo))


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagoda bench throughput`; names follow vLLM's where they mean the same."""
    from pagoda.config import SchedulerConfig

    sched = SchedulerConfig()
    p = parser
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"default {wl_mod.DEFAULT_NUM_REQUESTS} ({wl_mod.QUICK_NUM_REQUESTS} with --quick)",
    )
    p.add_argument(
        "--input-len",
        type=_int_pair,
        default=None,
        metavar="MIN,MAX",
        help="prompt lengths, uniform and inclusive (default 100,1024; quick 32,128)",
    )
    p.add_argument(
        "--output-len",
        type=_int_pair,
        default=None,
        metavar="MIN,MAX",
        help="output lengths (default 100,1024; quick 32,128)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small smoke-sized workload")
    p.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV cache size for vLLM (VLLM_CPU_KVCACHE_SPACE) and pagoda",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--hf-batch-sizes",
        type=_int_list,
        default=[8, 16, 32],
        help="static batch sizes to try for transformers; the best is reported",
    )
    p.add_argument(
        "--hf-max-requests",
        type=int,
        default=64,
        help="run transformers on only the first N requests (0 = all); tokens/s "
        "is then measured on that subsample",
    )
    p.add_argument(
        "--hf-sort-by-length",
        action="store_true",
        help="batch transformers requests sorted by prompt length (less padding)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vllm-cpu installed (default: $PAGODA_VLLM_PYTHON "
        "or /work/peers/vllm/bin/python)",
    )
    p.add_argument("--vllm-timeout", type=float, default=1800.0)
    p.add_argument(
        "--no-vllm-preload",
        action="store_true",
        help="do not LD_PRELOAD tcmalloc and libiomp5 into vLLM",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for pagoda and transformers, and the cores vLLM binds "
        "(default: torch's own choice, all cores)",
    )
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    p.add_argument("--output-json", default=None, help="write setup and results here")


def _apply_quick(args: argparse.Namespace) -> None:
    quick = args.quick
    if args.num_requests is None:
        args.num_requests = wl_mod.QUICK_NUM_REQUESTS if quick else wl_mod.DEFAULT_NUM_REQUESTS
    if args.input_len is None:
        args.input_len = wl_mod.QUICK_INPUT_LEN if quick else wl_mod.DEFAULT_INPUT_LEN
    if args.output_len is None:
        args.output_len = wl_mod.QUICK_OUTPUT_LEN if quick else wl_mod.DEFAULT_OUTPUT_LEN
    if quick and args.hf_batch_sizes == [8, 16, 32]:
        args.hf_batch_sizes = [16]


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, library versions, threads."""
    import torch
    import transformers

    cpu, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem_gib = None
    if hasattr(os, "sysconf"):
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": sorted(
            f
            for f in flags
            if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}
        ),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }


def run_pagoda(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Time pagoda's `LLM.generate` over the workload (load and warm-up excluded)."""
    from pagoda import LLM, SamplingParams

    engine_kwargs = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_gib << 30,
        "seed": 0,
    }
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine_kwargs)
    load_s = time.perf_counter() - start
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": workload[0][0][:16]}], warm, use_tqdm=False)

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del llm
    gc.collect()

    counts = [len(out.outputs[0].token_ids) for out in outputs]
    num_output = sum(counts)
    num_short = sum(c != o for c, (_, o) in zip(counts, workload, strict=True))
    num_prompt = sum(len(p) for p, _ in workload)
    return {
        "system": "pagoda",
        "engine_kwargs": engine_kwargs,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_output_tokens": num_output,
        "num_short_requests": num_short,
        "output_tokens_per_s": num_output / elapsed,
        "requests_per_s": len(workload) / elapsed,
        "total_tokens_per_s": (num_output + num_prompt) / elapsed,
        "valid": num_output == sum(o for _, o in workload) and num_short == 0,
    }


def run_vllm_system(
    workload: Workload, src: ModelSource, args: argparse.Namespace
) -> dict[str, Any]:
    from pagoda.benchmarks.vllm_peer import default_vllm_python, prepare_hf_dir, run_vllm

    python = args.vllm_python or default_vllm_python()
    if python is None or not Path(python).exists():
        return {"system": "vllm", "skipped": "no vLLM interpreter (--vllm-python)", "valid": False}
    model_dir = prepare_hf_dir(src, args.dtype)
    return run_vllm(
        workload,
        model_dir,
        args.dtype,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        python,
        timeout_s=args.vllm_timeout,
        kv_space_gib=args.kv_cache_gib,
        threads_bind=f"0-{args.threads - 1}" if args.threads else None,
        preload=not args.no_vllm_preload,
    )


def run_roofline(workload: Workload, config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Measure the machine, then bound this workload's time (see roofline.py's docstring)."""
    from pagoda.benchmarks import roofline as rl

    shape = rl.shape_from_hf_config(config)
    limits, details = rl.measure_machine(args.dtype, shape, quick=args.quick)
    concurrency = min(args.max_num_seqs, len(workload))
    estimate = rl.roofline(
        [(len(p), o) for p, o in workload],
        shape,
        limits,
        rl.DTYPE_BYTES[args.dtype],
        concurrency,
        args.max_num_batched_tokens,
    )
    return {
        "shape": {**asdict(shape), "num_params": shape.num_params},
        "limits": asdict(limits),
        "measurements": details,
        "concurrency": concurrency,
        "estimate": estimate.to_dict(),
    }


def _fmt_rate(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}"


def _fmt_ratio(num: float | None, den: float | None) -> str:
    return "-" if not num or not den else f"{num / den:.2f}x"


def print_setup(setup: dict[str, Any]) -> None:
    m, w = setup["machine"], setup["workload"]
    print("== pagoda bench throughput: setup ==")
    print(
        f"machine : {m['cpu']}, {m['num_cpus']} CPUs ({m['cpus_usable']} usable), "
        f"{m['memory_gib']} GiB, ISA {' '.join(m['isa']) or '-'}"
    )
    print(
        f"software: python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m['transformers']}"
    )
    print(f"model   : {setup['model']}  dtype {setup['dtype']}")
    print(
        f"workload: {w['num_requests']} requests, seed {setup['seed']}, prompt len "
        f"{setup['input_len'][0]}..{setup['input_len'][1]} (actual {w['min_prompt_len']}.."
        f"{w['max_prompt_len']}, {w['num_prompt_tokens']:,} tokens), output len "
        f"{setup['output_len'][0]}..{setup['output_len'][1]} ({w['num_output_tokens']:,} "
        "tokens), greedy, ignore_eos"
    )
    e = setup["engine"]
    print(
        f"engine  : max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens "
        f"{e['max_num_batched_tokens']}, kv cache {e['kv_cache_gib']} GiB"
    )
    order = "sorted by length" if setup["hf_sort"] else "arrival order"
    print(
        f"peers   : transformers static batches {setup['hf_batch_sizes']} on "
        f"{setup['hf_num_requests']} requests ({order}); "
        f"vLLM via {setup['vllm_python'] or '(none)'}",
        flush=True,
    )


def print_roofline(roof: dict[str, Any]) -> None:
    d, est = roof["measurements"], roof["estimate"]
    mm = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in d["matmul_2048"].items())
    shapes = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in d["model_shapes"].items())
    print("== roofline ==")
    print(f"matmul 2048^3 GFLOP/s: {mm}; model shapes (M x K x N): {shapes}")
    print(
        f"read bandwidth: {d['read_bandwidth'] / 1e9:.1f} GB/s; params "
        f"{roof['shape']['num_params']:,}"
    )
    c = est["cost"]
    print(
        f"bound ({est['bound']}): {est['time_s']:.2f} s = "
        f"{est['output_tokens_per_s']:,.0f} output tok/s; compute {est['compute_s']:.2f} s "
        f"({c['total_flops'] / 1e12:.2f} TFLOP), memory {est['memory_s']:.2f} s "
        f"({c['total_bytes'] / 1e9:.1f} GB over >= {c['num_steps']} steps at concurrency "
        f"{roof['concurrency']})"
    )
    print(
        f"single-request decode floor: {est['single_stream_s_per_token'] * 1e3:.2f} ms/token "
        f"= {est['single_stream_tokens_per_s']:,.0f} tok/s",
        flush=True,
    )


def print_table(results: dict[str, dict[str, Any]], roof: dict[str, Any] | None) -> None:
    hf = results.get("transformers", {}).get("output_tokens_per_s")
    vl = results.get("vllm", {}).get("output_tokens_per_s")
    bound = roof["estimate"]["output_tokens_per_s"] if roof else None
    header = (
        f"{'system':<14}{'out tok/s':>11}{'req/s':>9}{'total tok/s':>13}"
        f"{'vs transformers':>17}{'vs vLLM':>9}{'roofline':>10}"
    )
    print("== results ==")
    print(header)
    for name, r in results.items():
        if "output_tokens_per_s" not in r:
            print(f"{name:<14}  {r.get('skipped') or r.get('error') or 'no result'}")
            continue
        tps = r["output_tokens_per_s"]
        frac = f"{tps / bound:.1%}" if bound else "-"
        note = "" if r.get("valid") else "  INVALID: output token count differs"
        if r.get("subsampled"):
            note += f"  (first {r['num_requests_run']} requests, batch {r['best_batch_size']})"
        elif name == "transformers":
            note += f"  (batch {r['best_batch_size']})"
        print(
            f"{name:<14}{_fmt_rate(tps):>11}{r['requests_per_s']:>9.2f}"
            f"{_fmt_rate(r['total_tokens_per_s']):>13}{_fmt_ratio(tps, hf):>17}"
            f"{_fmt_ratio(tps, vl):>9}{frac:>10}{note}"
        )


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark that `args` describe; print setup and table; return everything."""
    _apply_quick(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    src = resolve_model(args.model)
    tokenizer, config = load_tokenizer(src), load_config(src)
    workload = make_workload(
        args.num_requests, args.input_len, args.output_len, args.seed, tokenizer=tokenizer
    )
    hf_workload = workload[: args.hf_max_requests] if args.hf_max_requests else workload
    from pagoda.benchmarks.vllm_peer import default_vllm_python

    setup = {
        "machine": machine_info(),
        "model": src.label,
        "dtype": args.dtype,
        "seed": args.seed,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "workload": asdict(workload_stats(workload)),
        "engine": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gib": args.kv_cache_gib,
        },
        "systems": systems,
        "hf_batch_sizes": args.hf_batch_sizes,
        "hf_num_requests": len(hf_workload),
        "hf_sort": args.hf_sort_by_length,
        "vllm_python": (args.vllm_python or default_vllm_python()) if "vllm" in systems else None,
    }
    print_setup(setup)
    # NOTE: the machine is measured first, while no model holds memory or threads.
    roof = None if args.no_roofline else run_roofline(workload, config, args)
    if roof:
        print_roofline(roof)

    results: dict[str, dict[str, Any]] = {}
    for name in systems:
        print(f"-- running {name} ...", flush=True)
        if name == "pagoda":
            results[name] = run_pagoda(workload, args)
        elif name == "transformers":
            results[name] = run_hf(
                hf_workload,
                src,
                args.dtype,
                args.hf_batch_sizes,
                sort_by_length=args.hf_sort_by_length,
            )
            results[name]["subsampled"] = len(hf_workload) < len(workload)
        else:
            results[name] = run_vllm_system(workload, src, args)
        if "error" in results[name]:
            print(f"   {name} failed: {results[name]['error']}\n{results[name]['log_tail']}")
    print_table(results, roof)
    report = {"setup": setup, "roofline": roof, "results": results}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench throughput", description=__doc__)
    add_throughput_args(parser)
    report = run_throughput(parser.parse_args(argv))
    ran = [r for r in report["results"].values() if "output_tokens_per_s" in r]
    return 0 if all(r["valid"] for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
