"""The pool of KV-cache blocks: reference counts, the free queues and the prefix-cache map.

Block 0 is the reserved null block: never allocated, never freed, counted neither free nor
used (a placeholder for table entries that hold no KV, e.g. blocks a sliding window has
left). The pool serves `num_blocks - 1` blocks. Every other block is in one of three states:

| state         | ref_cnt | in a free queue | block_hash                                  |
|---------------|---------|-----------------|---------------------------------------------|
| used          | >= 1    | no              | set once full and its step committed        |
| free          | 0       | uncached queue  | None                                        |
| free, cached  | 0       | cached queue    | set: reusable on a prefix hit until evicted |
| reserved      | 0       | reserved queue  | either (a cached one stays reusable)        |

A reserved block is free, held back for one running request's growth (`reserved_for`
names it): the KV manager places a request's new blocks after its last one where it can,
so that its table is a run of consecutive blocks, which decode attention streams from
memory at up to 1.4x the speed of scattered ones (docs/architecture.md, "Block placement").
Reservations are soft: they count as free, a prefix hit may still take a reserved cached
block, and allocation takes them (stealing) only once no other free block is left.

A block only gets a hash once the step that computed its K/V has committed
(`cache_full_blocks` is called from the scheduler's `update_from_output`), so a hash never
names a block whose K/V was not written.

Allocation takes uncached free blocks first (they hold nothing anyone can reuse), then
evicts cached ones least recently freed first, then steals reserved ones, oldest
reservation first; the queues take blocks at the tail, in the order given. A prefix hit takes a free cached block out of the middle of its queue
in O(1) (intrusive doubly linked lists).

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

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt", "reserved_for")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache (full and hashed).
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # The id of the request whose growth this free block is held for, or None.
        self.reserved_for: str | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        reserved = "" if self.reserved_for is None else f", reserved_for={self.reserved_for!r}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached}{reserved})"


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

    def pop(self) -> KVCacheBlock:
        """Remove and return the tail (the block appended last); IndexError if empty."""
        block = self._tail.prev_free
        if block is self._head:
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

    def peek(self, n: int) -> list[KVCacheBlock]:
        """The first `n` blocks (fewer if the queue is shorter), left in place."""
        blocks = []
        block = self._head.next_free
        while len(blocks) < n and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks

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
    """All KV blocks of one cache, with ref counting, eviction order and the prefix map.

    Invariant: a block other than the null block is in a free queue iff its ref_cnt is 0,
    the cached queue iff it also has a hash; `cached_block_hash_to_block` maps a hash to the
    one block registered under it, and that block's `block_hash` is that hash. A hash maps
    to at most one block: when two requests fill identical blocks in the same step, the
    first to register wins and the other block stays uncached.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, host_tier: HostPrefixTier | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the reserved null block), "
                f"got {num_blocks}"
            )
        if host_tier is not None and not enable_caching:
            raise ValueError("a host tier needs prefix caching")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # NOTE: uncached free blocks are handed out before cached ones are evicted.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_free_queue = FreeKVCacheBlockQueue([])
        self.reserved_queue = FreeKVCacheBlockQueue([])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the pool can hand out: all but the null block."""
        return self.num_blocks - 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks, uncached ones first, then cached ones least recently freed
        first (evicting their hashes), then reserved ones (their reservations lost); return
        them with ref_cnt 1. ValueError (and no change) if fewer are free.
        """
        num_free = self.get_num_free_blocks()
        if n > num_free:
            raise ValueError(f"cannot get {n} blocks: only {num_free} free")
        uncached, cached = self.free_block_queue, self.cached_free_queue
        blocks = []
        for _ in range(n):
            if uncached.num_free_blocks:
                block = uncached.popleft()
            elif cached.num_free_blocks:
                block = cached.popleft()
                self._evict(block)
            else:
                # NOTE: the newest reservation's last block: its owner needs it last.
                block = self.reserved_queue.pop()
                block.reserved_for = None
                if block.block_hash is not None:
                    self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def peek_run(self, n: int, room: int) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """Free blocks for a run of `n` (fewer if fewer unreserved ones are free) and up to
        `room` to reserve after it, each list in ascending id order, left in place. They
        come from one queue: the next `n + room` uncached blocks (only those there are), or
        where none is uncached the next `n + room` cached ones, of which the run is the
        lowest ids. (So a run may evict an old prefix's head before its tail; all of them
        are among the oldest `n + room` free blocks, which LRU evicts next anyway.) Where
        the uncached blocks alone are too few, the run is exactly what `get_new_blocks`
        would take, and nothing is reserved: no cached block is evicted while an uncached
        one would be reserved.
        """
        uncached, cached = self.free_block_queue, self.cached_free_queue
        num_uncached = uncached.num_free_blocks
        if num_uncached >= n or num_uncached == 0:
            queue = uncached if num_uncached else cached
            blocks = sorted(queue.peek(n + room), key=_block_id)
            return blocks[:n], blocks[n:]
        run = uncached.peek(num_uncached) + cached.peek(n - num_uncached)
        return sorted(run, key=_block_id), []

    def take(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Allocate these particular free blocks (ref_cnt 1): out of their queue, a
        reservation or a hash they carry dropped (the hash evicted)."""
        for block in blocks:
            if block.ref_cnt != 0:
                raise ValueError(f"{block} is not free")
            self._queue_of(block).remove(block)
            block.reserved_for = None
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1

    def reserve(self, blocks: Iterable[KVCacheBlock], owner: str) -> None:
        """Hold these free, unreserved blocks for `owner`'s growth (a cached one keeps its
        hash, and a prefix hit can still take it)."""
        reserved = self.reserved_queue
        for block in blocks:
            if block.ref_cnt != 0 or block.reserved_for is not None:
                raise ValueError(f"{block} is not free and unreserved")
            self._queue_of(block).remove(block)
            block.reserved_for = owner
            reserved.append(block)

    def unreserve(self, blocks: Iterable[KVCacheBlock], owner: str) -> None:
        """Return those of these blocks still reserved for `owner` to their free queue's
        tail, in the order given (others are skipped: already taken or stolen)."""
        for block in blocks:
            if block.reserved_for != owner or block.ref_cnt != 0:
                continue
            self.reserved_queue.remove(block)
            block.reserved_for = None
            self._queue_of(block).append(block)

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
        leaves its free queue in O(1) so it cannot be evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
                # NOTE: a prefix hit on a reserved block wins; its owner grows elsewhere.
                block.reserved_for = None
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 go to the tail of their free
        queue (cached or not) in the given order (first given, first evicted) and keep
        their hash until evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue_of(block).append(block)

    def _queue_of(self, block: KVCacheBlock) -> FreeKVCacheBlockQueue:
        if block is self.null_block:
            raise ValueError("the null block is never allocated or freed")
        if block.reserved_for is not None:
            return self.reserved_queue
        return self.free_block_queue if block.block_hash is None else self.cached_free_queue

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register `blocks[i]` under `block_hashes[i]` for i in [num_cached_blocks,
        num_full_blocks): blocks whose K/V a committed step has just completed (blocks in
        use). Needs len(block_hashes) >= num_full_blocks. A block already registered, a
        hash already held by another block, and the null block are left as they are.
        """
        if not self.enable_caching:
            return
        hash_to_block = self.cached_block_hash_to_block
        host_tier = self.host_tier
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                # NOTE: the null block stands for an entry a sliding window has freed.
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

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now: free ones, cached (evictable) and reserved
        ones included."""
        return (self.free_block_queue.num_free_blocks + self.cached_free_queue.num_free_blocks
                + self.reserved_queue.num_free_blocks)

    def get_num_used_blocks(self) -> int:
        """Blocks held by requests (ref_cnt > 0)."""
        return self.num_usable_blocks - self.get_num_free_blocks()

    def get_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order: uncached ones, then cached ones LRU first,
        then reserved ones. O(n), for tests and checks."""
        return [*self.free_block_queue.get_all_free_blocks(),
                *self.cached_free_queue.get_all_free_blocks(),
                *self.reserved_queue.get_all_free_blocks()]

    def get_usage(self) -> float:
        """Fraction of the usable blocks in use (ref_cnt > 0), in [0, 1]."""
        return self.get_num_used_blocks() / self.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (returns False and
        changes nothing otherwise): running requests track how many of their blocks are
        registered, and unregistering their blocks behind their back breaks that count.
        """
        if self.get_num_used_blocks():
            return False
        while self.reserved_queue.num_free_blocks:
            # NOTE: no block is in use, so no request is left to grow into these.
            block = self.reserved_queue.popleft()
            block.reserved_for = None
            (self.free_block_queue if block.block_hash is None
             else self.cached_free_queue).append(block)
        while self.cached_free_queue.num_free_blocks:
            block = self.cached_free_queue.popleft()
            block.block_hash = None
            self.free_block_queue.append(block)
        self.cached_block_hash_to_block.clear()
        if self.host_tier is not None:
            self.host_tier.reset()
        return True

    def check_integrity(self) -> None:
        """Assert the table in the module docstring (AssertionError with a message): the
        null block untouched, each free queue == the free blocks with / without a hash,
        free + used == usable, and the hash map agrees with the blocks' hashes; the host
        tier's own invariants, and no hash in both tiers. Between steps only.
        """
        null = self.null_block
        assert_that(null.ref_cnt == 0 and null.block_hash is None and null.prev_free is None
                    and null.reserved_for is None,
                    f"the null block {null} was allocated, cached or freed")
        uncached = self.free_block_queue.get_all_free_blocks()
        cached = self.cached_free_queue.get_all_free_blocks()
        reserved = self.reserved_queue.get_all_free_blocks()
        assert_that(all(b.block_hash is None for b in uncached),
                    "a cached block is uncached-free")
        assert_that(all(b.block_hash is not None for b in cached),
                    "an uncached block is cached-free")
        assert_that(all(b.reserved_for is None for b in [*uncached, *cached]),
                    "a reserved block is in the uncached or cached queue")
        assert_that(all(b.reserved_for is not None for b in reserved),
                    "an unreserved block is in the reserved queue")
        free_ids = {block.block_id for block in [*uncached, *cached, *reserved]}
        assert_that(len(free_ids) == len(uncached) + len(cached) + len(reserved),
                    "a block is twice in the free queues")
        num_used = 0
        for block_id, block in enumerate(self.blocks):
            assert_that(block.block_id == block_id, f"{block} is at index {block_id}")
            if block is null:
                continue
            assert_that(block.ref_cnt >= 0, f"{block} has a negative ref count")
            in_queue = block_id in free_ids
            assert_that(in_queue == (block.ref_cnt == 0), f"{block}: in free queue={in_queue}")
            assert_that(in_queue or block.reserved_for is None, f"{block} is used and reserved")
            num_used += block.ref_cnt > 0
            if block.block_hash is not None:
                registered = self.cached_block_hash_to_block.get(block.block_hash)
                assert_that(registered is block, f"{block} has a hash that maps to {registered}")
        assert_that(len(free_ids) + num_used == self.num_usable_blocks, "free + used != usable")
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert_that(block.block_hash == block_hash, f"hash map entry points at {block}")
        assert_that(
            self.enable_caching or not self.cached_block_hash_to_block,
            "blocks are cached although caching is off",
        )
        if self.host_tier is not None:
            self.host_tier.check_integrity(self.cached_block_hash_to_block)


def _block_id(block: KVCacheBlock) -> int:
    return block.block_id


def assert_that(condition: bool, message: str) -> None:
    """`assert` that survives `python -O`: integrity checks must not vanish silently."""
    if not condition:
        raise AssertionError(message)
