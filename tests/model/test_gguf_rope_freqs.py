"""A GGUF with llama3 rope scaling (Llama 3.1/3.2 style: `rope_freqs.weight` plus the
llama.* rope keys, written by the gguf package as llama.cpp's converter does) loads with
those frequencies: greedy float32 output equals transformers on the same HF model with
rope_type llama3, and the rotary frequencies are the llama3 ones."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagoda import LLM, SamplingParams
from pagoda.layers.rotary import build_cos_sin
from pagoda.models.factory import build_model
from pagoda.models.loader import load_checkpoint
from tests.gguf_helpers import llama3_rope_factors, write_llama_gguf
from tests.quant_helpers import hf_greedy

# NOTE: head_dim 16 gives 8 frequencies; with these bounds two fall in the smoothed band,
# two are kept and four are divided by the full factor.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": 256}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def scaled(tiny_model: Callable[..., Path], tmp_path_factory) -> tuple[Path, Path]:
    """(HF dir with llama3 scaling, the same model as GGUF with rope_freqs)."""
    hf_dir = tiny_model("LlamaForCausalLM", rope_scaling=LLAMA3)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    out = tmp_path_factory.mktemp("llama3_gguf") / "tiny-llama3.gguf"
    return hf_dir, write_llama_gguf(hf_dir, out, rope_freqs=llama3_rope_factors(config))


def test_factors_are_read_into_the_config(scaled: tuple[Path, Path]) -> None:
    _, gguf_path = scaled
    factors = load_checkpoint(gguf_path).hf_config.rope_freq_factors
    assert factors[:2] == [1.0, 1.0] and factors[4:] == [8.0] * 4
    assert 1.0 < factors[2] < factors[3] < 8.0  # the smoothed band


def test_frequencies_are_llama3s(scaled: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = scaled
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert attention_factor == 1.0
    model = build_model(load_checkpoint(gguf_path), torch.float32, torch.device("cpu"), 512)
    positions = torch.arange(512, dtype=torch.float32)
    expected = torch.outer(positions, hf_inv_freq.float())
    torch.testing.assert_close(model.rotary.cos, expected.cos(), rtol=0, atol=2e-5)
    torch.testing.assert_close(model.rotary.sin, expected.sin(), rtol=0, atol=2e-5)
    # and not the default frequencies the file would give without its rope_freqs
    default_cos, _ = build_cos_sin(model.hf_config, 16, 512)
    assert (default_cos - model.rotary.cos).abs().max() > 0.5


def test_greedy_matches_transformers_llama3(scaled: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = scaled
    rng = random.Random(7)
    # NOTE: prompts past original_max_position_embeddings (256), where scaling matters most.
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 90, 300)]
    expected = hf_greedy(hf_dir, prompts, MAX_TOKENS)
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        completion = out.outputs[0]
        assert completion.token_ids == ids, f"prompt {i}"
        got = [next(iter(d.values())).logprob for d in completion.logprobs]
        for a, b in zip(got, lps):
            assert math.isclose(a, b, abs_tol=1e-3), f"prompt {i}: logprob {a} vs {b}"
