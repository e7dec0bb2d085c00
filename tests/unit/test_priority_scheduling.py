"""The Scheduler under the priority policy (real KVCacheManager, fake runner): preemption of
the lowest-ranked running request when max_num_seqs is reached or blocks run out, victims
by rank rather than recency, no starvation thanks to aging, SLA TTFT accounting. Block
size 4; check_integrity after every step (inside `step`)."""

from __future__ import annotations

import math
import time

import pytest

from pagoda.config import EngineArgs
from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.engine.metrics import EngineMetrics
from pagoda.sampling_params import SamplingParams
from tests.unit.test_scheduler import BLOCK_SIZE, EOS, TOKEN, run_to_end, step


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 16, policy: str = "priority",
                   aging_interval_s: float = math.inf, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=False)
    return Scheduler(kv, max_num_seqs, 64, 128, policy=policy,
                     aging_interval_s=aging_interval_s, **kwargs)


def make_request(req_id: str, num_prompt_tokens: int, arrival: float,
                 sla_class: str = "interactive", priority: int = 0, max_tokens: int = 4,
                 first_token: int = 10) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(first_token, first_token + num_prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=EOS,
        arrival_time=arrival,
        priority=priority,
        sla_class=sla_class,
    )


def test_max_num_seqs_preempts_the_newest_of_the_lowest_rank() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    b1 = make_request("b1", 6, 0.0, "batch", max_tokens=8)
    b2 = make_request("b2", 6, 1.0, "batch", max_tokens=8, first_token=100)
    sched.add_request(b1)
    sched.add_request(b2)
    step(sched)
    assert sched.kv.get_block_ids("b1") == [1, 2] and sched.kv.get_block_ids("b2") == [3, 4]
    hi = make_request("hi", 5, 2.0, max_tokens=2, first_token=200)
    sched.add_request(hi)
    out, _ = step(sched)
    # b2 (equal rank with b1, started later) is the victim; its decode of this step is
    # undone, b1's stays.
    assert out.num_scheduled_tokens == {"b1": 1, "hi": 5}
    assert out.total_num_scheduled_tokens == 6
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["b1"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["hi"]
    assert out.finished_req_ids == {"b2"}
    assert b2.status == RequestStatus.PREEMPTED and b2.num_computed_tokens == 0
    # b2's blocks were freed in reverse (4, 3) behind the never-used 5..15.
    assert sched.kv.get_block_ids("hi") == [5, 6]
    assert [r.req_id for r in sched.running] == ["b1", "hi"]
    assert list(sched.waiting) == [b2]
    assert sched.num_preemptions == 1 and sched.get_stats().num_preemptions == 1
    assert sched.get_stats().sla_preemptions == {"batch": 1}
    run_to_end(sched)
    assert b2.output_token_ids == [TOKEN] * 8 and b2.num_preemptions == 1
    assert b1.num_preemptions == 0 and hi.num_preemptions == 0


def test_victim_is_lowest_rank_not_newest() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    low = make_request("low", 6, 0.0, priority=5, max_tokens=8)
    mid = make_request("mid", 6, 1.0, priority=1, max_tokens=8, first_token=100)
    sched.add_request(low)
    sched.add_request(mid)
    step(sched)
    sched.add_request(make_request("top", 5, 2.0, priority=0, max_tokens=2, first_token=200))
    out, _ = step(sched)
    assert out.finished_req_ids == {"low"} and sorted(out.num_scheduled_tokens) == ["mid", "top"]
    assert low.status == RequestStatus.PREEMPTED and mid.status == RequestStatus.RUNNING
    run_to_end(sched)


def test_fcfs_keeps_todays_behaviour_under_max_num_seqs() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=2, policy="fcfs")
    sched.add_request(make_request("b1", 6, 0.0, "batch"))
    sched.add_request(make_request("b2", 6, 1.0, "batch", first_token=100))
    step(sched)
    sched.add_request(make_request("hi", 5, 2.0, priority=-10, first_token=200))
    out, _ = step(sched)
    assert sorted(out.num_scheduled_tokens) == ["b1", "b2"] and not out.finished_req_ids
    assert sched.num_preemptions == 0
    run_to_end(sched)


def test_equal_rank_waits_instead_of_preempting() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    sched.add_request(make_request("a", 6, 0.0))
    step(sched)
    sched.add_request(make_request("b", 6, 1.0, first_token=100))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a"] and sched.num_preemptions == 0
    run_to_end(sched)
    assert sched.num_preemptions == 0


