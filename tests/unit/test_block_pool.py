"""BlockPool and its free queues: exact ids, ref counts and eviction order. Block 0 is the
reserved null block: a pool of n blocks hands out blocks 1..n-1."""

from __future__ import annotations

import pytest

from pagoda.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagoda.core.hashing import hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    """The free blocks in eviction order: uncached ones, then cached ones LRU first."""
    return ids(pool.get_free_blocks())


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def test_free_queue_popleft_and_append() -> None:
    queue, blocks = make_queue(4)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 3, 0]
    for expected in (1, 2, 3, 0):
        assert queue.popleft().block_id == expected
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []
    with pytest.raises(IndexError):
        queue.popleft()


@pytest.mark.parametrize(
    ("removed", "remaining"),
    [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]), (4, [0, 1, 2, 3])],
    ids=["head", "middle", "tail"],
)
def test_free_queue_remove(removed: int, remaining: list[int]) -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[removed])
    assert ids(queue.get_all_free_blocks()) == remaining
    assert queue.num_free_blocks == 4
    # The list stays usable at both ends after a removal.
    queue.append(blocks[removed])
    assert ids(queue.get_all_free_blocks()) == remaining + [removed]
    assert queue.popleft().block_id == remaining[0]


def test_free_queue_remove_all_then_refill() -> None:
    queue, blocks = make_queue(3)
    for block in (blocks[1], blocks[2], blocks[0]):
        queue.remove(block)
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [2]


def test_get_new_blocks_in_queue_order_and_exhaustion() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    assert pool.num_usable_blocks == 5 and free_ids(pool) == [1, 2, 3, 4, 5]
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2] and [b.ref_cnt for b in first] == [1, 1]
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == pytest.approx(0.4)
    with pytest.raises(ValueError, match="only 3 free"):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [3, 4, 5]  # nothing taken by the failed call
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.get_usage() == 1.0 and pool.get_num_used_blocks() == 5
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_null_block_is_never_handed_out_or_freed() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    assert pool.null_block is pool.blocks[0]
    assert ids(pool.get_new_blocks(2)) == [1, 2] and pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="double free"):  # its ref count stays 0
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError, match="null block"):
        pool.touch([pool.null_block])
    pool.check_integrity()
    pool.null_block.ref_cnt = 1
    with pytest.raises(AssertionError, match="null block"):
        pool.check_integrity()
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_free_blocks_appends_in_given_order_at_zero_refs() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 1..4; free queue [5, 6]
    pool.touch([blocks[1]])  # block 2 is shared
    pool.free_blocks([blocks[3], blocks[2], blocks[1], blocks[0]])
    assert blocks[1].ref_cnt == 1
    assert free_ids(pool) == [5, 6, 4, 3, 1]
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [5, 6, 4, 3, 1, 2]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[1]])
    pool.check_integrity()


def test_uncached_blocks_are_taken_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True)
    blocks = pool.get_new_blocks(6)  # 1..6
    hashes = [hash_block_tokens(None, [i], None) for i in range(2)]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    # Freed in table order: cached 1, 2 first (LRU), then uncached 3..6.
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 4, 5, 6, 1, 2]
    # Four new blocks take the uncached ones: both cached blocks stay findable.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 6]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # Only then is the least recently freed cached block evicted.
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(hashes[0]) is None and blocks[0].block_hash is None
    pool.check_integrity()


def test_cached_block_is_reused_from_middle_then_evicted() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    hashes = [hash_block_tokens(None, [i], None) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[2]) is None  # block 3 was not full
    pool.free_blocks(reversed(blocks))
    # Uncached 4 and 3 first, then the cached blocks in freeing order.
    assert free_ids(pool) == [4, 3, 2, 1]
    # A freed cached block stays findable and is taken out of the queue's middle.
    hit = pool.get_cached_block(hashes[1])
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [4, 3, 1]
    pool.check_integrity()
    # Allocation takes 4, 3, then evicts cached block 1 and drops its hash.
    assert ids(pool.get_new_blocks(3)) == [4, 3, 1]
    assert blocks[0].block_hash is None and pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.check_integrity()


def test_cache_full_blocks_first_registration_wins() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1, 2], None)
    pool.cache_full_blocks(a, [block_hash], 0, 1)
    pool.cache_full_blocks(b, [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is a[0]
    assert b[0].block_hash is None
    pool.check_integrity()


def test_caching_off_registers_nothing() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1], None)
    pool.cache_full_blocks(blocks, [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is None and blocks[0].block_hash is None
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [i], None) for i in range(2)]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 1, 2]
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in pool.blocks)
    assert free_ids(pool) == [3, 1, 2]  # all uncached now, in the same order
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.check_integrity()
    blocks[0].ref_cnt = 0  # used block with ref 0 that is not in the free queue
    with pytest.raises(AssertionError, match="in free queue=False"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="shorter than its count"):
        pool.check_integrity()
    pool.free_block_queue.num_free_blocks -= 1
    free = pool.free_block_queue.popleft()
    free.block_hash = b"x" * 32  # a cached block in the uncached queue
    pool.free_block_queue.append(free)
    with pytest.raises(AssertionError, match="cached block is uncached-free"):
        pool.check_integrity()
    free.block_hash = None
    pool.cached_block_hash_to_block[b"h" * 32] = blocks[0]  # map disagrees with block
    with pytest.raises(AssertionError, match="hash map entry"):
        pool.check_integrity()
