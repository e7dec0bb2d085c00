"""The prefix cache's host tier: slot accounting and LRU order (HostPrefixTier), offloads and
loads with exact block and slot ids (KVCacheManager), the runner's copy order, and the
scheduler with a fake runner that writes a tiny real KV cache (K = token id, V = position)
and reads every scheduled request's whole context back through its block table each step.
Block size 4; check_integrity after every scenario and step."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.core.hashing import hash_block_tokens
from pagoda.core.host_tier import HostPrefixTier
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.block_copies import swap_blocks
from pagoda.worker.model_runner import ModelRunnerOutput
from tests.unit.test_kv_cache_manager import BS, free_ids, ids, make_request, schedule

H = [hash_block_tokens(None, [i]) for i in range(8)]  # distinct stand-in hashes


def cached_ids(manager: KVCacheManager, hashes: list[bytes]) -> list[int | None]:
    """Device block registered under each hash (None if not on the device)."""
    pool = manager.block_pool
    return [b.block_id if (b := pool.get_cached_block(h)) else None for h in hashes]


# ---- HostPrefixTier -----------------------------------------------------------------------
def test_tier_slots_lru_eviction_and_step_reservations() -> None:
    tier = HostPrefixTier(3)
    assert [tier.offload(H[i], 10 + i) for i in range(3)] == [0, 1, 2]
    assert tier.lru_hashes() == H[:3] and tier.usage == 1.0
    # Every slot was written this step: a fourth offload may not overwrite one of them.
    assert tier.offload(H[3], 13) is None and tier.num_dropped == 1
    assert tier.take_copies() == ([(10, 0), (11, 1), (12, 2)], [])
    tier.end_step()
    tier.check_integrity(set())
    # Next step: full, so offloads evict least recently offloaded first.
    assert tier.offload(H[3], 13) == 0
    assert tier.offload(H[4], 14) == 1
    assert tier.lru_hashes() == [H[2], H[3], H[4]] and tier.num_evicted == 2
    assert tier.slot_of(H[0]) is None and tier.slot_of(H[2]) == 2
    # A load takes the entry out; its slot is not reused within the step (the runner copies
    # device -> host first and would overwrite what the load reads).
    assert tier.take([H[2]]) == [2]
    tier.load([2], [20])
    assert tier.offload(H[5], 15) is None, "the only other slots were written this step"
    assert tier.take_copies() == ([(13, 0), (14, 1)], [(2, 20)])
    tier.end_step()
    tier.discard(H[3])  # at a commit: a device block was registered under H[3]
    tier.discard(H[7])  # absent: no-op
    assert tier.lru_hashes() == [H[4]]
    # Free slots first: 2 (released by the load, free since its step ended), then 0
    # (discarded at a commit, when no copy is in flight: free at once).
    assert tier.offload(H[5], 15) == 2
    assert tier.offload(H[6], 16) == 0
    assert tier.lru_hashes() == [H[4], H[5], H[6]] and tier.num_evicted == 2
    assert tier.take_copies() == ([(15, 2), (16, 0)], [])
    tier.end_step()
    tier.check_integrity(set())
    with pytest.raises(KeyError):
        tier.take([H[5], H[0]])
    assert tier.lru_hashes() == [H[4], H[5], H[6]], "a failed take changes nothing"
    assert (tier.num_offloaded, tier.num_loaded) == (7, 1)
    tier.reset()
    assert len(tier) == 0 and tier.usage == 0.0
    tier.check_integrity(set())


def test_tier_integrity_catches_corruption() -> None:
    tier = HostPrefixTier(2)
    tier.offload(H[0], 5)
    tier.end_step()
    with pytest.raises(AssertionError, match="copies queued"):
        tier.check_integrity(set())
    tier.take_copies()
    tier.check_integrity(set())
    tier.take([H[0]])  # a load's slot stays reserved until its step ends
    with pytest.raises(AssertionError, match="reserved past the end"):
        tier.check_integrity(set())
    tier.end_step()
    tier.offload(H[0], 5)
    tier.take_copies()
    tier.end_step()
    with pytest.raises(AssertionError, match="in both the device and the host tier"):
        tier.check_integrity({H[0]})
    tier._free.append(0)
    with pytest.raises(AssertionError, match="free \\+ held != total"):
        tier.check_integrity(set())
    with pytest.raises(ValueError, match="already in the host tier"):
        tier.offload(H[0], 6)


# ---- KVCacheManager: offloads and loads with exact ids -----------------------------------
def test_evicted_blocks_go_to_host_and_come_back_on_a_hit() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS, num_host_tier_blocks=4)
    tier = manager.host_tier
    a = make_request("a", list(range(13)))
    assert schedule(manager, a) == [1, 2, 3, 4]
    manager.free(a)
    # a's partly filled block 4 is uncached (taken first); its cached blocks tail first.
    assert free_ids(manager) == [5, 6, 4, 3, 2, 1]
    assert manager.end_step() == ([], [])
    # x takes 4 blocks: the 4th is a's third (cached) block, which goes to host slot 0.
    x = make_request("x", list(range(100, 116)))
    assert schedule(manager, x) == [5, 6, 4, 3]
    assert manager.end_step() == ([(3, 0)], [])
    assert tier.lru_hashes() == [a.block_hashes[2]]
    manager.free(x)
    # y evicts a's second and first blocks, in that (free queue) order.
    y = make_request("y", list(range(200, 208)))
    assert schedule(manager, y) == [2, 1]
    assert manager.end_step() == ([(2, 1), (1, 2)], [])
    assert tier.lru_hashes() == [a.block_hashes[2], a.block_hashes[1], a.block_hashes[0]]
    assert cached_ids(manager, a.block_hashes) == [None, None, None]
    manager.check_integrity()

    # a's prompt again: no device hit, three host hits (never the last token's block).
    b = make_request("b", list(range(13)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits == [] and num_hit_tokens == 12
    assert schedule(manager, b) == [3, 4, 6, 5]
    assert b.num_computed_tokens == 13
    offloads, loads = manager.end_step()
    # The blocks b takes were x's cached ones: x's last block goes to the one free slot
    # (3); slots 0-2 are being loaded this step, so x's other blocks are dropped.
    assert offloads == [(3, 3)] and tier.num_dropped == 3
    # a's blocks come back in table order: a0 from slot 2 into device block 3, and so on.
    # (Device block 3 is also offloaded: the runner copies device -> host first.)
    assert loads == [(2, 3), (1, 4), (0, 6)]
    # Registered at b's commit (the schedule helper's), once the copies have been made.
    assert cached_ids(manager, a.block_hashes) == [3, 4, 6]
    assert tier.lru_hashes() == [x.block_hashes[3]]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (13 + 16 + 8 + 13, 12)
    assert manager.prefix_cache_host_hits == 12
    manager.check_integrity([b])
    manager.free(b)
    manager.free(y)
    manager.check_integrity()


def test_loaded_blocks_are_registered_at_commit_and_failed_offloads_forgotten() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, num_host_tier_blocks=4)
    a = make_request("a", list(range(9)))
    assert schedule(manager, a) == [1, 2, 3]
    manager.free(a)
    x = make_request("x", list(range(100, 109)))
    assert schedule(manager, x) == [3, 2, 1]  # evicts a's blocks 2 and 1 to host
    assert manager.end_step() == ([(2, 0), (1, 1)], [])
    manager.free(x)
    manager.check_integrity()
    # b loads a's two blocks; until its step commits they are not findable anywhere.
    b = make_request("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 1, hits, num_hit_tokens) is not None
    b.num_computed_tokens = 9
    offloads, loads = manager.end_step()
    # Device block 1 was free and uncached; 2 and 3 held x's cached blocks (offloaded).
    assert loads == [(1, 1), (0, 2)] and offloads == [(2, 2), (3, 3)]
    assert cached_ids(manager, a.block_hashes) == [None, None]
    assert a.block_hashes[0] not in manager.host_tier
    # The step fails: b is rolled back, the offloads of x's blocks are forgotten.
    manager.free(b)
    b.num_computed_tokens = 0
    manager.discard_offloads(offloads)
    assert len(manager.host_tier) == 0
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
    manager.check_integrity()


def test_host_hits_continue_the_device_chain_and_spare_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS, num_host_tier_blocks=8)
    a = make_request("a", list(range(12)))
    assert schedule(manager, a) == [1, 2, 3]
    manager.free(a)  # free: uncached 4 5, then cached 3 2 1 (a's tail evicted first)
    assert schedule(manager, make_request("x", list(range(100, 112)))) == [4, 5, 3]
    assert manager.end_step() == ([(3, 0)], [])
    # Exactly a's 12 tokens: blocks 1 and 2 on the device, block 3 in host, but the last
    # token must be computed, so the hit stops at 8 tokens (no load).
    exact = make_request("exact", list(range(12)))
    hits, num_hit_tokens = manager.get_computed_blocks(exact)
    assert ids(hits) == [1, 2] and num_hit_tokens == 8
    # One token more: the chain continues into host.
    longer = make_request("longer", list(range(12)) + [99])
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert ids(hits) == [1, 2] and num_hit_tokens == 12
    assert manager.allocate_slots(longer, 1, hits, num_hit_tokens) is None, "2 free, 2 hits"
    assert manager.end_step() == ([], []) and len(manager.host_tier) == 1
    manager.check_integrity()


def test_device_registration_drops_the_host_copy() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, num_host_tier_blocks=4)
    a = make_request("a", list(range(5)))
    assert schedule(manager, a) == [1, 2]
    manager.free(a)
    x = make_request("x", list(range(100, 109)))
    assert schedule(manager, x) == [3, 2, 1]
    assert manager.end_step() == ([(1, 0)], [])
    manager.free(x)
    assert free_ids(manager) == [1, 2, 3]
    # A request that skips the lookup (as prompt logprobs do) computes a's block again:
    # at its commit it is registered on the device and the host entry goes (one hash,
    # one tier).
    again = make_request("again", list(range(5)))
    assert manager.allocate_slots(again, 5) is not None
    assert manager.get_block_ids("again") == [1, 2]
    again.num_computed_tokens = 5
    manager.cache_blocks(again)
    assert cached_ids(manager, again.block_hashes) == [1]
    assert manager.host_tier.lru_hashes() == [x.block_hashes[1]]
    assert manager.end_step() == ([(2, 1)], [])
    manager.check_integrity([again])


def test_stale_host_hit_is_rejected() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS, num_host_tier_blocks=1)
    a = make_request("a", list(range(5)))
    assert schedule(manager, a) == [1, 2]
    manager.free(a)
    assert schedule(manager, make_request("x", list(range(100, 109)))) == [3, 2, 1]
    manager.end_step()
    b = make_request("b", list(range(5)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits == [] and num_hit_tokens == 4
    manager.host_tier.discard(b.block_hashes[0])
    with pytest.raises(RuntimeError, match="host-tier hit was evicted"):
        manager.allocate_slots(b, 1, hits, num_hit_tokens)
    manager.end_step()
    manager.check_integrity()


def test_disabled_tier_does_nothing() -> None:
    on = KVCacheManager(num_blocks=5, block_size=BS, num_host_tier_blocks=4)
    off = KVCacheManager(num_blocks=5, block_size=BS)
    assert off.host_tier is None and off.host_tier_usage == 0.0
    for manager in (on, off):
        a = make_request("a", list(range(9)))
        assert schedule(manager, a) == [1, 2, 3]
        manager.free(a)
        assert schedule(manager, make_request("x", list(range(100, 113)))) == [4, 3, 2, 1]
    assert on.end_step() == ([(2, 0), (1, 1)], [])
    assert off.end_step() == ([], [])
    b_on, b_off = make_request("b", list(range(9))), make_request("b", list(range(9)))
    assert on.get_computed_blocks(b_on) == ([], 8)
    assert off.get_computed_blocks(b_off) == ([], 0)
    with pytest.raises(ValueError, match="host-tier blocks"):
        off.allocate_slots(b_off, 1, [], 8)
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False, num_host_tier_blocks=2)
    on.check_integrity()
    off.check_integrity()


def test_reset_prefix_cache_clears_the_host_tier() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS, num_host_tier_blocks=2)
    a = make_request("a", list(range(5)))
    assert schedule(manager, a) == [1, 2]
    manager.free(a)
    x = make_request("x", list(range(100, 105)))
    assert schedule(manager, x) == [2, 1]
    manager.end_step()
    assert len(manager.host_tier) == 1
    assert manager.reset_prefix_cache() is False
    manager.free(x)
    assert manager.reset_prefix_cache() is True
    assert len(manager.host_tier) == 0
    assert manager.get_computed_blocks(make_request("b", list(range(5)))) == ([], 0)
    manager.check_integrity()


# ---- the runner's copies ------------------------------------------------------------------
def test_runner_copies_every_device_to_host_block_before_any_host_to_device_one() -> None:
    def cache(n: int, base: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k = base + torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, BS, 1, 1)
        return [(k.clone(), -k.clone())]

    kv, swap, tier = cache(4, 0.0), cache(2, 100.0), cache(4, 200.0)
    # Device block 2 is evicted to tier slot 3 and reused for a tier hit (slot 1); device
    # block 1 is swapped out and reused for a swap-in (host block 0).
    out = SchedulerOutput(blocks_to_swap_out=[(1, 1)], blocks_to_swap_in=[(0, 1)],
                          blocks_to_offload=[(2, 3)], blocks_to_onload=[(1, 2)])
    swap_blocks(out, kv, swap, tier)
    k = kv[0][0][:, 0, 0, 0].tolist()
    assert k == [0.0, 100.0, 201.0, 3.0]
    assert tier[0][0][:, 0, 0, 0].tolist() == [200.0, 201.0, 202.0, 2.0]
    assert swap[0][0][:, 0, 0, 0].tolist() == [100.0, 1.0]
    assert kv[0][1][2].eq(-201.0).all() and tier[0][1][3].eq(-2.0).all()


# ---- scheduler + a runner that writes and checks real KV ---------------------------------
class StepFault(Exception):
    """A fault injected into a step (see KVCheckingRunner.execute)."""


class KVCheckingRunner:
    """Keeps block tables from the scheduler's diffs like the real runner, performs the
    copies with the real worker's swap_blocks, writes each scheduled token's K/V (K =
    token id, V = position), then reads every scheduled request's whole context back
    through its table. Samples a token that depends on the context, so histories differ.
    """

    def __init__(self, num_blocks: int, num_swap_blocks: int, num_tier_slots: int) -> None:
        def cache(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(torch.full((n, BS, 1, 1), -1.0), torch.full((n, BS, 1, 1), -1.0))]

        self.kv = cache(num_blocks)
        self.swap, self.tier = cache(num_swap_blocks), cache(num_tier_slots)
        self.tables: dict[str, list[int]] = {}
        self.num_checked_hits = 0

    def execute(self, sched: Scheduler, out: SchedulerOutput,
                fault: str | None = None) -> ModelRunnerOutput:
        """Run the step; `fault` raises StepFault before the copies ("copies"), after them
        ("forward"), or after writing half of the step's tokens ("half")."""
        if fault == "copies":
            raise StepFault(fault)
        swap_blocks(out, self.kv, self.swap, self.tier)
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            self.num_checked_hits += new.num_computed_tokens > 0
        for cached in out.scheduled_cached_reqs:
            self.tables[cached.req_id].extend(cached.new_block_ids[0])
        if fault == "forward":
            raise StepFault(fault)
        k, v = self.kv[0]
        for i, (req_id, n) in enumerate(out.num_scheduled_tokens.items()):
            if fault == "half" and 2 * i >= len(out.num_scheduled_tokens):
                raise StepFault(fault)
            req, table = sched.requests[req_id], self.tables[req_id]
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                k[table[pos // BS], pos % BS] = req.all_token_ids[pos]
                v[table[pos // BS], pos % BS] = pos
        result = ModelRunnerOutput()
        for req_id in out.num_scheduled_tokens:
            req, table = sched.requests[req_id], self.tables[req_id]
            pos = torch.arange(req.num_computed_tokens)
            slots = torch.tensor(table)[pos // BS], pos % BS
            assert k[slots].flatten().long().tolist() == req.all_token_ids[: len(pos)], req_id
            assert v[slots].flatten().long().tolist() == pos.tolist(), req_id
            if req.num_computed_tokens == req.num_tokens:
                token = 3 + (req.all_token_ids[-1] * 31 + len(pos)) % 997
                result.sampled_token_ids[req_id] = [token]
        return result


@pytest.mark.parametrize(("mode", "policy"),
                         [("recompute", "fcfs"), ("swap", "fcfs"), ("recompute", "priority")])
def test_conversations_through_the_host_tier_read_back_their_kv(mode, policy) -> None:
    sched, _ = run_conversations(mode, policy, fault_rate=0.0)
    assert sched.num_preemptions > 0


@pytest.mark.parametrize(("mode", "policy"), [("recompute", "fcfs"), ("swap", "priority")])
def test_failed_steps_roll_back_and_no_unwritten_kv_is_ever_read(mode, policy) -> None:
    """The same conversations with one step in five failing: before its copies, after
    them, or halfway through writing its tokens. Each failed step is rolled back as
    LLMEngine.step does; the runner checks every context it reads, so a cache hit on a
    block whose K/V or copy a failed step never wrote would fail the run."""
    sched, num_faults = run_conversations(mode, policy, fault_rate=0.2)
    assert num_faults > 10
    assert sched.num_preemptions > 0


def run_conversations(mode: str, policy: str, fault_rate: float):
    """Three conversations of five turns, with bursts of other prompts in between, on a
    cache too small to keep them: histories are evicted between turns and come back from
    host (host tier; swap or recompute preemption). Returns (scheduler, number of faults)."""
    # 24 device blocks (96 tokens) for 3 conversations growing to ~80 tokens plus bursts of
    # other prompts: histories are evicted between turns and come back from host.
    num_blocks, num_tier, num_swap = 24, 48, 16
    kv = KVCacheManager(num_blocks, BS, num_host_tier_blocks=num_tier)
    sched = Scheduler(kv, 6, 32, 128, policy=policy, preemption_mode=mode,
                      num_host_blocks=num_swap)
    runner = KVCheckingRunner(num_blocks, num_swap, num_tier)
    rng = random.Random(0)
    histories = {c: [rng.randrange(3, 1000) for _ in range(rng.randint(6, 14))] for c in "abc"}
    num_steps = num_aborts = num_faults = 0
    for turn in range(5):
        reqs = []
        for c, history in histories.items():
            reqs.append(Request(f"{c}{turn}", history, SamplingParams(max_tokens=5),
                                priority=rng.randint(-1, 1)))
        for i in range(rng.randint(2, 4)):
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(10, 30))]
            # NOTE: a duplicate in the same round may hit blocks committed a step earlier.
            for dup in range(rng.choice([1, 1, 2])):
                reqs.append(Request(f"burst{turn}.{i}.{dup}", prompt,
                                    SamplingParams(max_tokens=rng.randint(1, 4))))
        for req in reqs:
            sched.add_request(req)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.check_integrity()
            fault = rng.choice(["copies", "forward", "half"]) if (
                rng.random() < fault_rate) else None
            try:
                runner_out = runner.execute(sched, out, fault)
            except StepFault:
                failed = sched.rollback_step(out)
                assert set(failed) == set(out.num_scheduled_tokens)
                num_faults += 1
            else:
                sched.update_from_output(out, runner_out)
            sched.check_integrity()
            num_steps += 1
            assert num_steps < 3000, "no progress"
            victims = [r for r in reqs if r.req_id.startswith("burst") and not r.is_finished]
            if victims and rng.random() < 0.05:
                sched.finish_requests(rng.choice(victims).req_id, RequestStatus.FINISHED_ABORTED)
                num_aborts += 1
                sched.check_integrity()
        for c in histories:
            (req,) = [r for r in reqs if r.req_id == f"{c}{turn}"]
            assert req.num_output_tokens == 5
            histories[c] = req.all_token_ids + [rng.randrange(3, 1000) for _ in range(8)]
    assert kv.usage == 0.0
    stats = sched.get_stats()
    assert stats.prefix_cache_host_hits > 0 and kv.host_tier.num_loaded > 0
    assert stats.prefix_cache_host_hits <= stats.prefix_cache_hits
    assert 0 < stats.host_tier_usage <= 1
    assert runner.num_checked_hits > 0 and num_aborts > 0
    return sched, num_faults