def test_waiting_request_preempts_under_kv_pressure() -> None:
    # 4 usable blocks: the batch request holds 3 and decodes; the interactive one needs 2.
    sched = make_scheduler(num_blocks=5)
    batch = make_request("batch", 12, 0.0, "batch", max_tokens=3)
    sched.add_request(batch)
    step(sched)
    assert sched.kv.get_block_ids("batch") == [1, 2, 3]
    inter = make_request("inter", 8, 1.0, max_tokens=3, first_token=100)
    sched.add_request(inter)
    out, _ = step(sched)
    # The batch request's decode (which took block 4) is undone and all four blocks are
    # freed in reverse; the interactive request takes the first two of 4, 3, 2, 1.
    assert out.num_scheduled_tokens == {"inter": 8} and out.finished_req_ids == {"batch"}
    assert not out.scheduled_cached_reqs
    assert sched.kv.get_block_ids("inter") == [4, 3]
    assert batch.status == RequestStatus.PREEMPTED and batch.num_computed_tokens == 0
    assert batch.num_output_tokens == 1
    run_to_end(sched)
    assert batch.output_token_ids == [TOKEN] * 3 and inter.output_token_ids == [TOKEN] * 3


def test_running_phase_victim_is_lowest_rank() -> None:
    # 6 blocks for two requests growing to 5 blocks each. Under FCFS the newer request
    # would be preempted; under priority the batch one is, although it started first.
    sched = make_scheduler(num_blocks=6)
    batch = make_request("batch", 8, 0.0, "batch", max_tokens=12)
    sched.add_request(batch)
    step(sched)
    inter = make_request("inter", 8, 1.0, max_tokens=12, first_token=100)
    sched.add_request(inter)
    while batch.num_preemptions == 0:
        step(sched)
        assert sched.has_unfinished_requests()
    assert inter.status == RequestStatus.RUNNING
    run_to_end(sched)
    assert inter.num_preemptions == 0
    assert batch.output_token_ids == [TOKEN] * 12 and inter.output_token_ids == [TOKEN] * 12


def test_preemptions_count_against_the_victims_class() -> None:
    """Both preemption paths attribute to the preempted request's class: a waiting
    interactive request preempts an async one (max_num_seqs), then KV pressure in the
    running phase preempts the newest interactive request under FCFS order of equals."""
    sched = make_scheduler(num_blocks=6, max_num_seqs=2)
    slow = make_request("async", 4, 0.0, "async", max_tokens=12)
    first = make_request("i1", 4, 1.0, max_tokens=12, first_token=100)
    sched.add_request(slow)
    sched.add_request(first)
    step(sched)
    second = make_request("i2", 4, 2.0, max_tokens=12, first_token=200)
    sched.add_request(second)
    step(sched)
    assert slow.status == RequestStatus.PREEMPTED
    assert sched.get_stats().sla_preemptions == {"async": 1}
    # i1 and i2 grow to 4 blocks each in 6 blocks: the newer interactive one gives way.
    while second.num_preemptions == 0:
        step(sched)
    assert first.num_preemptions == 0
    assert sched.get_stats().sla_preemptions == {"async": 1, "interactive": 1}
    run_to_end(sched)
    stats = sched.get_stats()
    assert sum(stats.sla_preemptions.values()) == stats.num_preemptions
    assert stats.sla_preemptions["interactive"] == first.num_preemptions + second.num_preemptions
    assert stats.sla_preemptions["async"] == slow.num_preemptions


def run_stream(aging_interval_s: float, num_steps: int) -> int | None:
    """One slot; a batch request arrives at t=0 with an interactive one arriving every
    (simulated) second. The step at which the batch request finished, or None."""
    sched = make_scheduler(max_num_seqs=1, aging_interval_s=aging_interval_s)
    batch = make_request("batch", 4, 0.0, "batch", max_tokens=3)
    sched.add_request(batch)
    for t in range(num_steps):
        sched.add_request(make_request(f"i{t}", 4, float(t), max_tokens=3, first_token=100 + t))
        step(sched)
        if batch.is_finished:
            return t
    return None


def test_aging_prevents_starvation() -> None:
    # Interactive work arrives faster than one slot serves it (1 per step vs 3 steps per
    # request): without aging the batch request never runs.
    assert run_stream(math.inf, 120) is None
    # With aging every 10 s it ties the interactive requests that arrive from t=20 on and
    # goes first among them: after the 20 that arrived before (3 steps each).
    finished_at = run_stream(10.0, 120)
    assert finished_at is not None and finished_at <= 3 * 20 + 3


def test_ttft_is_counted_against_the_class_target() -> None:
    sched = make_scheduler(sla_ttft_targets_s={"interactive": 0.5})
    now = time.monotonic()
    sched.add_request(make_request("late", 4, now - 1.0))
    sched.add_request(make_request("ok", 4, now + 10.0, first_token=50))
    sched.add_request(make_request("batch", 4, now - 1.0, "batch", first_token=90))
    step(sched)
    stats = sched.get_stats()
    assert stats.sla_first_tokens == {"interactive": 2, "batch": 1}
    assert stats.sla_ttft_misses == {"interactive": 1}
    assert stats.num_swaps == 0 and stats.num_swapped == 0 and stats.host_cache_usage == 0.0
    run_to_end(sched)


