"""KVCacheManager: block tables, prefix hits, eviction order, admission without side
effects and registration at commit only. Block size 4; block 0 is the null block, so a
manager of n blocks hands out 1..n-1; every scenario ends with check_integrity().
"""

from __future__ import annotations

import pytest

from pagoda.core.block_pool import KVCacheBlock
from pagoda.core.hashing import update_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager, KVOccupancy
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, prompt: list[int], salt: str | None = None) -> Request:
    request = Request(req_id, list(prompt), SamplingParams(), cache_salt=salt)
    update_block_hashes(request, BS)  # as the engine does when a request is added
    return request


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    """Free blocks in eviction order: uncached ones, then cached ones LRU first."""
    return ids(manager.block_pool.get_free_blocks())


def schedule(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> list[int] | None:
    """Admit and run like the scheduler: prefix lookup for a request without blocks,
    allocate, advance num_computed_tokens, and commit (register the blocks it filled).
    Returns the new block ids, or None if refused.
    """
    hits, num_hit_tokens = [], 0
    if not manager.get_block_ids(request.req_id):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, hits, num_hit_tokens)
    if new_blocks is None:
        return None
    request.num_computed_tokens += num_hit_tokens + num_new_tokens
    manager.cache_blocks(request)
    return ids(new_blocks)


def decode(manager: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """One decode step: the sampled token is appended, hashed if it fills a block, and
    gets a slot.
    """
    request.append_output_token_ids(token_id)
    update_block_hashes(request, BS)
    return schedule(manager, request)


def test_allocate_until_exhausted_then_none_without_state_change() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(100, 107)))
    assert schedule(manager, a) == [1, 2]
    assert schedule(manager, b) == [3, 4]
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    c = make_request("c", [7])
    assert schedule(manager, c) is None
    assert decode(manager, b, 9) == []  # the 8th token fills block 4
    assert decode(manager, b, 9) is None  # the 9th needs a fifth block
    assert b.num_computed_tokens == 8
    assert manager.get_block_ids("b") == [3, 4] and manager.get_block_ids("c") == []
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == [0, 1, 1, 1, 1]
    manager.check_integrity([a, b])
    manager.free(a)  # as a preemption would; then the refused step is retried
    assert schedule(manager, b) == [2]  # the tail of a's table is evicted first
    assert manager.get_block_ids("b") == [3, 4, 2]
    manager.check_integrity([b])


def test_decode_grows_table_one_block_at_a_time() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    request = make_request("a", [1, 2, 3])
    assert schedule(manager, request) == [1]
    assert decode(manager, request, 4) == []
    assert decode(manager, request, 5) == [2]
    assert [decode(manager, request, t) for t in (6, 7, 8)] == [[], [], []]
    assert decode(manager, request, 9) == [3]
    assert manager.get_block_ids("a") == [1, 2, 3]
    manager.check_integrity([request])


def test_blocks_are_registered_at_commit_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(14)))
    cached = manager.block_pool.cached_block_hash_to_block
    assert ids(manager.allocate_slots(request, 5)) == [1, 2]
    assert not cached, "allocation must not register: the step has not run yet"
    request.num_computed_tokens = 5
    manager.cache_blocks(request)  # the step committed: block 1 holds tokens 0..3
    assert [block.block_id for block in cached.values()] == [1]
    assert schedule(manager, request, num_new_tokens=9) == [3, 4]
    assert [cached[h].block_id for h in request.block_hashes] == [1, 2, 3]
    assert decode(manager, request, 14) == []
    assert decode(manager, request, 15) == []  # token 15 fills block 4
    assert cached[request.block_hashes[3]].block_id == 4
    manager.check_integrity([request])


