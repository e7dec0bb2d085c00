"""Sliding-window layers with freed blocks, end to end: greedy float32 output equals
transformers token for token on tiny Mistral (every layer windowed: one KV cache group)
and Qwen2 (use_sliding_window with max_window_layers: a full and a windowed group) with
windows of 32-48 tokens, prompts and outputs well past the window; under chunked prefill,
forced preemption (recompute and swap) and prefix-cache hits. The windowed group's block
count is asserted exactly at every step."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.model.test_llama_family_vs_hf import assert_matches, hf_greedy, random_prompts

MAX_TOKENS = 16
BS = 16

# (arch, config overrides): Mistral windows every layer; Qwen2 windows the layers from
# max_window_layers on (layer 1 of 2).
CASES = {
    "mistral": ("MistralForCausalLM", {"sliding_window": 32}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 48,
                                   "max_window_layers": 1}),
}


def run(path, prompts, max_tokens=MAX_TOKENS, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    return outs, engine


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tiny_model):
    arch, overrides = CASES[request.param]
    path = tiny_model(arch, **overrides)
    prompts = random_prompts(6, seed=11, lo=90, hi=150)
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_groups_follow_the_config(case):
    name, path, prompts, expected = case
    outs, engine = run(path, prompts[:1])
    windows = [r.window for r in engine.kv_cache_manager.retentions]
    assert windows == ([32] if name == "mistral" else [None, 48])
    assert_matches(outs, expected[:1])


def test_matches_hf_with_chunked_prefill(case):
    _, path, prompts, expected = case
    outs, _ = run(path, prompts, max_num_batched_tokens=24)
    assert_matches(outs, expected)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_matches_hf_under_preemption(case, mode):
    name, path, prompts, expected = case
    # NOTE: too few blocks for six requests of 90-166 tokens (Qwen2's full group holds
    # every block): the scheduler must preempt.
    num_blocks = 16 if name == "mistral" else 24
    outs, engine = run(path, prompts, num_gpu_blocks_override=num_blocks, preemption_mode=mode,
                       max_num_batched_tokens=64, max_model_len=200)
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.preemptor.num_swaps > 0
    assert_matches(outs, expected)


def test_prefix_cache_hits_match_hf(case):
    _, path, prompts, expected = case
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, params, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    outs = llm.generate(reqs, params, use_tqdm=False)
    assert kv.prefix_cache_hits - hits_before >= sum((len(p) - 1) // BS * BS for p in prompts)
    llm.llm_engine.check_integrity()
    assert_matches(outs, expected)


def test_windowed_group_block_counts_are_exact(case):
    name, path, prompts, _ = case
    window = 32 if name == "mistral" else 48
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    engine.add_request("r", {"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    req = engine.scheduler.requests["r"]
    windowed = len(kv.retentions) - 1
    num_decode_steps = 0
    while True:
        start = req.num_computed_tokens  # the step's queries begin here
        engine.step()
        if req.is_finished:
            break
        table = kv.get_block_ids("r", windowed)
        first = max(0, start - window + 1) // BS
        assert len(table) == -(-req.num_computed_tokens // BS)
        assert table[:first] == [0] * first and 0 not in table[first:], table
        if start >= len(prompts[0]):
            num_decode_steps += 1
            # A decode step holds the blocks of its window: W / block_size + 1 at most.
            assert len(table) - first <= window // BS + 1
        if windowed:
            full = kv.get_block_ids("r", 0)
            assert len(full) == len(table) and 0 not in full
        engine.check_integrity()
    assert num_decode_steps == 62 and kv.usage == 0.0  # the 64th token ends it
