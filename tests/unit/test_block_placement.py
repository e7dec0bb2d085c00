"""Block placement (KVCacheManager growth_reserve_blocks): a request's blocks run in
consecutive ids, the blocks after them are held for its growth, and the reservations are
soft (counted free, stolen last, given up to prefix hits, returned on free). Block size 4;
block 0 is the null block. Every scenario ends with check_integrity().
"""

from __future__ import annotations

import random
from itertools import pairwise

from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunnerOutput

BS = 4


def make_request(req_id: str, prompt: list[int], max_tokens: int = 64) -> Request:
    request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens))
    update_block_hashes(request, BS)
    return request


def schedule(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Admit (with a prefix lookup) or grow `request` to all its tokens, and commit."""
    hits, num_hit_tokens = [], 0
    if not manager.get_block_ids(request.req_id):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new, hits, num_hit_tokens)
    if new_blocks is None:
        return None
    request.num_computed_tokens += num_hit_tokens + num_new
    manager.cache_blocks(request)
    return [b.block_id for b in new_blocks]


def grow(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Decode `num_tokens` tokens one step at a time."""
    for _ in range(num_tokens):
        request.append_output_token_ids(5)
        update_block_hashes(request, BS)
        assert schedule(manager, request) is not None


def reserved_ids(manager: KVCacheManager, owner: str) -> list[int]:
    return [b.block_id for b in manager.block_pool.blocks if b.reserved_for == owner]


def test_growth_continues_into_the_blocks_after_the_table() -> None:
    manager = KVCacheManager(64, BS, growth_reserve_blocks=3)
    a, b = make_request("a", range(8)), make_request("b", range(100, 104))
    assert schedule(manager, a) == [1, 2]
    assert reserved_ids(manager, "a") == [3, 4, 5]
    # NOTE: b is placed past a's reservation, not at the queue's next block (3).
    assert schedule(manager, b) == [6]
    assert reserved_ids(manager, "b") == [7, 8, 9]
    grow(manager, a, 12)  # three more blocks: the reserved ones
    assert manager.get_block_ids("a") == [1, 2, 3, 4, 5]
    assert reserved_ids(manager, "a") == []
    grow(manager, a, 1)  # the reservation is used up: a new run with a new reservation
    assert manager.get_block_ids("a") == [1, 2, 3, 4, 5, 10]
    assert reserved_ids(manager, "a") == [11, 12, 13]
    manager.check_integrity([a, b])


def test_reservations_count_as_free_and_admission_is_unchanged() -> None:
    on = KVCacheManager(9, BS, growth_reserve_blocks=4)
    off = KVCacheManager(9, BS)
    for manager in (on, off):
        a = make_request("a", range(8))
        b = make_request("b", range(100, 124))  # 6 blocks: all the rest
        assert schedule(manager, a) is not None
        assert manager.num_free_blocks == 6
        assert schedule(manager, b) is not None
        assert manager.num_free_blocks == 0
        assert schedule(manager, make_request("c", [7])) is None
        manager.check_integrity([a, b])
    # NOTE: with placement on, b took a's reservation (stolen) and is still one run.
    assert on.get_block_ids("b") == [3, 4, 5, 6, 7, 8]
    assert reserved_ids(on, "a") == []


def test_reservation_is_capped_by_max_tokens() -> None:
    manager = KVCacheManager(64, BS, growth_reserve_blocks=8)
    a = make_request("a", range(6), max_tokens=5)  # at most 11 tokens: 3 blocks
    assert schedule(manager, a) == [1, 2]
    assert reserved_ids(manager, "a") == [3]
    unbounded = make_request("u", range(50, 54), max_tokens=None)
    assert schedule(manager, unbounded) == [4]
    assert reserved_ids(manager, "u") == list(range(5, 13))
    manager.check_integrity([a, unbounded])


def test_steals_take_the_newest_reservation_from_its_far_end() -> None:
    manager = KVCacheManager(11, BS, growth_reserve_blocks=3)
    a, b = make_request("a", range(4)), make_request("b", range(100, 104))
    assert schedule(manager, a) == [1]  # reserves 2, 3, 4
    assert schedule(manager, b) == [5]  # reserves 6, 7, 8
    assert schedule(manager, make_request("c", range(200, 212))) == [8, 9, 10]
    assert reserved_ids(manager, "b") == [6, 7] and reserved_ids(manager, "a") == [2, 3, 4]
    grow(manager, b, 8)  # b still grows into what is left of its reservation
    assert manager.get_block_ids("b") == [5, 6, 7]
    manager.check_integrity([a, b])


def test_a_prefix_hit_takes_a_reserved_cached_block_from_its_owner() -> None:
    manager = KVCacheManager(9, BS, growth_reserve_blocks=1)
    old1, old2 = make_request("old1", range(4), 1), make_request("old2", range(50, 54), 1)
    assert schedule(manager, old1) == [1]  # reserves 2
    assert schedule(manager, old2) == [3]  # reserves 4
    manager.free(old1)
    manager.free(old2)  # cached: 1 then 3; uncached: 5-8 and the returned 2, 4
    filler = make_request("filler", range(300, 320), 1)
    assert schedule(manager, filler) == [2, 4, 5, 6, 7]  # reserves 8
    # No block is uncached-free: a's run and reservation come from the cached queue, the
    # oldest first (old1's block, then old2's, which keeps its hash while reserved).
    a = make_request("a", range(100, 104))
    assert schedule(manager, a) == [1]
    assert reserved_ids(manager, "a") == [3]
    again = make_request("again", [*range(50, 54), 9])  # old2's prompt, one more token
    assert schedule(manager, again) == [8]  # its one new block: filler's reservation
    assert manager.get_block_ids("again") == [3, 8]
    assert manager.prefix_cache_hits == 4
    assert reserved_ids(manager, "a") == [] and reserved_ids(manager, "filler") == []
    manager.check_integrity([a, filler, again])
    manager.free(again)
    grow(manager, a, 4)  # the reserved entry a lost is skipped: it takes the uncached 8
    assert manager.get_block_ids("a") == [1, 8]
    manager.check_integrity([a, filler])


def test_blocks_of_rejected_drafts_are_held_for_the_table_again() -> None:
    manager = KVCacheManager(32, BS, growth_reserve_blocks=2)
    a = make_request("a", range(8))
    assert schedule(manager, a) == [1, 2]  # reserves 3, 4
    # A step with 9 draft tokens: three more blocks (3, 4, then a new run: 5, reserving 6, 7).
    assert [b.block_id for b in manager.allocate_slots(a, 9)] == [3, 4, 5]
    a.append_output_token_ids(5)  # the step's one token: all drafts were rejected
    a.num_computed_tokens += 1
    manager.free_uncomputed_tail(a)
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert reserved_ids(manager, "a") == [4, 5, 6, 7]
    grow(manager, a, 11)  # 20 tokens: five blocks
    assert manager.get_block_ids("a") == [1, 2, 3, 4, 5]
    manager.check_integrity([a])


def test_free_returns_the_reservation_ahead_of_the_table() -> None:
    manager = KVCacheManager(16, BS, growth_reserve_blocks=3)
    a = make_request("a", range(100, 108))
    assert schedule(manager, a) == [1, 2]
    manager.free(a)
    assert reserved_ids(manager, "a") == []
    free = [b.block_id for b in manager.block_pool.get_free_blocks()]
    # NOTE: uncached first (the never-used blocks, then the returned reservation, tail
    # first), then a's cached blocks, tail first.
    assert free == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 4, 3, 2, 1]
    manager.check_integrity()


