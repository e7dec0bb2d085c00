"""KVCacheManager: block tables, prefix hits, eviction order and admission without side
effects. Block size 4; every scenario ends with check_integrity().
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
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def schedule(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> list[int] | None:
    """Admit like the scheduler: prefix lookup for a request without blocks, then allocate
    and advance num_computed_tokens. Returns the new block ids, or None if refused.
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
    return ids(new_blocks)


def decode(manager: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """One decode step: the sampled token is appended, hashed if it fills a block, and
    gets a slot.
    """
    request.append_output_token_ids(token_id)
    update_block_hashes(request, BS)
    return schedule(manager, request)


def test_allocate_until_exhausted_then_none_without_state_change() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(100, 107)))
    assert schedule(manager, a) == [0, 1]
    assert schedule(manager, b) == [2, 3]
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    c = make_request("c", [7])
    assert schedule(manager, c) is None
    assert decode(manager, b, 9) == []  # the 8th token fills block 3
    assert decode(manager, b, 9) is None  # the 9th needs a fifth block
    assert b.num_computed_tokens == 8
    assert manager.get_block_ids("b") == [2, 3] and manager.get_block_ids("c") == []
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == [1, 1, 1, 1]
    manager.check_integrity()
    manager.free(a)  # as a preemption would; then the refused step is retried
    assert schedule(manager, b) == [1]  # the tail of a's table is evicted first
    assert manager.get_block_ids("b") == [2, 3, 1]
    manager.check_integrity()


def test_decode_grows_table_one_block_at_a_time() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    request = make_request("a", [1, 2, 3])
    assert schedule(manager, request) == [0]
    assert decode(manager, request, 4) == []
    assert decode(manager, request, 5) == [1]
    assert [decode(manager, request, t) for t in (6, 7, 8)] == [[], [], []]
    assert decode(manager, request, 9) == [2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    manager.check_integrity()


def test_chunked_prefill_registers_blocks_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(14)))
    assert schedule(manager, request, num_new_tokens=5) == [0, 1]
    cached = manager.block_pool.cached_block_hash_to_block
    assert list(cached) == request.block_hashes[:1]
    assert schedule(manager, request, num_new_tokens=9) == [2, 3]
    assert [cached[h].block_id for h in request.block_hashes] == [0, 1, 2]
    assert decode(manager, request, 14) == []
    assert decode(manager, request, 15) == []  # token 15 fills block 3
    assert cached[request.block_hashes[3]].block_id == 3
    manager.check_integrity()


def test_free_in_reverse_order_and_lru_eviction() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(100, 104)))
    assert schedule(manager, a) == [0, 1, 2]
    assert schedule(manager, b) == [3]
    manager.free(a)
    assert free_ids(manager) == [4, 5, 2, 1, 0]
    manager.free(b)
    assert free_ids(manager) == [4, 5, 2, 1, 0, 3]
    manager.check_integrity()
    # Allocation takes the least recently freed first; a's cached head (block 0) goes last.
    c = make_request("c", list(range(200, 219)))
    assert schedule(manager, c) == [4, 5, 2, 1, 0]
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is None
    assert manager.block_pool.get_cached_block(b.block_hashes[0]).block_id == 3
    manager.check_integrity()


def test_prefix_hit_shares_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    assert manager.allocate_slots(b, 3, hits, num_hit_tokens) is not None
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 11, 8)
    manager.check_integrity()
    manager.free(a)
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_ids(manager)[-1] == 2
    manager.check_integrity()


def test_hit_never_covers_last_prompt_token() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    assert schedule(manager, make_request("a", list(range(12)))) == [0, 1, 2]
    exact = make_request("b", list(range(8)))  # exactly 2 full blocks, both cached
    hits, num_hit_tokens = manager.get_computed_blocks(exact)
    assert ids(hits) == [0] and num_hit_tokens == 4
    one_more = make_request("c", list(range(9)))
    assert ids(manager.get_computed_blocks(one_more)[0]) == [0, 1]
    assert manager.get_computed_blocks(make_request("d", [0, 1, 2, 3])) == ([], 0)
    manager.check_integrity()


def test_cache_salt_prevents_hits() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))
    assert schedule(manager, make_request("a", prompt, salt="tenant-1")) == [0, 1, 2]
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", prompt, salt="tenant-2")) == ([], 0)
    same = manager.get_computed_blocks(make_request("d", prompt, salt="tenant-1"))
    assert ids(same[0]) == [0, 1]
    manager.check_integrity()


