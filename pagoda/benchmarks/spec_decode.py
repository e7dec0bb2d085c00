"""`pagoda bench spec`: speculative decoding against no speculation, in the same run.

Workloads (benchmarks/spec_workload.py, through the model's chat template): (a) grounded,
answers that copy long spans of the prompt (repeat, correct, rename, quote); (b) open chat.
Each at concurrency 1, 4 and 16 (closed loop: max_num_seqs = concurrency, twice as many
requests), greedy, bf16 by default. Configurations: speculation off, ngram with the adaptive
rule and with fixed k, the quantized self-draft (`--self-draft rtn gptq`, each adaptive and
with fixed k; `--self-draft-layers N`: also a draft of the target's first N layers), a
draft model when `--draft-model` is given (the same two), and vLLM's CPU build off and
with its n-gram speculation when its interpreter is there (benchmarks/spec_vllm.py).

pagoda's configurations of one concurrency run in turn, `--rounds` times (3), the order
rotated each round; a row's tok/s is the median of its rounds and its speedup the median of
its ratios to the off run beside it (the machine drifts more between minutes than the
methods differ). Reported per row: output tokens/s, speedup over the same system's off,
acceptance rate (accepted / draft tokens), mean accepted length (tokens per verification:
1 + accepted / verifications), and whether the greedy output equals the same system's
speculation off (in every round); for the self-draft the weight bytes its quantized copy adds to the target's. Every decode
step is recorded for the adaptive rule's cost model (benchmarks/spec_cost.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pagoda.benchmarks.roofline import describe_machine, machine_line
from pagoda.benchmarks.spec_cost import StepRecorder, fit_costs, print_costs
from pagoda.benchmarks.spec_workload import WORKLOADS
from pagoda.benchmarks.workload import rotated


def add_spec_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded)")
    p.add_argument("--draft-model", default=None, help="also run method draft_model with it")
    p.add_argument("--self-draft", nargs="*", default=["rtn"], choices=["rtn", "gptq"],
                   help="quantized_self_draft rows, by quantization (none: no rows)")
    p.add_argument("--self-draft-layers", nargs="*", type=int, default=[],
                   help="also self-draft rows whose draft is the target's first N layers")
    p.add_argument("--calib-data", default="calib", help="the gptq self-draft's text")
    p.add_argument("--vllm-python", default=None,
                   help="vLLM's interpreter (default: the conventional venvs; '' skips vLLM)")
    p.add_argument("--configs", nargs="+", default=None,
                   help="run only these pagoda configurations (off always runs)")
    p.add_argument("--vllm-only", action="store_true", help="run only the vLLM rows")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV cache space")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3,
                   help="pagoda's configurations run in turn, this many times each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write setup and results here")


def _configs(args: argparse.Namespace) -> dict[str, dict | None]:
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    configs: dict[str, dict | None] = {"off": None, "ngram": ngram,
                                       "ngram fixed k": {**ngram, "adaptive": False}}
    for quantization in args.self_draft:
        spec = {"method": "quantized_self_draft", "num_speculative_tokens": k,
                "quantization": quantization}
        if quantization == "gptq":
            spec["calib_data"] = args.calib_data
        configs[f"self-draft {quantization}"] = spec
        configs[f"self-draft {quantization} fixed k"] = {**spec, "adaptive": False}
        for n in getattr(args, "self_draft_layers", []):
            shallow = {**spec, "num_layers": n}
            configs[f"self-draft {quantization} {n}L"] = shallow
            configs[f"self-draft {quantization} {n}L fixed k"] = {**shallow, "adaptive": False}
    if args.draft_model:
        configs["draft_model"] = spec = {"method": "draft_model", "model": args.draft_model,
                                         "num_speculative_tokens": k}
        configs["draft_model fixed k"] = {**spec, "adaptive": False}
    wanted = getattr(args, "configs", None)
    if wanted:
        unknown = sorted(set(wanted) - set(configs))
        if unknown:
            raise ValueError(f"--configs: unknown {unknown}; known: {list(configs)}")
        configs = {n: c for n, c in configs.items() if n == "off" or n in wanted}
    return configs


def _run(llm: Any, prompts: list[list[int]], max_tokens: int,
         recorder: StepRecorder | None = None) -> dict:
    """All prompts through the engine, step by step: outputs, time, spec-decode counters."""
    from pagoda import SamplingParams

    engine = llm.llm_engine
    before = engine.scheduler.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if recorder is not None:
            recorder.finish_step(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    after = engine.scheduler.get_stats()
    num_out = sum(len(t) for t in outputs.values())
    return {
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
        "output_tokens": num_out, "elapsed_s": elapsed, "tok_per_s": num_out / elapsed,
        **{name: getattr(after, f"spec_decode_{name}") - getattr(before, f"spec_decode_{name}")
           for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
    }


def _summarise(rounds: list[dict]) -> dict:
    """One configuration's rounds as one row: the median tok/s, the counters summed, the
    first round's outputs (every round must give the same: greedy, one engine)."""
    drafts = sum(r["num_drafts"] for r in rounds)
    draft_tokens = sum(r["num_draft_tokens"] for r in rounds)
    accepted = sum(r["num_accepted_tokens"] for r in rounds)
    return {
        "outputs": rounds[0]["outputs"],
        "rounds_agree": all(r["outputs"] == rounds[0]["outputs"] for r in rounds),
        "output_tokens": rounds[0]["output_tokens"],
        "tok_per_s": statistics.median(r["tok_per_s"] for r in rounds),
        "tok_per_s_rounds": [r["tok_per_s"] for r in rounds],
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_len": 1 + accepted / drafts if drafts else None,
    }


