"""Swap preemption: the host block pool's accounting, the runner's block copies (swap-outs
before swap-ins), and the scheduler with a fake runner that writes a tiny real KV cache
(K = token id, V = position at every slot), so that every resumed request's KV is read back
through its new block table and compared. Block size 4; check_integrity after every step."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.core.swap import HostBlockPool
from pagoda.sampling_params import SamplingParams
from pagoda.worker.block_copies import swap_blocks
from pagoda.worker.model_runner import ModelRunnerOutput

BS = 4
TOKEN = 7


def make_request(req_id: str, num_prompt_tokens: int, max_tokens: int, first_token: int = 10,
                 arrival: float = 0.0, sla_class: str = "interactive") -> Request:
    return Request(req_id, list(range(first_token, first_token + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens), eos_token_id=2,
                   arrival_time=arrival, sla_class=sla_class)


class KVWritingRunner:
    """Keeps block tables from the scheduler's diffs like the real runner, performs the
    swaps with the real worker's swap_blocks, writes each scheduled token's K/V, and
    checks a (re)built request's computed KV through its new table.
    """

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        def cache(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(torch.full((n, BS, 1, 1), -1.0), torch.full((n, BS, 1, 1), -1.0))]

        self.kv, self.host = cache(num_blocks), cache(num_host_blocks)
        self.tables: dict[str, list[int]] = {}
        self.num_kv_checks = 0

    def swap_blocks(self, out: SchedulerOutput) -> None:
        swap_blocks(out, self.kv, self.host, None)

    def read(self, table: list[int], num_tokens: int) -> tuple[list[int], list[int]]:
        k, v = self.kv[0]
        pos = torch.arange(num_tokens)
        slots = torch.tensor(table)[pos // BS], pos % BS
        return k[slots].flatten().long().tolist(), v[slots].flatten().long().tolist()

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        self.swap_blocks(out)
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            n = new.num_computed_tokens
            if n:
                assert self.read(new.block_ids[0], n) == (new.token_ids[:n], list(range(n)))
                self.num_kv_checks += 1
        for cached in out.scheduled_cached_reqs:
            self.tables[cached.req_id].extend(cached.new_block_ids[0])
        result = ModelRunnerOutput()
        k, v = self.kv[0]
        for req_id, n in out.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            table = self.tables[req_id]
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                block, offset = table[pos // BS], pos % BS
                k[block, offset] = req.all_token_ids[pos]
                v[block, offset] = pos
            if req.num_computed_tokens == req.num_tokens:
                result.sampled_token_ids[req_id] = [TOKEN]
        return result


def make_scheduler(num_blocks: int, num_host_blocks: int, enable_caching: bool = False,
                   max_num_seqs: int = 16, **kwargs) -> tuple[Scheduler, KVWritingRunner]:
    kv = KVCacheManager(num_blocks, BS, enable_caching=enable_caching)
    sched = Scheduler(kv, max_num_seqs, 64, 128, preemption_mode="swap",
                      num_host_blocks=num_host_blocks, **kwargs)
    return sched, KVWritingRunner(num_blocks, num_host_blocks)


def step(sched: Scheduler, runner: KVWritingRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.check_integrity()
    sched.update_from_output(out, runner.execute(sched, out))
    sched.check_integrity()
    return out


def run_to_end(sched: Scheduler, runner: KVWritingRunner) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched, runner))
        assert len(outs) < 500, "no progress"
    assert sched.kv.usage == 0.0
    pool = sched.preemptor.host_pool
    assert pool.num_free_blocks == pool.num_blocks
    return outs


# ---- host pool accounting -----------------------------------------------------------------
def test_host_pool_hands_out_and_takes_back_exact_blocks() -> None:
    pool = HostBlockPool(5)
    assert pool.swap_out("a", [7, 3, 9]) == [(7, 0), (3, 1), (9, 2)]
    assert pool.swap_out("b", [4, 4, 4]) is None, "3 blocks do not fit in 2"
    assert pool.num_free_blocks == 2 and pool.req_to_host_ids == {"a": [0, 1, 2]}
    assert pool.swap_out("b", [5]) == [(5, 3)]
    pool.check_integrity({"a": 3, "b": 1})
    # Swap-in into a longer table whose first block came from the prefix cache.
    assert pool.swap_in("a", [11, 12, 13, 14], num_skipped=1) == [(1, 12), (2, 13)]
    # Released host blocks are not reusable until the step's copies are all decided.
    assert pool.num_free_blocks == 1 and pool.swap_out("c", [1, 2]) is None
    with pytest.raises(AssertionError, match="released"):
        pool.check_integrity({"b": 1})
    pool.end_step()
    assert pool.swap_out("c", [1, 2]) == [(1, 4), (2, 0)]
    pool.free("b")
    pool.free("unknown")
    pool.check_integrity({"c": 2})
    with pytest.raises(AssertionError, match="host tables"):
        pool.check_integrity({"c": 2, "b": 1})
    with pytest.raises(AssertionError, match="host blocks for"):
        pool.check_integrity({"c": 3})
    assert pool.usage == pytest.approx(2 / 5)


def test_runner_swaps_out_before_it_swaps_in() -> None:
    runner = KVWritingRunner(num_blocks=4, num_host_blocks=2)
    k, v = runner.kv[0]
    for block in range(4):
        k[block], v[block] = float(block), float(-block)
    runner.host[0][0][1], runner.host[0][1][1] = 100.0, -100.0
    # Device block 2 goes out to host 0, then host 1 comes in to device block 2.
    out = SchedulerOutput(blocks_to_swap_out=[(2, 0)], blocks_to_swap_in=[(1, 2)])
    runner.swap_blocks(out)
    hk, hv = runner.host[0]
    assert hk[0].eq(2.0).all() and hv[0].eq(-2.0).all()
    assert k[2].eq(100.0).all() and v[2].eq(-100.0).all()
    assert k[:2].flatten().tolist() == [0.0] * BS + [1.0] * BS
    assert k[3].eq(3.0).all()


# ---- scheduler + runner -------------------------------------------------------------------
def test_swap_out_and_in_keeps_computed_tokens_and_kv() -> None:
    # 6 usable blocks (7 less the null block): two requests of 8 prompt tokens growing to
    # 20 cannot both fit; the newer one is swapped out when the older needs its 4th block.
    sched, runner = make_scheduler(num_blocks=7, num_host_blocks=8)
    old, new = make_request("old", 8, 12), make_request("new", 8, 12, first_token=100)
    sched.add_request(old)
    sched.add_request(new)
    while new.status != RequestStatus.SWAPPED:
        out = step(sched, runner)
    # After 5 steps both hold 3 blocks (old: 1 2 5, new: 3 4 6) and 12 computed tokens.
    assert new.num_computed_tokens == 12 and new.num_tokens == 13
    assert out.blocks_to_swap_out == [(3, 0), (4, 1), (6, 2)]
    assert out.finished_req_ids == {"new"} and "new" not in out.num_scheduled_tokens
    assert sched.preemptor.host_pool.req_to_host_ids == {"new": [0, 1, 2]}
    # The host pool holds new's KV: prompt then outputs, positions 0..11.
    hk, hv = runner.host[0]
    assert hk[:3].flatten().long().tolist() == new.all_token_ids[:12]
    assert hv[:3].flatten().long().tolist() == list(range(12))
    # The freed blocks went to the free queue in reverse: old took 6 at once.
    assert sched.kv.get_block_ids("old") == [1, 2, 5, 6]
    stats = sched.get_stats()
    assert (stats.num_preemptions, stats.num_swaps, stats.num_swapped) == (1, 1, 1)
    assert stats.host_cache_usage == pytest.approx(3 / 8)
    assert new.num_preemptions == 1 and list(sched.waiting) == [new]

    resumed = None
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        if any(d.req_id == "new" for d in out.scheduled_new_reqs):
            resumed = out
    assert resumed is not None
    (data,) = resumed.scheduled_new_reqs
    # No recompute: only the one token past the computed ones is scheduled.
    assert data.num_computed_tokens == 12 and resumed.num_scheduled_tokens["new"] == 1
    assert [h for h, _ in resumed.blocks_to_swap_in] == [0, 1, 2]
    assert [d for _, d in resumed.blocks_to_swap_in] == data.block_ids[0][:3]
    assert runner.num_kv_checks == 1
    assert sched.kv.usage == 0.0
    assert sched.preemptor.host_pool.num_free_blocks == 8
    assert old.output_token_ids == [TOKEN] * 12 and new.output_token_ids == [TOKEN] * 12
    assert sched.num_swaps == 1 and sched.num_preemptions == 1


def test_swap_in_takes_cached_leading_blocks_instead_of_copying() -> None:
    sched, runner = make_scheduler(num_blocks=7, num_host_blocks=8, enable_caching=True)
    old, new = make_request("old", 8, 12), make_request("new", 8, 12, first_token=100)
    sched.add_request(old)
    sched.add_request(new)
    outs = run_to_end(sched, runner)
    (resumed,) = [o for o in outs
                  if any(d.req_id == "new" and d.num_computed_tokens for d in o.scheduled_new_reqs)]
    (data,) = resumed.scheduled_new_reqs
    assert data.num_computed_tokens == 12
    # new's first prompt block (device 3) was freed last and is still cached: it is shared
    # again, and only host blocks 1 and 2 are copied back.
    assert data.block_ids[0][0] == 3
    assert [h for h, _ in resumed.blocks_to_swap_in] == [1, 2]
    assert [d for _, d in resumed.blocks_to_swap_in] == data.block_ids[0][1:3]
    assert runner.num_kv_checks == 1
    assert new.output_token_ids == [TOKEN] * 12


def test_full_host_pool_falls_back_to_recompute() -> None:
    sched, runner = make_scheduler(num_blocks=7, num_host_blocks=2)
    old, new = make_request("old", 8, 12), make_request("new", 8, 12, first_token=100)
    sched.add_request(old)
    sched.add_request(new)
    while new.num_preemptions == 0:
        out = step(sched, runner)
    # new held 3 computed blocks; 2 host blocks cannot take them.
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert out.blocks_to_swap_out == [] and sched.num_swaps == 0
    assert sched.preemptor.host_pool.num_free_blocks == 2
    outs = run_to_end(sched, runner)
    (resumed,) = [d for o in outs for d in o.scheduled_new_reqs if d.req_id == "new"]
    assert resumed.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and sched.num_swaps == 0
    assert new.output_token_ids == [TOKEN] * 12


def test_abort_of_a_swapped_request_frees_its_host_blocks() -> None:
    sched, runner = make_scheduler(num_blocks=7, num_host_blocks=8)
    sched.add_request(make_request("old", 8, 12))
    new = make_request("new", 8, 12, first_token=100)
    sched.add_request(new)
    while new.status != RequestStatus.SWAPPED:
        step(sched, runner)
    assert sched.preemptor.host_pool.num_free_blocks == 5
    sched.finish_requests("new", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.preemptor.host_pool.num_free_blocks == 8
    assert "new" in step(sched, runner).finished_req_ids
    run_to_end(sched, runner)


def test_priority_victim_is_swapped_with_this_steps_work_undone() -> None:
    # One slot: an interactive request preempts a batch one that was scheduled for its
    # decode in the same step. The swap-out covers only what was computed before.
    sched, runner = make_scheduler(num_blocks=16, num_host_blocks=8, max_num_seqs=1,
                                   policy="priority", aging_interval_s=math.inf)
    batch = make_request("batch", 6, 6, sla_class="batch")
    sched.add_request(batch)
    step(sched, runner)
    step(sched, runner)
    assert batch.num_computed_tokens == 7 and sched.kv.get_block_ids("batch") == [1, 2]
    sched.add_request(make_request("inter", 5, 2, first_token=100, arrival=1.0))
    out = step(sched, runner)
    assert batch.status == RequestStatus.SWAPPED and batch.num_computed_tokens == 7
    assert out.blocks_to_swap_out == [(1, 0), (2, 1)]
    assert out.num_scheduled_tokens == {"inter": 5} and not out.scheduled_cached_reqs
    run_to_end(sched, runner)
    assert runner.num_kv_checks == 1
    assert batch.output_token_ids == [TOKEN] * 6
