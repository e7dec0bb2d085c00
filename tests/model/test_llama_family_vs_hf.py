"""Greedy outputs token-exact with transformers (float32) for every architecture, alone and
in a 30-request batch, and unchanged under forced preemption and forced chunked prefill."""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MAX_TOKENS = 12


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    """(token ids, per-step raw logprobs of the chosen token) from transformers, one by one."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=0,
            )
        ids = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, ids)]
        results.append((ids, lps))
    return results


def pagoda_greedy(path, prompts, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
    return outs, llm


def assert_matches(outs, expected) -> None:
    for i, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        got = out.outputs[0].token_ids
        assert got == ids, f"request {i}: {got} != {ids}"
        got_lps = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        for a, b in zip(got_lps, lps):
            assert math.isclose(a, b, abs_tol=1e-3), f"request {i}: logprob {a} vs {b}"


BATCH = random_prompts(30, seed=2)


@pytest.fixture(scope="module")
def hf_batch(tiny_model):
    """`hf_batch(arch)`: transformers' results for BATCH, computed once per architecture."""
    cache: dict[str, list] = {}

    def get(arch: str) -> list:
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model(arch), BATCH)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_single_request_matches_hf(tiny_model, hf_batch, arch):
    path = tiny_model(arch)
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, p in enumerate(BATCH[:3]):  # one at a time: each alone in the engine
        outs = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        assert_matches(outs, [hf_batch(arch)[i]])
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_30_matches_hf(tiny_model, hf_batch, arch):
    outs, _ = pagoda_greedy(tiny_model(arch), BATCH)
    assert_matches(outs, hf_batch(arch))


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 128}},
    ],
    ids=["tied", "mqa", "mha", "linear", "dynamic", "llama3", "yarn"],
)
def test_llama_variants_match_hf(tiny_model, overrides):
    path = tiny_model("LlamaForCausalLM", **overrides)
    prompts = random_prompts(6, seed=3)
    outs, _ = pagoda_greedy(path, prompts)
    assert_matches(outs, hf_greedy(path, prompts))


def test_mistral_sliding_window_matches_hf(tiny_model):
    path = tiny_model("MistralForCausalLM", sliding_window=16)
    prompts = random_prompts(4, seed=4, lo=30, hi=60)
    outs, _ = pagoda_greedy(path, prompts, max_num_batched_tokens=24)
    assert_matches(outs, hf_greedy(path, prompts))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_forced_preemption_and_chunked_prefill_keep_outputs(tiny_model, hf_batch, arch):
    path = tiny_model(arch)
    expected = hf_batch(arch)
    # 12 blocks of 16 tokens cannot hold 30 requests at once: the scheduler must preempt.
    outs, llm = pagoda_greedy(path, BATCH, num_gpu_blocks_override=12, max_model_len=160)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_matches(outs, expected)
    # A budget of 8 tokens forces every prompt longer than 8 to be prefilled in chunks.
    assert sum(len(p) > 8 for p in BATCH) > 20
    outs, _ = pagoda_greedy(path, BATCH, max_num_batched_tokens=8)
    assert_matches(outs, expected)