def _run_long_mix(reserve: int, num_blocks: int) -> tuple[float, dict[str, int]]:
    """Forty requests of random lengths through the real Scheduler with a fake runner;
    returns the share of consecutive neighbours in the tables of decoding requests, and
    the tokens each request was given."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks, BS, growth_reserve_blocks=reserve)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    for i in range(40):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(4, 40))]
        sched.add_request(Request(f"r{i}", prompt,
                                  SamplingParams(max_tokens=rng.randint(4, 60),
                                                 ignore_eos=True)))
    pairs = consecutive = 0
    sampled: dict[str, int] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        result = ModelRunnerOutput()
        for req_id in out.num_scheduled_tokens:
            req = sched.requests[req_id]
            if req.num_computed_tokens == req.num_tokens:
                result.sampled_token_ids[req_id] = [7]
                sampled[req_id] = sampled.get(req_id, 0) + 1
                ids = kv.get_block_ids(req_id)
                pairs += len(ids) - 1
                consecutive += sum(b == a + 1 for a, b in pairwise(ids))
        sched.update_from_output(out, result)
        sched.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks
    return consecutive / pairs, sampled


def test_placement_keeps_tables_consecutive_under_a_scheduler() -> None:
    # 400 blocks for 16 running requests of up to 25: about as full as the long benchmark's
    # pool; 160: a tight pool where most reservations get stolen.
    placed, placed_sampled = _run_long_mix(4, 400)
    plain, plain_sampled = _run_long_mix(0, 400)
    assert placed >= 0.8 and plain <= 0.5, (placed, plain)
    assert placed_sampled == plain_sampled
    tight, tight_sampled = _run_long_mix(4, 160)
    tight_plain, _ = _run_long_mix(0, 160)
    assert tight > tight_plain, (tight, tight_plain)
    assert tight_sampled == plain_sampled