def test_freed_cached_blocks_reused_from_queue_middle_then_evicted() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [0, 1, 2]
    manager.free(a)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_request("b", list(range(8)) + [60])
    assert schedule(manager, b) == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2]  # 1 and 0 left the queue
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 9, 8)
    manager.check_integrity()
    manager.free(b)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    # A 36-token request needs 9 blocks: it evicts cached block 1 but not block 0.
    c = make_request("c", list(range(300, 336)))
    assert schedule(manager, c) == [4, 5, 6, 7, 8, 9, 2, 3, 1]
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert pool.blocks[1].block_hash == c.block_hashes[8]  # re-registered for c
    hits, _ = manager.get_computed_blocks(make_request("d", list(range(10))))
    assert ids(hits) == [0]  # the chain breaks at the evicted block
    manager.check_integrity()


def test_reused_free_hits_are_not_capacity() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a) == [0, 1, 2]
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1, 0]
    # 17 tokens: 2 hit blocks + 3 new, but only 2 of the 4 free blocks are not hits.
    big = make_request("big", list(range(8)) + list(range(70, 79)))
    assert schedule(manager, big) is None
    assert free_ids(manager) == [3, 2, 1, 0]
    assert [block.ref_cnt for block in manager.block_pool.blocks] == [0, 0, 0, 0]
    assert manager.block_pool.get_cached_block(a.block_hashes[1]).block_id == 1
    assert big.num_computed_tokens == 0 and manager.prefix_cache_queries == 10
    manager.check_integrity()
    fits = make_request("fits", list(range(8)) + list(range(70, 76)))
    assert schedule(manager, fits) == [3, 2]
    assert manager.get_block_ids("fits") == [0, 1, 3, 2]
    manager.check_integrity()


def test_stale_hits_are_rejected() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(6)))
    assert schedule(manager, a) == [0, 1]
    manager.free(a)
    b = make_request("b", list(range(6)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [0]
    schedule(manager, make_request("x", list(range(500, 512))))  # evicts block 0
    with pytest.raises(RuntimeError, match="evicted"):
        manager.allocate_slots(b, 2, hits, num_hit_tokens)
    manager.check_integrity()


def test_concurrent_duplicate_blocks_stay_uncached() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    hits_b = manager.get_computed_blocks(b)  # looked up before a registers anything
    assert schedule(manager, a) == [0, 1]
    assert manager.allocate_slots(b, 6, *hits_b) is not None
    assert manager.get_block_ids("b") == [2, 3]
    assert manager.block_pool.get_cached_block(b.block_hashes[0]).block_id == 0
    assert manager.block_pool.blocks[2].block_hash is None
    manager.check_integrity()
    manager.free(a)
    manager.free(b)
    manager.check_integrity()


def test_preempted_request_is_not_counted_again() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(9)))
    assert schedule(manager, a) == [0, 1, 2]
    manager.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1
    assert schedule(manager, a) == [3]  # blocks 0 and 1 come back as hits
    assert manager.get_block_ids("a") == [0, 1, 3]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 0)
    manager.check_integrity()


def test_caching_off_gives_no_hits() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    assert schedule(manager, make_request("a", list(range(10)))) == [0, 1, 2]
    b = make_request("b", list(range(10)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert schedule(manager, b) == [3, 4, 5]
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.check_integrity()


def test_misuse_and_reset() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    assert schedule(manager, a) == [0, 1]
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(a, 1, [manager.block_pool.blocks[3]], 4)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    manager.free(a)  # freeing twice is a no-op, not a double free
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(5)))) == ([], 0)
    manager.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    schedule(manager, a)
    manager.check_integrity()
    manager.block_pool.blocks[0].ref_cnt = 2  # corrupted ref count
    with pytest.raises(AssertionError, match="ref_cnt != 1 table appearances"):
        manager.check_integrity()
    manager.block_pool.blocks[0].ref_cnt = 1
    manager.req_to_blocks["a"].append(manager.req_to_blocks["a"][0])
    with pytest.raises(AssertionError, match="a block twice in table"):
        manager.check_integrity()


def test_occupancy_counts_shared_blocks_once_and_partial_blocks_by_fill() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(10))  # blocks of 4, 4, 2 tokens
    assert schedule(manager, a) == [0, 1, 2]
    b = make_request("b", [*range(8), 50, 51, 52])  # hits a's 2 full blocks, then 3 tokens
    assert schedule(manager, b) == [3]
    c = make_request("c", range(100, 109))
    assert schedule(manager, c, 5) == [4, 5]  # chunked prefill: 4 + 1 tokens so far
    assert manager.occupancy([a]) == KVOccupancy(3, 12, 10)
    both = manager.occupancy([a, b])
    assert both == KVOccupancy(4, 16, 13) and both.num_wasted_slots == 3
    # Slots allocated for tokens not computed yet hold nothing: c's table grows to cover
    # 9 tokens (3 blocks) while num_computed_tokens stays 5.
    assert ids(manager.allocate_slots(c, 4)) == [6]
    assert manager.occupancy([a, b, c]) == KVOccupancy(7, 28, 18)
    assert manager.occupancy([make_request("idle", [1])]) == KVOccupancy(0, 0, 0)
    manager.check_integrity()


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
