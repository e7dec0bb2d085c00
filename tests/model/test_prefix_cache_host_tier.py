"""The prefix cache's host tier on a real (tiny, float32) model: a conversation, then a burst
of other prompts that evicts it from a small device cache, then the conversation's next
turn. With the tier on, the history comes back from host memory (cached tokens, host-hit
counter); greedy outputs are token-identical to the tier off and to no prefix caching."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import TINY_CONFIG

BLOCK = 16
# 16 usable blocks of 16 tokens (17 less the null block): the burst below (8 prompts of
# 96 tokens) cannot leave the conversation's history on the device.
SMALL = {"num_gpu_blocks_override": 17, "max_model_len": 256}


def block_bytes() -> int:
    c = TINY_CONFIG  # K and V of every layer, 16 tokens, float32
    return 2 * c["num_hidden_layers"] * BLOCK * c["num_key_value_heads"] * c["head_dim"] * 4


def conversation(path, **engine_kwargs):
    """Turn 1, a burst, turn 2 (turn 1 + its reply + a new message): (turn outputs, burst
    outputs, RequestOutput of turn 2, host-hit tokens of turn 2, engine)."""
    rng = random.Random(11)
    llm = LLM(str(path), dtype="float32", **SMALL, **engine_kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    turn1 = [rng.randrange(3, 49152) for _ in range(150)]
    (out1,) = llm.generate([{"prompt_token_ids": turn1}], params, use_tqdm=False)
    burst = [[rng.randrange(3, 49152) for _ in range(96)] for _ in range(8)]
    burst_outs = llm.generate([{"prompt_token_ids": p} for p in burst],
                              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                              use_tqdm=False)
    engine.check_integrity()
    turn2 = turn1 + out1.outputs[0].token_ids + [rng.randrange(3, 49152) for _ in range(20)]
    host_hits_before = engine.get_stats().prefix_cache_host_hits
    (out2,) = llm.generate([{"prompt_token_ids": turn2}], params, use_tqdm=False)
    host_hits = engine.get_stats().prefix_cache_host_hits - host_hits_before
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    turns = [out1.outputs[0].token_ids, out2.outputs[0].token_ids]
    return turns, [o.outputs[0].token_ids for o in burst_outs], out2, host_hits, engine


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("LlamaForCausalLM")


def test_history_comes_back_from_host_with_identical_outputs(path) -> None:
    turns_on, burst_on, out2_on, host_hits, engine = conversation(
        path, kv_offloading_size=64 * block_bytes() / (1 << 30))
    tier = engine.kv_cache_manager.host_tier
    assert tier.num_slots == 64 and tier.num_offloaded > 0
    # turn 2 = 150 + 8 + 20 tokens; the history's full blocks (9 of 16 tokens: 144 tokens,
    # the rest of turn 1 and its reply were never a full block before turn 2) come back.
    assert out2_on.num_cached_tokens == 144 and host_hits == 144
    assert tier.num_loaded == 9

    turns_off, burst_off, out2_off, host_hits_off, engine_off = conversation(path)
    assert engine_off.kv_cache_manager.host_tier is None
    # Without the tier the burst really evicted the history: nothing cached.
    assert out2_off.num_cached_tokens == 0 and host_hits_off == 0

    turns_none, burst_none, out2_none, _, _ = conversation(path, enable_prefix_caching=False)
    assert out2_none.num_cached_tokens == 0
    assert turns_on == turns_off == turns_none
    assert burst_on == burst_off == burst_none


def test_kv_offloading_size_is_validated(path) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        LLM(str(path), dtype="float32", kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(path), dtype="float32", kv_offloading_size=0.5, enable_prefix_caching=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_the_host_tier_matches_no_preemption(path, mode) -> None:
    # 30 prompts (a third share a prefix) through 12 device blocks, twice: requests preempt
    # each other, and the second pass loads what the first left in the host tier.
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [(shared if i % 3 == 0 else []) +
               [rng.randrange(3, 49152) for _ in range(rng.randint(3, 70))] for i in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(
        str(path), dtype="float32", max_model_len=160, enable_prefix_caching=False,
    ).generate(inputs, params, use_tqdm=False)]
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=12, max_model_len=160,
              preemption_mode=mode, swap_space=0.01,
              kv_offloading_size=256 * block_bytes() / (1 << 30))
    engine = llm.llm_engine
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
        engine.check_integrity()
        assert engine.kv_cache_manager.usage == 0.0
        assert got == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_host_hits > 0
    assert (mode == "swap") == (stats.num_swaps > 0)
