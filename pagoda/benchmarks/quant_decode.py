"""Single-stream decode of a llama GGUF with its quantized blocks run natively (the
`--decode` part of `pagoda bench kernels`), next to bf16 and llama.cpp.

Until the gguf quantization method loads GGUF blocks itself, `native_gguf_linears` swaps
the methods of a loaded model's linears (and the tied LM head's product) for gguf_linear on
GGUFWeight objects built from the file's raw tensors: fused qkv / gate_up concatenate their
shards' rows (GGUF rows are independent blocks), q / k rows un-permuted like the dense path.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagoda.models import gguf as gguf_model
from pagoda.ops import quant_layouts, wquant

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


class NativeGGUFLinear:
    """A linear's method that runs gguf_linear on the layer's GGUF blocks (embedding
    lookups, for a tied LM head, stay with the method it replaces)."""

    def __init__(self, weight: wquant.GGUFWeight, layer: nn.Module) -> None:
        self.weight = weight
        self.previous = layer.quant_method
        self.previous_bound = getattr(layer, "bound_apply", None)

    def install(self, layer: nn.Module, native: bool) -> None:
        """Make `layer` run this method (native) or the one it replaced."""
        layer.quant_method = self if native else self.previous
        if hasattr(layer, "bound_apply"):  # linears call their bound product when set
            layer.bound_apply = (
                functools.partial(self.apply, layer, bias=getattr(layer, "bias", None))
                if native else self.previous_bound)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return wquant.gguf_linear(x, self.weight, bias)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return self.previous.embedding(layer, input_ids)


def _raw_rows(raw: gguf_model.GGUFRawTensor) -> torch.Tensor:
    n, k = raw.shape
    values, nbytes = quant_layouts.GGUF_BLOCK[int(raw.ggml_type)]
    rows = torch.from_numpy(np.array(raw.data).reshape(n, k // values * nbytes))
    if raw.rotary_permuted_heads is not None:
        rows = gguf_model.unpermute_rotary_rows(rows, raw.rotary_permuted_heads)
    return rows


def native_gguf_linears(model: nn.Module, path: Path) -> dict[nn.Module, NativeGGUFLinear]:
    """Swap every linear of `model` whose shards are all kernel-supported GGUF types for
    gguf_linear; returns the swapped modules and their new methods (the old one is each
    method's `previous`)."""
    reader = gguf_model.open_gguf(path)
    config = gguf_model.gguf_hf_config(reader, path)
    raws = {r.name: r for r in gguf_model.iter_gguf_raw_tensors(reader, config)}
    modules = dict(model.named_modules())
    swapped: dict[nn.Module, NativeGGUFLinear] = {}
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _FUSED:
            shard_names = [f"{name.rsplit('.', 1)[0]}.{s}.weight" for s in _FUSED[leaf]]
        elif leaf == "embed_tokens" and getattr(module, "computes_logits", False):
            shard_names = [f"{name}.weight"]
        else:
            continue
        shards = [raws.get(s) for s in shard_names]
        if any(s is None or int(s.ggml_type) not in quant_layouts.GGUF_BLOCK for s in shards):
            continue
        if len({int(s.ggml_type) for s in shards}) != 1:
            continue
        rows = torch.cat([_raw_rows(s) for s in shards])
        shape = (sum(s.shape[0] for s in shards), shards[0].shape[1])
        w = wquant.GGUFWeight(rows, int(shards[0].ggml_type), shape)
        wquant.prepare("gguf_linear", w, "cpu")
        swapped[module] = method = NativeGGUFLinear(w, module)
        method.install(module, native=True)
    return swapped


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


def decode_table(args: argparse.Namespace) -> dict[str, float]:
    """The fastest of `repeats` runs of each path; the two pagoda paths alternate run by run
    (one model, its methods swapped), so a load change on the machine hits both alike."""
    from pagoda.llm import LLM
    from pagoda.models.loader import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    llm = LLM(model=str(path), max_model_len=1024)
    swapped = native_gguf_linears(llm.llm_engine.executor.worker.model, path)
    dense_name, native_name = "bf16 (dequantized at load)", f"native GGUF ({len(swapped)} linears)"
    result = {dense_name: float("inf"), native_name: float("inf")}
    for _ in range(args.repeats):
        for name, native in ((dense_name, False), (native_name, True)):
            for module, method in swapped.items():
                method.install(module, native)
            result[name] = min(result[name], pagoda_decode_ms(llm, args.tokens))
    if args.llama_python:
        result["llama.cpp"] = llama_cpp_decode_ms(args.llama_python, path, args.tokens,
                                                  args.repeats)
    return result
