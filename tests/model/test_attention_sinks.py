"""Attention sinks (StreamingLLM): generation 4x past max_model_len in bounded KV memory, and
exact against transformers where an exact oracle exists. In a one-layer model a token's K/V
depend only on the token and (through rotary) its position, so the streaming engine's logits
at position p must equal transformers' on the cache contents alone, the S sink tokens and
the last W tokens, at the cache positions 0..S+W-1, which is the paper's definition."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from tests.model.test_llama_family_vs_hf import random_prompts

SINKS, WINDOW, MAX_LEN = 4, 28, 64
NUM_TOKENS = 4 * MAX_LEN  # prompt + output


def stream(path, prompt, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, attention_sinks=SINKS,
              streaming_window=WINDOW, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS - len(prompt),
                            ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    return out.outputs[0], engine


def test_one_layer_stream_equals_transformers_on_the_cache(tiny_model):
    path = tiny_model("LlamaForCausalLM", num_hidden_layers=1)
    (prompt,) = random_prompts(1, seed=21, lo=20, hi=20)
    out, _ = stream(path, prompt)
    assert len(out.token_ids) == NUM_TOKENS - len(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = prompt + list(out.token_ids)
    for i, token in enumerate(out.token_ids):
        p = len(prompt) + i - 1  # the query that sampled `token`
        kept = tokens[:SINKS] + tokens[max(SINKS, p - WINDOW + 1) : p + 1]
        with torch.no_grad():
            logits = model(torch.tensor([kept]), position_ids=torch.arange(len(kept))[None])
        lps = torch.log_softmax(logits.logits[0, -1].float(), -1)
        assert int(lps.argmax()) == token, f"step {i} (position {p})"
        got = next(iter(out.logprobs[i].values())).logprob
        assert math.isclose(got, lps[token].item(), abs_tol=1e-3), f"step {i}"


@pytest.mark.parametrize("chunk", [2048, 8])
def test_stream_runs_4x_max_model_len_in_bounded_blocks(tiny_model, chunk):
    path = tiny_model("LlamaForCausalLM")
    (prompt,) = random_prompts(1, seed=22, lo=50, hi=50)
    out, engine = stream(path, prompt, max_num_batched_tokens=chunk)
    assert len(out.token_ids) == NUM_TOKENS - len(prompt)
    # One sink block plus the window's: ceil(28 / 16) + 1 blocks at any decode step, and
    # the 50-token prompt's 4 blocks once.
    assert engine.kv_cache_manager.peak_num_used_blocks == 4
    assert engine.kv_cache_manager.retentions[0].num_sink_tokens == SINKS


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_stream_is_bounded_and_matches_the_reference(tiny_model, monkeypatch,
                                                               kv_cache_dtype):
    """A quantized cache with sinks: the same bounded footprint, and the decode kernel (sinks
    with their scales) gives the reference path's greedy tokens on the same codes."""
    path = tiny_model("LlamaForCausalLM")
    (prompt,) = random_prompts(1, seed=23, lo=50, hi=50)
    kwargs = {"max_num_batched_tokens": 8, "kv_cache_dtype": kv_cache_dtype}
    out, engine = stream(path, prompt, **kwargs)
    assert len(out.token_ids) == NUM_TOKENS - len(prompt)
    assert engine.kv_cache_manager.peak_num_used_blocks == 4
    assert engine.kv_cache_manager.retentions[0].num_sink_tokens == SINKS
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    ref, _ = stream(path, prompt, **kwargs)
    assert list(ref.token_ids) == list(out.token_ids)


def test_streaming_settings_are_checked(tiny_model):
    path = tiny_model("LlamaForCausalLM")
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        LLM(str(path), dtype="float32", max_model_len=MAX_LEN, attention_sinks=SINKS,
            streaming_window=MAX_LEN)
    with pytest.raises(ValueError, match="attention_sinks needs streaming_window"):
        LLM(str(path), dtype="float32", attention_sinks=SINKS)