def test_uncommitted_blocks_are_never_found() -> None:
    """A step that fails after allocating: its blocks are freed without a commit and no
    twin request may hit them (their K/V was never written)."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    assert manager.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10  # as schedule() advances it before the forward
    manager.check_integrity([a])
    twin = make_request("twin", list(range(10)))
    assert manager.get_computed_blocks(twin) == ([], 0)
    manager.free(a)  # the rollback
    assert manager.get_computed_blocks(twin) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert free_ids(manager) == [4, 5, 6, 7, 3, 2, 1]  # uncached, reusable first
    manager.check_integrity()


def test_free_in_reverse_order_and_lru_eviction() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(100, 104)))
    assert schedule(manager, a) == [1, 2, 3]
    assert schedule(manager, b) == [4]
    manager.free(a)
    # a's partly filled block 3 has no hash: it joins the uncached blocks; its cached
    # blocks go tail first.
    assert free_ids(manager) == [5, 6, 3, 2, 1]
    manager.free(b)
    assert free_ids(manager) == [5, 6, 3, 2, 1, 4]
    manager.check_integrity()
    # Allocation takes the uncached blocks, then the least recently freed cached ones;
    # a's cached head (block 1) goes last.
    c = make_request("c", list(range(200, 219)))
    assert schedule(manager, c) == [5, 6, 3, 2, 1]
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is None
    assert manager.block_pool.get_cached_block(b.block_hashes[0]).block_id == 4
    manager.check_integrity([c])


def test_prefix_hit_shares_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [1, 2, 3]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit_tokens == 8
    assert manager.allocate_slots(b, 3, hits, num_hit_tokens) is not None
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 5)] == [2, 2, 1, 1]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 11, 8)
    manager.check_integrity([a])
    manager.free(a)
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 5)] == [1, 1, 0, 1]
    assert free_ids(manager)[-1] == 3
    manager.check_integrity()


def test_hit_never_covers_last_prompt_token() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    assert schedule(manager, make_request("a", list(range(12)))) == [1, 2, 3]
    exact = make_request("b", list(range(8)))  # exactly 2 full blocks, both cached
    hits, num_hit_tokens = manager.get_computed_blocks(exact)
    assert ids(hits) == [1] and num_hit_tokens == 4
    one_more = make_request("c", list(range(9)))
    assert ids(manager.get_computed_blocks(one_more)[0]) == [1, 2]
    assert manager.get_computed_blocks(make_request("d", [0, 1, 2, 3])) == ([], 0)
    manager.check_integrity()


def test_cache_salt_prevents_hits() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    prompt = list(range(10))
    assert schedule(manager, make_request("a", prompt, salt="tenant-1")) == [1, 2, 3]
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", prompt, salt="tenant-2")) == ([], 0)
    same = manager.get_computed_blocks(make_request("d", prompt, salt="tenant-1"))
    assert ids(same[0]) == [1, 2]
    manager.check_integrity()


def test_freed_cached_blocks_reused_from_queue_middle_then_evicted() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [1, 2, 3]
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    b = make_request("b", list(range(8)) + [60])
    assert schedule(manager, b) == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 3]  # 2 and 1 left the queue
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 9, 8)
    manager.check_integrity([b])
    manager.free(b)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    # A 36-token request needs 9 blocks: the 8 uncached ones, then it evicts cached
    # block 2 but not block 1.
    c = make_request("c", list(range(300, 336)))
    assert schedule(manager, c) == [5, 6, 7, 8, 9, 10, 3, 4, 2]
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert pool.blocks[2].block_hash == c.block_hashes[8]  # re-registered for c
    hits, _ = manager.get_computed_blocks(make_request("d", list(range(10))))
    assert ids(hits) == [1]  # the chain breaks at the evicted block
    manager.check_integrity([c])


def test_reused_free_hits_are_not_capacity() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [1, 2, 3]
    manager.free(a)
    assert free_ids(manager) == [4, 3, 2, 1]
    # 17 tokens: 2 hit blocks + 3 new, but only 2 of the 4 free blocks are not hits.
    big = make_request("big", list(range(8)) + list(range(70, 79)))
    assert schedule(manager, big) is None
    assert free_ids(manager) == [4, 3, 2, 1]
    assert [block.ref_cnt for block in manager.block_pool.blocks] == [0, 0, 0, 0, 0]
    assert manager.block_pool.get_cached_block(a.block_hashes[1]).block_id == 2
    assert big.num_computed_tokens == 0 and manager.prefix_cache_queries == 10
    manager.check_integrity()
    fits = make_request("fits", list(range(8)) + list(range(70, 76)))
    assert schedule(manager, fits) == [4, 3]
    assert manager.get_block_ids("fits") == [1, 2, 4, 3]
    manager.check_integrity([fits])


def test_stale_hits_are_rejected() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(6)))
    assert schedule(manager, a) == [1, 2]
    manager.free(a)
    b = make_request("b", list(range(6)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1]
    schedule(manager, make_request("x", list(range(500, 512))))  # evicts block 1
    with pytest.raises(RuntimeError, match="evicted"):
        manager.allocate_slots(b, 2, hits, num_hit_tokens)
    manager.check_integrity()


def test_concurrent_duplicate_blocks_stay_uncached() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    hits_b = manager.get_computed_blocks(b)  # looked up before a registers anything
    assert schedule(manager, a) == [1, 2]
    assert manager.allocate_slots(b, 6, *hits_b) is not None
    b.num_computed_tokens = 6
    manager.cache_blocks(b)  # b's step commits after a's: a's block keeps the hash
    assert manager.get_block_ids("b") == [3, 4]
    assert manager.block_pool.get_cached_block(b.block_hashes[0]).block_id == 1
    assert manager.block_pool.blocks[3].block_hash is None
    manager.check_integrity([a, b])
    manager.free(a)
    manager.free(b)
    manager.check_integrity()


def test_preempted_request_is_not_counted_again() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    a = make_request("a", list(range(9)))
    assert schedule(manager, a) == [1, 2, 3]
    manager.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1
    assert schedule(manager, a) == [4]  # blocks 1 and 2 come back as hits
    assert manager.get_block_ids("a") == [1, 2, 4]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 0)
    manager.check_integrity([a])


def test_caching_off_gives_no_hits() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS, enable_caching=False)
    assert schedule(manager, make_request("a", list(range(10)))) == [1, 2, 3]
    b = make_request("b", list(range(10)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert schedule(manager, b) == [4, 5, 6]
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.check_integrity([b])


def test_misuse_and_reset() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(5)))
    assert schedule(manager, a) == [1, 2]
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(a, 1, [manager.block_pool.blocks[3]], 4)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    manager.free(a)  # freeing twice is a no-op, not a double free
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(5)))) == ([], 0)
    manager.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(5)))
    schedule(manager, a)
    manager.check_integrity([a])
    manager.block_pool.blocks[1].ref_cnt = 2  # corrupted ref count
    with pytest.raises(AssertionError, match="ref_cnt != 1 table appearances"):
        manager.check_integrity()
    manager.block_pool.blocks[1].ref_cnt = 1
    # A registered block whose tokens its holder has not computed.
    a.num_computed_tokens = 3
    with pytest.raises(AssertionError, match="more blocks offered to the cache than computed"):
        manager.check_integrity([a])
    manager.num_cached_blocks["a"][0] = 0
    with pytest.raises(AssertionError, match="registered but its tokens were not computed"):
        manager.check_integrity([a])
    a.num_computed_tokens, manager.num_cached_blocks["a"][0] = 5, 1
    a.block_hashes[0] = b"h" * 32
    with pytest.raises(AssertionError, match="under another prefix's hash"):
        manager.check_integrity([a])
    manager.req_to_blocks["a"][0].append(manager.req_to_blocks["a"][0][0])
    with pytest.raises(AssertionError, match="a block twice in table"):
        manager.check_integrity()


def test_occupancy_counts_shared_blocks_once_and_partial_blocks_by_fill() -> None:
    manager = KVCacheManager(num_blocks=17, block_size=BS)
    a = make_request("a", range(10))  # blocks of 4, 4, 2 tokens
    assert schedule(manager, a) == [1, 2, 3]
    b = make_request("b", [*range(8), 50, 51, 52])  # hits a's 2 full blocks, then 3 tokens
    assert schedule(manager, b) == [4]
    c = make_request("c", range(100, 109))
    assert schedule(manager, c, 5) == [5, 6]  # chunked prefill: 4 + 1 tokens so far
    assert manager.occupancy([a]) == KVOccupancy(3, 12, 10)
    both = manager.occupancy([a, b])
    assert both == KVOccupancy(4, 16, 13) and both.num_wasted_slots == 3
    # Slots allocated for tokens not computed yet hold nothing: c's table grows to cover
    # 9 tokens (3 blocks) while num_computed_tokens stays 5.
    assert ids(manager.allocate_slots(c, 4)) == [7]
    assert manager.occupancy([a, b, c]) == KVOccupancy(7, 28, 18)
    assert manager.occupancy([make_request("idle", [1])]) == KVOccupancy(0, 0, 0)
    manager.check_integrity([a, b, c])


def test_peak_num_used_blocks_is_a_high_water_mark() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(10))
    schedule(manager, a)
    b = make_request("b", [*range(8), 50, 51, 52])
    schedule(manager, b)  # 2 shared blocks: 4 in use, not 6
    assert manager.peak_num_used_blocks == 4
    manager.free(a)
    manager.free(b)
    assert manager.peak_num_used_blocks == 4 and manager.usage == 0.0
    manager.reset_peak_num_used_blocks()
    assert manager.peak_num_used_blocks == 0
    again = make_request("again", range(10))  # 2 hits on freed cached blocks + 1 new
    schedule(manager, again)
    assert manager.peak_num_used_blocks == 3
