"""Preemption modes on a real (tiny) model: greedy float32 outputs are token-identical with
no preemption, with recompute, with swap, with swap falling back to recompute when the host
pool is small, and under the priority policy with mixed SLA classes; and each mode really
did what it says (counters)."""

from __future__ import annotations

import itertools
import random

import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import TINY_CONFIG

MAX_TOKENS = 12
# NOTE: 12 blocks of 16 tokens cannot hold 30 requests at once: the scheduler must preempt.
TIGHT = {"num_gpu_blocks_override": 12, "max_model_len": 160}


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def greedy(path, prompts, generate_kwargs=None, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        **(generate_kwargs or {}))
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    pool = engine.scheduler.preemptor.host_pool
    assert pool is None or pool.num_free_blocks == pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], engine.scheduler


@pytest.fixture(scope="module")
def setup(tiny_model):
    path = tiny_model("LlamaForCausalLM")
    prompts = random_prompts(30, seed=5)
    expected, sched = greedy(path, prompts)
    assert sched.num_preemptions == 0
    return path, prompts, expected


def test_recompute_matches_no_preemption(setup) -> None:
    path, prompts, expected = setup
    got, sched = greedy(path, prompts, **TIGHT, preemption_mode="recompute")
    assert sched.num_preemptions > 0 and sched.num_swaps == 0
    assert got == expected


def test_swap_matches_no_preemption(setup) -> None:
    path, prompts, expected = setup
    got, sched = greedy(path, prompts, **TIGHT, preemption_mode="swap")
    # The default 4 GiB host pool holds every victim: every preemption swapped.
    assert sched.num_swaps > 0 and sched.num_swaps == sched.num_preemptions
    assert got == expected


def test_swap_with_small_host_pool_falls_back_to_recompute(setup) -> None:
    path, prompts, expected = setup
    c = TINY_CONFIG
    # K and V of every layer, 16 tokens, float32.
    block_bytes = 2 * c["num_hidden_layers"] * 16 * c["num_key_value_heads"] * c["head_dim"] * 4
    got, sched = greedy(path, prompts, **TIGHT, preemption_mode="swap",
                        swap_space=3 * block_bytes / (1 << 30))
    assert sched.preemptor.host_pool.num_blocks == 3
    assert 0 < sched.num_swaps < sched.num_preemptions
    assert got == expected


def test_generate_takes_priorities_and_sla_classes(setup) -> None:
    path, prompts, expected = setup
    rng = random.Random(7)
    classes = [rng.choice(["interactive", "async", "batch"]) for _ in prompts]
    priorities = [rng.randint(-2, 2) for _ in prompts]
    got, sched = greedy(path, prompts, {"priority": priorities, "sla_class": classes},
                        **TIGHT, scheduling_policy="priority")
    assert got == expected
    first_tokens = sched.get_stats().sla_first_tokens
    assert first_tokens == {c: classes.count(c) for c in set(classes)}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_policy_late_interactive_requests_preempt(setup, mode) -> None:
    # Batch requests fill the 8 slots; interactive ones arriving two steps later preempt
    # them from the waiting queue (undoing the victims' scheduled step).
    path, prompts, expected = setup
    # NOTE: a small host pool (0.01 GiB, ~1300 blocks) keeps the per-step integrity check cheap.
    engine = LLM(str(path), dtype="float32", **TIGHT, max_num_seqs=8, preemption_mode=mode,
                 swap_space=0.01, scheduling_policy="priority").llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, sla_class="batch")
    outputs = {}
    for step in itertools.count():
        if step == 2:
            for i, p in enumerate(prompts[half:], start=half):
                engine.add_request(str(i), {"prompt_token_ids": p}, params, priority=i % 3 - 1)
        if step > 2 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.outputs[0].token_ids
        engine.check_integrity()
    sched = engine.scheduler
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert sched.num_preemptions > 0
    assert (sched.num_swaps > 0) == (mode == "swap")
    assert sched.get_stats().sla_first_tokens == {"batch": half, "interactive": half}
    assert engine.kv_cache_manager.usage == 0.0
