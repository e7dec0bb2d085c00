"""Single-stream decode with quantized weights (the `--decode` part of `pagoda bench
kernels`): a llama GGUF dequantized to bf16 at load against its blocks run natively
(`gguf_native="on"`: the linears and a tied head through gguf_linear), optionally a
group-wise int4 directory (GPTQ / AWQ / RTN, `--wq-model`), and llama.cpp on the same GGUF
in its own interpreter.

The pagoda engines live side by side in one process and are measured in turns with
llama.cpp (a run of each, llama.cpp in its own process, `repeats` times; the fastest of
each), so a change of load on the shared machine hits them alike. `--throughput` adds each
pagoda engine's offline tok/s on `bench throughput --quick`'s workload to the same turns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def pagoda_decode_ms(llm, tokens: int) -> float:
    """One run: (time of 1 + tokens greedy tokens - time of 1 token) / tokens."""
    from pagoda.sampling_params import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([PROMPT], first, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([PROMPT], full, use_tqdm=False)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / tokens * 1e3


_LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, prompt, tokens, repeats, threads = sys.argv[1:6]
tokens, repeats, threads = int(tokens), int(repeats), int(threads)
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=False)
best = float("inf")
for _ in range(repeats):
    llm.reset()
    t0 = time.perf_counter()
    for i, _tok in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
        if i == 0:
            t1 = time.perf_counter()
        if i == tokens:
            break
    best = min(best, (time.perf_counter() - t1) / tokens)
print(json.dumps({"ms_per_token": best * 1e3}))
"""


def llama_cpp_decode_ms(python: str, path: Path, tokens: int, repeats: int) -> float:
    out = subprocess.run(
        [python, "-c", _LLAMA_SCRIPT, str(path), PROMPT, str(tokens), str(repeats),
         str(torch.get_num_threads())],
        capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])["ms_per_token"]


def pagoda_throughput(llm, workload: list[tuple[list[int], int]]) -> float:
    """Output tokens/s of one offline `generate` of the whole workload (greedy, ignore_eos)."""
    from pagoda.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
              for _, n in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _engines(args: argparse.Namespace, path: Path) -> dict:
    from pagoda.llm import LLM

    common = {"dtype": "bfloat16", "max_model_len": 1024, "seed": 0,
              "kv_cache_memory_bytes": (1 << 30) if args.throughput else 64 << 20}
    engines = {"bf16 (dequantized at load)": LLM(model=str(path), gguf_native="off", **common),
               "native GGUF blocks": LLM(model=str(path), gguf_native="on", **common)}
    if args.wq_model:
        engines[f"int4 {Path(args.wq_model).name}"] = LLM(model=args.wq_model, **common)
    return engines


def decode_table(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per path its ms/token (the fastest of `repeats` runs, the engines and llama.cpp in
    turns) and, with `--throughput`, its best offline tok/s on `bench throughput --quick`'s
    workload (measured in the same turns)."""
    from pagoda.benchmarks import workload as wl
    from pagoda.models.loader import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    engines = _engines(args, path)
    names = [*engines, *(["llama.cpp"] if args.llama_python else [])]
    result = {"ms_per_token": dict.fromkeys(names, float("inf"))}
    if args.throughput:
        result["throughput_tok_s"] = dict.fromkeys(engines, 0.0)
        tokenizer = next(iter(engines.values())).llm_engine.tokenizer
        workload = wl.make_workload(wl.QUICK_NUM_REQUESTS, wl.QUICK_INPUT_LEN,
                                    wl.QUICK_OUTPUT_LEN, seed=0, tokenizer=tokenizer)
    ms, tput = result["ms_per_token"], result.get("throughput_tok_s")
    for _ in range(args.repeats):
        for name, llm in engines.items():
            ms[name] = min(ms[name], pagoda_decode_ms(llm, args.tokens))
            if tput is not None:
                tput[name] = max(tput[name], pagoda_throughput(llm, workload))
        if args.llama_python:
            ms["llama.cpp"] = min(ms["llama.cpp"], llama_cpp_decode_ms(
                args.llama_python, path, args.tokens, 1))
    return result
