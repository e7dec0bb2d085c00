"""The prefix-cache side of the KV cache manager: lookups, registration at commit, and
the checks that a hit is still there when it is used.

Group g > 0 registers its blocks under the request's block hash salted with g, so that
the groups' blocks for the same tokens (different K/V: different layers) never collide in
the pool's one hash map. A prefix hit is the longest prefix for which every group has the
blocks it needs (all of them for full attention; the sink and window blocks for a windowed
group).

Registration happens at commit only: `cache_blocks(request)`, called by the scheduler once
a step has returned, registers the full blocks that the request's computed tokens cover.
Allocation registers nothing, so a step that fails or is interrupted leaves no block
findable whose K/V was never written, and needs no undo.

With a host tier (core/host_tier.py), a lookup that runs out of device hits continues its
chain in host memory (`get_computed_blocks`); admission then loads those hits into new
device blocks (`KVCacheManager.allocate_slots`). Host-tier hits continue a lookup only for
a manager of one full-attention group (`plain`); with windowed groups lookups stop at the
device cache (evicted blocks are still offloaded).

`PrefixCache` is a part of `KVCacheManager` (core/kv_cache_manager.py), split out by
concept: its methods read the manager's pool and tables, and `cache_blocks` registers in
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Protocol

from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.hashing import BlockHash
from pagoda.core.host_tier import HostPrefixTier
from pagoda.core.kv_cache_spec import KVRetention
from pagoda.core.kv_groups import GroupHashes, group_key, longest_servable


class CacheRequest(Protocol):
    """What the manager reads of a request (core/request.py's `Request`)."""

    req_id: str
    num_computed_tokens: int
    num_preemptions: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...

    @property
    def max_num_tokens(self) -> int | None: ...


class PrefixCache:
    """The prefix-cache methods of `KVCacheManager` (see the module docstring)."""

    block_size: int
    enable_caching: bool
    plain: bool
    num_groups: int
    retentions: tuple[KVRetention, ...]
    block_pool: BlockPool
    null_block: KVCacheBlock
    host_tier: HostPrefixTier | None
    req_to_blocks: dict[str, list[list[KVCacheBlock]]]
    num_cached_blocks: dict[str, list[int]]
    prefix_cache_queries: int
    prefix_cache_hits: int

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request.block_hashes`: its blocks and the number of
        tokens that the prefix cache covers. Never covers the last token (it must be
        computed to get logits). ([], 0) when caching is off. Changes no state: pass the
        result to `allocate_slots` before any other allocation.

        Plain manager: the run of device-cached blocks from the start, then the run of
        host-tier hits that continues the chain (tokens past the blocks' coverage are host
        hits, which `allocate_slots` loads). Otherwise the blocks are every group's hit
        table concatenated (group-major, each as long as the hit, with the null block where
        a windowed group needs nothing), device hits only.
        """
        if not self.enable_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        if not self.plain:
            return self._group_hits(request, min(max_num_blocks, len(request.block_hashes)))
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

    def _group_hits(
        self, request: CacheRequest, max_num_blocks: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix (in blocks) every group can serve, and the groups' tables."""
        lookup = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        found = [
            [lookup(group_key(h, g)) for h in islice(hashes, max_num_blocks)]
            for g in range(self.num_groups)
        ]
        num_hits = max_num_blocks
        while True:
            before = num_hits
            for g, retention in enumerate(self.retentions):
                num_hits = longest_servable(found[g], retention, num_hits, self.block_size)
            if num_hits == before:
                break
        bs, null = self.block_size, self.null_block
        blocks = []
        for g, retention in enumerate(self.retentions):
            blocks.extend(found[g][j] if retention.needs_block(j, num_hits * bs, bs) else null
                          for j in range(num_hits))
        return blocks, num_hits * bs

    def cache_blocks(self, request: CacheRequest, num_written_tokens: int | None = None) -> None:
        """Register the full blocks that the request's first `num_written_tokens` tokens
        (default: its computed tokens) cover and that have a hash in
        `request.block_hashes`, in every group (null entries skipped). Called at commit:
        once the step that computed those tokens (or copied them in from host memory) has
        returned; with later steps in flight, their tokens are not written yet.
        """
        if not self.enable_caching:
            return
        if num_written_tokens is None:
            num_written_tokens = request.num_computed_tokens
        # NOTE: capping by the hashes keeps tokens computed past the hashed ones (draft
        # tokens, which must not be hashed until accepted) out of the cache.
        num_full_blocks = min(num_written_tokens // self.block_size,
                              len(request.block_hashes))
        req_id = request.req_id
        num_cached = self.num_cached_blocks[req_id]
        for g, table in enumerate(self.req_to_blocks[req_id]):
            if num_full_blocks > num_cached[g]:
                hashes = request.block_hashes if g == 0 else GroupHashes(
                    request.block_hashes, g)
                self.block_pool.cache_full_blocks(table, hashes, num_cached[g], num_full_blocks)
                num_cached[g] = num_full_blocks

    def _count_query(self, request: CacheRequest, num_hit_tokens: int) -> None:
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _check_still_cached(
        self, request: CacheRequest, hit_tables: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        """Raise if a hit was evicted (or reassigned) since `get_computed_blocks`: using it
        would silently read another sequence's KV.
        """
        for g, blocks in enumerate(hit_tables):
            if len(blocks) > len(request.block_hashes):
                raise RuntimeError(f"request {request.req_id}: more hits than block hashes")
            for block, block_hash in zip(blocks, request.block_hashes, strict=False):
                if block is not self.null_block and block.block_hash != group_key(block_hash, g):
                    raise RuntimeError(
                        f"request {request.req_id}: prefix hit {block} was evicted before "
                        "allocate_slots; call get_computed_blocks right before it"
                    )

    def _host_hit_hashes(
        self, request: CacheRequest, num_device_hits: int, num_hit_tokens: int
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
