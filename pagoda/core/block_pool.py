"""The pool of KV-cache blocks: reference counts, the free queue and the prefix-cache map.

Every block is in exactly one of two states:

| state  | ref_cnt | in free queue | block_hash                                      |
|--------|---------|---------------|-------------------------------------------------|
| used   | >= 1    | no            | set once the block is full and registered        |
| free   | 0       | yes           | may still be set: reusable on a prefix hit until |
|        |         |               | the block is popped for new data (evicted)       |

The free queue is the eviction order: blocks are allocated from its head and freed to its
tail, so the least recently freed block is evicted first. A prefix hit takes a free
cached block out of the middle of the queue in O(1) (intrusive doubly linked list).
Block 0 is an ordinary block.

With a host tier (core/host_tier.py), evicting a cached block offloads it: its hash and KV
move to a host slot (the copy is queued there) instead of being forgotten. The tiers are
exclusive: registering a block under a hash the host tier holds drops the host entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagoda.core.hashing import BlockHash

if TYPE_CHECKING:
    from pagoda.core.host_tier import HostPrefixTier


class KVCacheBlock:
    """One block of KV cache: `block_size` token slots in every layer's K and V tensors."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache (full and hashed).
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks, least recently freed first.

    All operations are O(1) except `get_all_free_blocks` (O(n), for tests and checks).
    The links live in the blocks themselves, so no allocation happens per operation.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # NOTE: sentinels at both ends remove every "is this the head/tail?" branch.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the block to evict first); IndexError if empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, which must be in this queue."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail. Checks the links both ways as it walks
        (AssertionError if broken), so integrity checks can rely on it.
        """
        blocks = []
        prev_block, block = self._head, self._head.next_free
        while block is not self._tail:
            assert_that(block is not None, "free queue: forward link to None")
            assert_that(block.prev_free is prev_block, f"free queue: back link broken at {block}")
            assert_that(len(blocks) < self.num_free_blocks, "free queue: longer than its count")
            blocks.append(block)
            prev_block, block = block, block.next_free
        assert_that(self._tail.prev_free is prev_block, "free queue: tail back link broken")
        assert_that(len(blocks) == self.num_free_blocks, "free queue: shorter than its count")
        return blocks


class BlockPool:
    """All KV blocks of one cache, with ref counting, LRU eviction and the prefix map.

    Invariant: a block is in the free queue iff its ref_cnt is 0; `cached_block_hash_to_block`
    maps a hash to the one block registered under it, and that block's `block_hash` is
    that hash. A hash maps to at most one block: when two requests fill identical blocks
    at the same time, the first to register wins and the other block stays uncached.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, host_tier: HostPrefixTier | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if host_tier is not None and not enable_caching:
            raise ValueError("a host tier needs prefix caching")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the free queue head (LRU first), evict their cached hashes
        and return them with ref_cnt 1. ValueError (and no change) if fewer are free.
        """
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {n} blocks: only {self.free_block_queue.num_free_blocks} free"
            )
        popleft = self.free_block_queue.popleft
        blocks = []
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop `block` from the prefix cache: its contents are about to be overwritten.
        With a host tier they are copied there first (the copy runs before the forward).
        """
        del self.cached_block_hash_to_block[block.block_hash]
        if self.host_tier is not None:
            self.host_tier.offload(block.block_hash, block.block_id)
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under `block_hash`, used or free, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block; a free block (a prefix hit on a freed block)
        leaves the free queue in O(1) so it cannot be evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 go to the free queue tail in
        the given order (first given, first evicted) and keep their hash until evicted.
        """
        append = self.free_block_queue.append
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register `blocks[i]` under `block_hashes[i]` for i in [num_cached_blocks,
        num_full_blocks): blocks that just became full. Needs len(block_hashes) >=
        num_full_blocks. A block already registered, or a hash already held by another
        block, is left as it is.
        """
        if not self.enable_caching:
            return
        hash_to_block = self.cached_block_hash_to_block
        host_tier = self.host_tier
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in hash_to_block:
                # NOTE: a duplicate computed concurrently by another request; keeping one
                # block per hash keeps eviction and lookup simple, and the duplicate is
                # freed like any uncached block.
                continue
            block.block_hash = block_hash
            hash_to_block[block_hash] = block
            if host_tier is not None:
                # NOTE: computed again (e.g. by a request that skipped the cache): the
                # device copy wins, so that no hash is held by both tiers.
                host_tier.discard(block_hash)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unregister `blocks` from the prefix cache without offloading them: their K/V
        were never computed (a step undone after its blocks were registered)."""
        for block in blocks:
            if block.block_hash is None:
                continue
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (including cached ones, which are evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (returns False and
        changes nothing otherwise): running requests track how many of their blocks are
        registered, and unregistering their blocks behind their back breaks that count.
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.host_tier is not None:
            self.host_tier.reset()
        return True

    def check_integrity(self) -> None:
        """Assert the table in the module docstring (AssertionError with a message):
        free queue == blocks with ref 0, and the hash map agrees with the blocks' hashes;
        the host tier's own invariants, and no hash in both tiers. Between steps only.
        """
        free_blocks = self.free_block_queue.get_all_free_blocks()
        free_ids = {block.block_id for block in free_blocks}
        assert_that(len(free_ids) == len(free_blocks), "a block is twice in the free queue")
        num_used = 0
        for block_id, block in enumerate(self.blocks):
            assert_that(block.block_id == block_id, f"{block} is at index {block_id}")
            assert_that(block.ref_cnt >= 0, f"{block} has a negative ref count")
            in_queue = block_id in free_ids
            assert_that(in_queue == (block.ref_cnt == 0), f"{block}: in free queue={in_queue}")
            num_used += block.ref_cnt > 0
            if block.block_hash is not None:
                cached = self.cached_block_hash_to_block.get(block.block_hash)
                assert_that(cached is block, f"{block} has a hash that maps to {cached}")
        assert_that(len(free_ids) + num_used == self.num_blocks, "free + used != total")
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert_that(block.block_hash == block_hash, f"hash map entry points at {block}")
        assert_that(
            self.enable_caching or not self.cached_block_hash_to_block,
            "blocks are cached although caching is off",
        )
        if self.host_tier is not None:
            self.host_tier.check_integrity(self.cached_block_hash_to_block)


def assert_that(condition: bool, message: str) -> None:
    """`assert` that survives `python -O`: integrity checks must not vanish silently."""
    if not condition:
        raise AssertionError(message)
