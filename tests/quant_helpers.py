"""Quantized checkpoints built in the tests from a tiny dense model, by each format's own
packing rules, plus the dense checkpoint of their reference-dequantized weights (the
transformers oracle loads that one)."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 8


def is_linear(name: str, head: bool = False) -> bool:
    """A decoder linear's weight (and, with `head`, the LM head's)."""
    if head and name == "lm_head.weight":
        return True
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LINEAR_NAMES and parts[-1] == "weight"


def rtn_groups(
    w: torch.Tensor, bits: int, group_of: torch.Tensor, groups: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes [N, K], scales [N, G] (float16) and integer zeros [N, G] for
    the groups `group_of[k]`; the scales are rounded to float16 before use, as the files
    store them."""
    maxq = (1 << bits) - 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups)
    for g in range(groups):
        cols = w[:, group_of == g]
        if sym:
            scales[:, g] = cols.abs().amax(dim=1).clamp(min=1e-5) * 2 / maxq
            zeros[:, g] = (maxq + 1) // 2
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scales[:, g] = ((hi - lo) / maxq).clamp(min=1e-5)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, maxq)
    scales = scales.to(torch.float16)
    s = scales.float()[:, group_of]
    codes = torch.clamp(torch.round(w / s) + zeros[:, group_of], 0, maxq).to(torch.int64)
    return codes, scales, zeros.to(torch.int64)


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_of: torch.Tensor
) -> torch.Tensor:
    """(q - zero) * scale in float32, per column's group: the reference dequantization."""
    return (codes.float() - zeros.float()[:, group_of]) * scales.float()[:, group_of]


def group_assignment(k: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """Each input column's group: k // group_size, or (act_order) a random permutation of
    that (GPTQ's g_idx under desc_act)."""
    group_of = torch.arange(k) // group_size
    if act_order:
        order = list(range(k))
        random.Random(seed).shuffle(order)
        group_of = group_of[torch.argsort(torch.tensor(order))]
    return group_of


QuantizeFn = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized(
    dense_dir: Path, out_dir: Path, quant_config: dict[str, Any], quantize: QuantizeFn,
    skip: Callable[[str], bool] = lambda name: False, quantize_head: bool = False,
) -> tuple[Path, Path]:
    """From `dense_dir`, write (quantized checkpoint, dense checkpoint of its dequantized
    weights). `quantize(name, w)` -> (checkpoint tensors by suffix, dequantized weight)."""
    tensors = load_file(dense_dir / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if is_linear(name, quantize_head) and not skip(name):
            parts, w_hat = quantize(name, w.float())
            stem = name.removesuffix(".weight")
            quantized.update({f"{stem}.{suffix}": t.contiguous() for suffix, t in parts.items()})
            dequantized[name] = w_hat.contiguous()
        else:
            quantized[name] = dequantized[name] = w
    q_dir, d_dir = out_dir / "quantized", out_dir / "dequantized"
    for target, state in ((q_dir, quantized), (d_dir, dequantized)):
        shutil.copytree(dense_dir, target)
        save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir, d_dir


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
              ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, float32, exactly max_tokens each."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                return_dict_in_generate=True, output_logits=True, pad_token_id=0,
            )
        ids = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, ids)]
        results.append((ids, lps))
    return results


def pagoda_greedy(path: Path, prompts: list[list[int]], **engine_kwargs: Any) -> list:
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
    return outs


def assert_greedy_matches(quantized: Path, dense: Path, **engine_kwargs: Any) -> None:
    """pagoda on `quantized` gives transformers' float32 greedy tokens on `dense`."""
    prompts = random_prompts(3, seed=5)
    expected = hf_greedy(dense, prompts)
    outs = pagoda_greedy(quantized, prompts, **engine_kwargs)
    for i, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ids, f"request {i}"
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        for a, b in zip(got, lps):
            assert math.isclose(a, b, abs_tol=1e-3), f"request {i}: logprob {a} vs {b}"
