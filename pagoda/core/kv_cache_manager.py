"""Per-request block tables over one BlockPool: admission, prefix hits, commits and frees.

The scheduler's view of KV memory. A request's block table is append-only while it
runs: block i holds the K/V of tokens [i * block_size, (i + 1) * block_size). Prefix
hits prepend shared, already full blocks; new tokens are only ever written into blocks
the request owns alone (the hit never covers the last prompt token, and only full blocks
are shared), so sharing needs no copy-on-write here.

| per request       | meaning                                                          |
|-------------------|------------------------------------------------------------------|
| req_to_blocks     | the block table (KVCacheBlock objects)                           |
| req_to_block_ids  | the same table as ids, kept in step so reading it costs nothing  |
| num_cached_blocks | leading blocks already offered to the prefix cache (registered,  |
|                   | or skipped as duplicates); the next registration starts there    |

Registration happens at commit only: `cache_blocks(request)`, called by the scheduler once
a step has returned, registers the full blocks that the request's computed tokens cover.
Allocation registers nothing, so a step that fails or is interrupted leaves no block
findable whose K/V was never written, and needs no undo.

With a host tier (`num_host_tier_blocks` > 0, core/host_tier.py), a prefix lookup that runs
out of device hits continues its chain in host memory. Admission gives each host hit a new
device block and queues the host -> device copy (performed before the step's forward); the
request skips those tokens as computed, and the block is registered at commit like any
other. The step's copies, device -> host offloads of evicted blocks included, are handed to
the scheduler by `end_step()`; `discard_offloads` forgets the offloads of a failed step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from pagoda.core.block_pool import BlockPool, KVCacheBlock, assert_that
from pagoda.core.hashing import BlockHash
from pagoda.core.host_tier import HostPrefixTier


class _CacheRequest(Protocol):
    req_id: str
    num_computed_tokens: int
    num_preemptions: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KVOccupancy:
    """How full the blocks of a set of requests are (see `KVCacheManager.occupancy`)."""

    num_blocks: int  # distinct blocks the requests hold
    num_slots: int  # num_blocks * block_size: token slots allocated
    num_tokens: int  # tokens whose K/V those blocks store

    @property
    def num_wasted_slots(self) -> int:
        return self.num_slots - self.num_tokens


class KVCacheManager:
    """Block tables of all requests that hold KV, and the prefix-cache statistics.

    `prefix_cache_queries` / `prefix_cache_hits` count tokens: each request counts once,
    at its first successful allocation if it was never preempted (queries += its token
    count, hits += its prefix-hit tokens, device and host). `prefix_cache_host_hits` is the
    part of the hits loaded from the host tier. Counting at commit rather than in
    `get_computed_blocks` means a request whose admission is retried is not counted twice.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_tier_blocks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_tier_blocks < 0:
            raise ValueError(f"num_host_tier_blocks must be >= 0, got {num_host_tier_blocks}")
        if num_host_tier_blocks and not enable_caching:
            raise ValueError("a host tier (num_host_tier_blocks > 0) needs prefix caching")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host_tier = HostPrefixTier(num_host_tier_blocks) if num_host_tier_blocks else None
        self.block_pool = BlockPool(num_blocks, enable_caching, self.host_tier)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # High-water mark of blocks held by requests (see `reset_peak_num_used_blocks`).
        self.peak_num_used_blocks = 0
        self.prefix_cache_host_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, including evictable cached ones)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """`num_blocks` less the reserved null block."""
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: _CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest run of device-cached blocks matching `request.block_hashes` from the
        start, and the number of tokens that the prefix cache covers: those blocks plus the
        run of host-tier hits that continues the chain (tokens past the blocks' coverage are
        host hits, which `allocate_slots` loads). Never covers the last token (it must be
        computed to get logits). ([], 0) when caching is off. Changes no state: pass the
        result to `allocate_slots` before any other allocation.
        """
        if not self.enable_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for block_hash in islice(request.block_hashes, max_num_blocks):
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hits = len(blocks)
        if self.host_tier is not None:
            host_tier = self.host_tier
            for block_hash in islice(request.block_hashes, num_hits, max_num_blocks):
                if block_hash not in host_tier:
                    break
                num_hits += 1
        return blocks, num_hits * self.block_size

    def allocate_slots(
        self,
        request: _CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to cover num_computed_tokens + num_new_computed_tokens +
        num_new_tokens tokens; return the newly allocated blocks (prefix hits excluded), or
        None, with no state change, if the pool is short.

        `new_computed_blocks` (from `get_computed_blocks`, only for a request that holds no
        blocks) are shared and prepended. Computed tokens past them are host-tier hits:
        each gets a new device block and a queued host -> device copy. Registers nothing
        (see `cache_blocks`).
        """
        block_size = self.block_size
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is not None and not new_computed_blocks:
            # NOTE: the per-step path of a running request: O(1) unless the table grows.
            num_new_blocks = -(-num_tokens // block_size) - len(blocks)
            if num_new_blocks <= 0:
                new_blocks = []
            elif num_new_blocks > self.block_pool.get_num_free_blocks():
                return None
            else:
                new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
                blocks.extend(new_blocks)
                self.req_to_block_ids[request.req_id].extend(b.block_id for b in new_blocks)
                self._note_usage()
        else:
            if blocks:
                raise ValueError(f"request {request.req_id} already holds blocks")
            new_blocks = self._allocate_first(
                request, num_tokens, new_computed_blocks or [], num_new_computed_tokens
            )
            if new_blocks is None:
                return None
        return new_blocks

    def _allocate_first(
        self,
        request: _CacheRequest,
        num_tokens: int,
        computed_blocks: list[KVCacheBlock],
        num_hit_tokens: int,
    ) -> list[KVCacheBlock] | None:
        """Create the table of a request that holds no blocks: share `computed_blocks`,
        load the host hits that follow them, then allocate the rest. None (and no change)
        if the pool is short.
        """
        self._check_still_cached(request, computed_blocks)
        host_hashes = self._host_hit_hashes(request, len(computed_blocks), num_hit_tokens)
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - len(computed_blocks))
        # NOTE: hits on freed blocks sit in the free queue; touching them takes them out,
        # so they are not capacity for the new blocks.
        num_reused_free = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_reused_free:
            return None
        # NOTE: touch before allocating, or get_new_blocks could evict the hits; take the
        # host hits out of the host tier first too, or the offloads of the blocks evicted
        # now could evict them there.
        self.block_pool.touch(computed_blocks)
        host_slots = self.host_tier.take(host_hashes) if host_hashes else []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if host_slots:
            self.host_tier.load(host_slots, [b.block_id for b in new_blocks[: len(host_slots)]])
            if request.num_preemptions == 0:
                self.prefix_cache_host_hits += len(host_slots) * self.block_size
        blocks = computed_blocks + new_blocks
        req_id = request.req_id
        self._set_table(req_id, blocks, len(computed_blocks))
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return new_blocks

    def _check_still_cached(
        self, request: _CacheRequest, computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Raise if a hit was evicted (or reassigned) since `get_computed_blocks`: using it
        would silently read another sequence's KV.
        """
        if len(computed_blocks) > len(request.block_hashes):
            raise RuntimeError(f"request {request.req_id}: more hits than block hashes")
        for block, block_hash in zip(computed_blocks, request.block_hashes, strict=False):
            if block.block_hash != block_hash:
                raise RuntimeError(
                    f"request {request.req_id}: prefix hit {block} was evicted before "
                    "allocate_slots; call get_computed_blocks right before it"
                )

    def _host_hit_hashes(
        self, request: _CacheRequest, num_device_hits: int, num_hit_tokens: int
    ) -> list[BlockHash]:
        """The hashes of the host hits among `num_hit_tokens` (those past the device hits),
        checked to be still in the host tier (RuntimeError otherwise).
        """
        num_host_tokens = num_hit_tokens - num_device_hits * self.block_size
        if num_host_tokens <= 0:
            # NOTE: a swap-in passes its device hits with no hit tokens (its computed
            # tokens already cover them): nothing to load.
            return []
        if num_host_tokens % self.block_size or self.host_tier is None:
            raise ValueError(
                f"request {request.req_id}: {num_hit_tokens} hit tokens do not match "
                f"{num_device_hits} device hits and whole host-tier blocks"
            )
        hashes = request.block_hashes[
            num_device_hits : num_device_hits + num_host_tokens // self.block_size
        ]
        if len(hashes) * self.block_size != num_host_tokens or any(
            h not in self.host_tier for h in hashes
        ):
            raise RuntimeError(
                f"request {request.req_id}: a host-tier hit was evicted before "
                "allocate_slots; call get_computed_blocks right before it"
            )
        return hashes

    def cache_blocks(self, request: _CacheRequest) -> None:
        """Register the full blocks that the request's computed tokens cover and that have a
        hash in `request.block_hashes`. Called at commit: once the step that computed those
        tokens (or copied them in from host memory) has returned.
        """
        if not self.enable_caching:
            return
        # NOTE: capping by the hashes keeps tokens computed past the hashed ones (draft
        # tokens, which must not be hashed until accepted) out of the cache.
        num_full_blocks = min(request.num_computed_tokens // self.block_size,
                              len(request.block_hashes))
        req_id = request.req_id
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[req_id], request.block_hashes, num_cached, num_full_blocks
            )
            self.num_cached_blocks[req_id] = num_full_blocks

    def free_uncomputed_tail(self, request: _CacheRequest) -> None:
        """Release the blocks past those the request's computed tokens occupy: after a
        step that rejected draft tokens, the blocks only they used (never registered:
        drafts are not hashed). Tail first, as in `free`."""
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return
        num_kept = -(-request.num_computed_tokens // self.block_size)
        if num_kept >= len(blocks):
            return
        tail = blocks[num_kept:]
        del blocks[num_kept:]
        del self.req_to_block_ids[request.req_id][num_kept:]
        self.block_pool.free_blocks(reversed(tail))

    def fork(
        self, parent: _CacheRequest, child: _CacheRequest, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give `child` (holding no blocks) the KV of `parent`'s first `num_tokens` tokens,
        which the parent has computed: its full blocks are shared (reference counts), and a
        partly covered last block is copied into a new block (copy-on-write: the child's
        next token is written there, where the parent writes its own). Returns the copies
        [(parent block, child block)] for the runner, or None (no change) if the pool is
        short. The child then grows like any running request.
        """
        if self.req_to_blocks.get(child.req_id):
            raise ValueError(f"request {child.req_id} already holds blocks")
        parent_blocks = self.req_to_blocks.get(parent.req_id, [])
        num_full, rest = divmod(num_tokens, self.block_size)
        if len(parent_blocks) < num_full + (rest > 0):
            raise ValueError(f"request {parent.req_id} holds fewer than {num_tokens} tokens")
        if rest and self.block_pool.get_num_free_blocks() < 1:
            return None
        shared = parent_blocks[:num_full]
        self.block_pool.touch(shared)
        blocks = list(shared)
        copies = []
        if rest:
            (copy,) = self.block_pool.get_new_blocks(1)
            copies.append((parent_blocks[num_full].block_id, copy.block_id))
            blocks.append(copy)
        # NOTE: the shared full blocks are the parent's to register; the child registers
        # from its own copy on.
        self._set_table(child.req_id, blocks, num_full)
        return copies

    def free(self, request: _CacheRequest) -> None:
        """Release the request's blocks (no-op if it holds none). Frees the table in
        reverse so that a sequence's tail is evicted before its head, which other
        requests are likelier to share.
        """
        req_id = request.req_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.req_to_block_ids.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def _set_table(self, req_id: str, blocks: list[KVCacheBlock], num_cached: int) -> None:
        """Install a new request's block table; its first `num_cached` blocks are already
        offered to the prefix cache."""
        self.req_to_blocks[req_id] = blocks
        self.req_to_block_ids[req_id] = [block.block_id for block in blocks]
        self.num_cached_blocks[req_id] = num_cached
        self._note_usage()

    def _note_usage(self) -> None:
        used = self.block_pool.get_num_used_blocks()
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, used)

    def reset_peak_num_used_blocks(self) -> None:
        """Restart the high-water mark from the blocks held now."""
        self.peak_num_used_blocks = self.block_pool.get_num_used_blocks()

    def occupancy(self, requests: Iterable[_CacheRequest]) -> KVOccupancy:
        """Read-only: the distinct blocks that `requests` hold, their slots, and the tokens
        stored in them. A block shared by several requests (prefix hits, n > 1 samples)
        counts once, holding as many tokens as its fullest holder has computed in it: a
        request with c computed tokens fills its table's block j with
        min(block_size, c - j * block_size) tokens, at least 0.
        """
        block_size = self.block_size
        fill: dict[int, int] = {}
        for request in requests:
            block_ids = self.req_to_block_ids.get(request.req_id)
            if not block_ids:
                continue
            num_full, rest = divmod(request.num_computed_tokens, block_size)
            for j, block_id in enumerate(block_ids):
                n = block_size if j < num_full else (rest if j == num_full else 0)
                if n > fill.get(block_id, -1):
                    fill[block_id] = n
        return KVOccupancy(len(fill), len(fill) * block_size, sum(fill.values()))
    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's host-tier copies, (device, host slot) offloads and (host slot, device)
        loads, for the runner to perform before the forward; host slots the step reserved
        become reusable. ([], []) without a host tier. Once per step, after its allocations.
        """
        if self.host_tier is None:
            return [], []
        copies = self.host_tier.take_copies()
        self.host_tier.end_step()
        return copies

    def discard_offloads(self, offloads: Iterable[tuple[int, int]]) -> None:
        """Forget the host-tier entries that a failed step's (device, slot) offloads were
        to fill: the copies may not have happened."""
        if self.host_tier is not None:
            self.host_tier.discard_slots(slot for _, slot in offloads)

    @property
    def host_tier_usage(self) -> float:
        """Fraction of host-tier slots holding a block, in [0, 1] (0 without a tier)."""
        return self.host_tier.usage if self.host_tier is not None else 0.0

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table as ids ([] if it holds none). The live list, so
        O(1): do not mutate it, and copy it to keep a snapshot.
        """
        return self.req_to_block_ids.get(req_id, [])

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes, host tier included; False (no change) while any block
        is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self, requests: Iterable[_CacheRequest] = ()) -> None:
        """Assert the pool's invariants plus: each block's ref_cnt equals its number of
        appearances over all tables, no block is twice in one table, the null block is in
        none, and the id tables match the block tables. For each of `requests` (those that
        hold blocks): every registered block in its table was computed, i.e. lies within
        its computed tokens and carries the hash of its own tokens there. Raises
        AssertionError with a message.
        """
        self.block_pool.check_integrity()
        num_refs: Counter[int] = Counter()
        for req_id, blocks in self.req_to_blocks.items():
            block_ids = [block.block_id for block in blocks]
            assert_that(len(set(block_ids)) == len(block_ids), f"{req_id}: a block twice in table")
            assert_that(self.req_to_block_ids.get(req_id) == block_ids, f"{req_id}: id table stale")
            assert_that(self.num_cached_blocks[req_id] <= len(blocks), f"{req_id}: cached > table")
            num_refs.update(block_ids)
        assert_that(self.req_to_block_ids.keys() == self.req_to_blocks.keys(), "tables disagree")
        assert_that(num_refs[self.block_pool.null_block.block_id] == 0, "null block in a table")
        for block in self.block_pool.blocks:
            assert_that(
                block.ref_cnt == num_refs[block.block_id],
                f"{block}: ref_cnt != {num_refs[block.block_id]} table appearances",
            )
        for request in requests:
            self._check_registered_were_computed(request)

    def _check_registered_were_computed(self, request: _CacheRequest) -> None:
        req_id = request.req_id
        num_computed_blocks = request.num_computed_tokens // self.block_size
        assert_that(self.num_cached_blocks.get(req_id, 0) <= num_computed_blocks,
                    f"{req_id}: more blocks offered to the cache than computed")
        for i, block in enumerate(self.req_to_blocks.get(req_id, ())):
            if block.block_hash is None:
                continue
            assert_that(i < num_computed_blocks,
                        f"{req_id}: {block} is registered but its tokens were not computed")
            assert_that(i < len(request.block_hashes) and
                        block.block_hash == request.block_hashes[i],
                        f"{req_id}: {block} is registered under another prefix's hash")