def test_metrics_mirror_swap_and_sla_counters() -> None:
    sched = make_scheduler(sla_ttft_targets_s={"interactive": 0.5})
    sched.add_request(make_request("late", 4, time.monotonic() - 1.0))
    step(sched)
    m = EngineMetrics("m")
    m.observe_stats(sched.get_stats())
    m.observe_stats(sched.get_stats())  # counters advance by deltas only

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("pagoda:sla_first_tokens_total", sla_class="interactive") == 1
    assert value("pagoda:sla_ttft_misses_total", sla_class="interactive") == 1
    assert value("pagoda:num_swaps_total") == 0
    assert value("pagoda:num_requests_swapped") == 0


def test_config_rejects_bad_policy_and_preemption_fields() -> None:
    EngineArgs().create_engine_config()
    for kwargs, field in (
        ({"swap_space": -1.0}, "swap_space"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"aging_interval_s": 0.0}, "aging_interval_s"),
        ({"sla_ttft_targets_s": {"gold": 1.0}}, "sla_ttft_targets_s"),
        ({"sla_ttft_targets_s": {"batch": 0.0}}, "sla_ttft_targets_s"),
    ):
        with pytest.raises(ValueError, match=field):
            EngineArgs(**kwargs).create_engine_config()


def test_undone_step_leaves_no_block_registered() -> None:
    """A batch request's chunk would fill block 3; a better request preempts it in the
    same step, so block 3 is never computed. Registration happens at commit only, so it
    was never in the prefix cache (a hit would read K/V nobody wrote)."""
    kv = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    sched = Scheduler(kv, 1, 8, 128, policy="priority", aging_interval_s=math.inf)
    batch = make_request("batch", 14, 0.0, "batch", max_tokens=2)
    sched.add_request(batch)
    step(sched)  # tokens 0..7: blocks 1 and 2 full, computed, registered at commit
    assert batch.num_computed_tokens == 8
    cached_before = set(kv.block_pool.cached_block_hash_to_block)
    assert cached_before == set(batch.block_hashes[:2])
    hi = make_request("hi", 3, 1.0, max_tokens=2, first_token=500)
    sched.add_request(hi)
    out, _ = step(sched)  # batch's tokens 8..13 scheduled (fills block 3), then undone
    assert out.num_scheduled_tokens == {"hi": 3}
    assert batch.status == RequestStatus.PREEMPTED and batch.num_computed_tokens == 0
    assert batch.block_hashes[2] not in kv.block_pool.cached_block_hash_to_block
    assert set(kv.block_pool.cached_block_hash_to_block) == cached_before
    # A copy of the batch prompt now hits only the two computed blocks.
    twin = make_request("twin", 14, 2.0, "batch", max_tokens=2)
    update_block_hashes(twin, BLOCK_SIZE)
    blocks, num_tokens = kv.get_computed_blocks(twin)
    assert num_tokens == 8 and [b.block_id for b in blocks] == [1, 2]
    run_to_end(sched)
    assert batch.num_preemptions == 1 and len(batch.output_token_ids) == 2


def test_requests_admitted_in_a_step_hit_only_committed_blocks() -> None:
    """b1's chunk fills blocks 2 and 3 (tokens 4..11) in the running phase; b2, admitted
    next with the same prompt, hits only block 1, which an earlier step committed. So b1
    may be preempted by a request that outranks it in the same step: nobody counts on its
    undone work (no victim is exempt)."""
    kv = KVCacheManager(32, BLOCK_SIZE, enable_caching=True)
    sched = Scheduler(kv, 2, 64, 128, policy="priority", aging_interval_s=math.inf)
    b1 = make_request("b1", 12, 0.0, "batch", max_tokens=2)
    sched.add_request(b1)
    sched.max_num_batched_tokens = 4
    step(sched)  # b1 computes tokens 0..3 (block 1)
    sched.max_num_batched_tokens = 64
    # Waiting order: b2 (interactive) first, then mid (async), which outranks b1 (batch).
    b2 = make_request("b2", 12, 1.0, "interactive", max_tokens=2)
    mid = make_request("mid", 3, 2.0, "async", max_tokens=2, first_token=500)
    sched.add_request(b2)
    sched.add_request(mid)
    out, _ = step(sched)
    # b2 fills max_num_seqs with b1; b1 (the only victim candidate: b2 was admitted in
    # this step) is preempted for mid, its decode undone.
    assert out.num_scheduled_tokens == {"b2": 8, "mid": 3}
    assert b1.status == RequestStatus.PREEMPTED and sched.num_preemptions == 1
    assert kv.get_block_ids("b2")[0] == 1 and b2.num_cached_tokens == 4
    # b2's own blocks are registered at its commit; b1's undone chunk never was.
    cached = {h: b.block_id for h, b in kv.block_pool.cached_block_hash_to_block.items()}
    assert [cached.get(h) for h in b2.block_hashes] == kv.get_block_ids("b2")
    run_to_end(sched)
    assert b1.output_token_ids and b2.output_token_ids and mid.output_token_ids