def _prompts(tok: Any, workload: str, concurrency: int) -> list[list[int]]:
    from pagoda.entrypoints.chat_template import apply_chat_template

    texts = WORKLOADS[workload]
    return [apply_chat_template(tok, [{"role": "user", "content": t}])
            for t in (texts * (2 * concurrency // len(texts) + 1))[: 2 * concurrency]]


def _draft_bytes(llm: Any) -> dict[str, int] | None:
    from pagoda.benchmarks.quant import weight_bytes
    from pagoda.spec_decode.self_draft import QuantizedSelfDraftProposer, draft_extra_weight_bytes

    worker = llm.llm_engine.executor.worker
    proposer = worker.runner.proposer
    if not isinstance(proposer, QuantizedSelfDraftProposer):
        return None
    return {"target": weight_bytes(worker.model),
            "draft_extra": draft_extra_weight_bytes(proposer.model, worker.model)}


# NOTE: every configuration's engine of one concurrency is alive at once (so that their
# rounds can alternate); a small pool each keeps that in RAM. Concurrency 16 holds
# 32 x ~700 tokens at most, ~0.5 GiB for SmolLM2.
_KV_BYTES_PER_ENGINE = 1 << 30


def _pagoda_runs(args: argparse.Namespace, records: list,
                 prompts: dict[tuple[str, int], list[list[int]]]) -> list[dict]:
    """Every pagoda configuration's runs; fills `prompts` (by workload and concurrency)
    and `records` (the decode steps).

    Per concurrency, every configuration's engine is built, then `args.rounds` rounds run
    each workload on each engine in turn, the order rotated each round: this machine drifts
    by 20% within minutes, so configurations run one after another would compare moments
    rather than methods. Each row's tok/s is the median of its rounds, and its speedup the
    median of its per-round ratios to off (measured next to it)."""
    from pagoda import LLM

    runs = []
    configs = _configs(args)
    for c in args.concurrency:
        engines: dict[str, tuple[Any, StepRecorder, dict]] = {}
        for name, spec in configs.items():
            llm = LLM(args.model, dtype=args.dtype, max_num_seqs=c, seed=args.seed,
                      speculative_config=spec, kv_cache_memory_bytes=_KV_BYTES_PER_ENGINE)
            tok = llm.get_tokenizer()
            # NOTE: a warm-up request first: the first steps pay one-off costs.
            _run(llm, _prompts(tok, args.workloads[0], 1)[:1], 8)
            extra = {"weight_bytes": b} if (b := _draft_bytes(llm)) else {}
            engines[name] = (llm, StepRecorder(llm.llm_engine, name), extra)
        names = list(engines)
        for workload in args.workloads:
            batch = prompts.setdefault((workload, c), _prompts(tok, workload, c))
            rounds: dict[str, list[dict]] = {name: [] for name in names}
            for i in range(args.rounds):
                for name in rotated(names, i):
                    llm, recorder, _ = engines[name]
                    rounds[name].append(_run(llm, batch, args.max_tokens, recorder))
            off = [r["tok_per_s"] for r in rounds["off"]]
            for name in names:
                row = _summarise(rounds[name])
                row["speedup_rounds"] = [r["tok_per_s"] / o for r, o in zip(rounds[name], off)]
                runs.append({"system": "pagoda", "config": name, "concurrency": c,
                             "workload": workload, **row, **engines[name][2]})
                print(f"  done: {name}, concurrency {c}, {workload}: "
                      f"{row['tok_per_s']:.1f} tok/s (rounds "
                      + " ".join(f"{t:.0f}" for t in row["tok_per_s_rounds"]) + ")", flush=True)
        for name in names:
            engines[name][1].restore()
            records += engines[name][1].records
        del engines, llm
        gc.collect()
    return runs


def _vllm_runs(args: argparse.Namespace,
               prompts: dict[tuple[str, int], list[list[int]]]) -> list[dict]:
    from pagoda.benchmarks.hf_baseline import load_tokenizer, resolve_model
    from pagoda.benchmarks.spec_vllm import run_vllm_spec, vllm_configs
    from pagoda.benchmarks.vllm_peer import default_vllm_python, prepare_hf_dir
    from pagoda.config import EngineArgs

    python = default_vllm_python() if args.vllm_python is None else args.vllm_python
    if not python or not Path(python).exists():
        print("  vLLM: no interpreter (--vllm-python), skipped")
        return []
    src = resolve_model(args.model)
    model_dir = prepare_hf_dir(src, args.dtype)
    tok = None
    for c in args.concurrency:
        for w in args.workloads:
            if (w, c) not in prompts:  # NOTE: --vllm-only: no pagoda run made them
                tok = tok or load_tokenizer(src)
                prompts[(w, c)] = _prompts(tok, w, c)
    workloads = {c: {w: prompts[(w, c)] for w in args.workloads} for c in args.concurrency}
    runs = []
    for name, spec in vllm_configs(args.num_speculative_tokens).items():
        print(f"  vLLM {name}: starting its engine", flush=True)
        result = run_vllm_spec(workloads, args.max_tokens, EngineArgs().max_num_batched_tokens,
                               spec, model_dir, args.dtype, python,
                               kv_space_gib=args.vllm_kv_gib)
        if "error" in result:
            print(f"  vLLM {name}: {result['error']}\n{result['log_tail'][-800:]}", flush=True)
            continue
        print(f"  vLLM {name}: engine built in {result['load_s']:.0f} s", flush=True)
        for c, by_workload in result["runs"].items():
            for workload, r in by_workload.items():
                counters = r.pop("counters")
                drafts = counters.get("num_drafts")
                draft_tokens = counters.get("num_draft_tokens")
                accepted = counters.get("num_accepted_tokens")
                runs.append({"system": "vllm", "config": name, "concurrency": c,
                             "workload": workload, **r, "vllm_load_s": result["load_s"],
                             "acceptance": accepted / draft_tokens if draft_tokens else None,
                             "mean_accepted_len": 1 + accepted / drafts if drafts else None})
                print(f"  done: {name}, concurrency {c}, {workload}: "
                      f"{r['tok_per_s']:.1f} tok/s", flush=True)
    return runs


def run_spec_decode(args: argparse.Namespace) -> dict:
    machine = describe_machine()
    print(f"machine: {machine_line(machine)}")
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct (GGUF)'}  dtype: {args.dtype}"
          f"  greedy, max_tokens {args.max_tokens}  k = {args.num_speculative_tokens}  "
          f"concurrency {args.concurrency} (2x as many requests)  seed {args.seed}")
    records: list = []
    prompts: dict[tuple[str, int], list[list[int]]] = {}
    # NOTE: vLLM first: its engines' start (minutes here) is the part a busy machine
    # stretches most, and its rows need only the prompts.
    runs = _vllm_runs(args, prompts)
    if not args.vllm_only:
        runs += _pagoda_runs(args, records, prompts)
    off = {(r["workload"], r["concurrency"]): r for r in runs if r["config"] == "off"}
    vllm_off = {(r["workload"], r["concurrency"]): r for r in runs if r["config"] == "vllm off"}
    for r in runs:
        key = (r["workload"], r["concurrency"])
        base = (vllm_off if r["system"] == "vllm" else off).get(key)
        if "speedup_rounds" in r:
            r["speedup"] = statistics.median(r["speedup_rounds"])
        else:
            r["speedup"] = r["tok_per_s"] / base["tok_per_s"] if base else None
        r["same_output"] = (r["outputs"] == base["outputs"]
                            and r.get("rounds_agree", True)) if base else None
    _print(runs)
    fit = fit_costs(records)
    print_costs(fit)
    for r in runs:
        del r["outputs"]
    setup = {k: v for k, v in vars(args).items() if k != "func"}
    report = {"setup": {**setup, "machine": machine}, "runs": runs, "cost_model": fit}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output_json}")
    return report


def _print(runs: list[dict]) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'workload':<10}{'conc':>5} {'config':<24}{'tok/s':>8}{'speedup':>9}"
          f"{'accept':>8}{'mean len':>9}{'same output':>13}  speedup by round")
    for r in sorted(runs, key=lambda r: (r["workload"], r["concurrency"])):
        same = {True: "yes", False: "NO", None: "-"}[r["same_output"]]
        print(f"{r['workload']:<10}{r['concurrency']:>5} {r['config']:<24}"
              f"{r['tok_per_s']:>8.1f}{fmt(r['speedup'], '.2f'):>8}x"
              f"{fmt(r['acceptance'], '.2f'):>8}{fmt(r['mean_accepted_len'], '.2f'):>9}"
              f"{same:>13}  " + " ".join(f"{x:.2f}" for x in r.get("speedup_rounds", ())))
    shown = set()
    for r in runs:
        if "weight_bytes" in r and r["config"] not in shown:
            shown.add(r["config"])
            b = r["weight_bytes"]
            print(f"{r['config']}: the draft adds {b['draft_extra'] / 2**20:.1f} MiB of "
                  f"weights to the target's {b['target'] / 2**20:.1f} MiB")
