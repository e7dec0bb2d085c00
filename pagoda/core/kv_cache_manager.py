"""Per-request block tables over one BlockPool: admission, prefix hits, commits and frees.

The scheduler's view of KV memory. A request has one block table per KV cache group
(core/kv_cache_spec.py: one group per attention type), all drawn from the one pool and all
of the same length: entry i of a group's table holds that group's K/V of tokens
[i * block_size, (i + 1) * block_size). A group whose `KVRetention` keeps only a window
(sliding window, attention sinks) frees the blocks no later query reads and puts the null
block in their place (`allocate_slots` does it before growing the table), so a long request
holds about window / block_size + 1 blocks there. Prefix hits prepend shared, already full
blocks; new tokens are only ever written into blocks the request owns alone (the hit never
covers the last prompt token, and only full blocks are shared), so sharing needs no
copy-on-write here.

| per request       | meaning                                                          |
|-------------------|------------------------------------------------------------------|
| req_to_blocks     | the block tables, one per group (KVCacheBlock objects)           |
| req_to_block_ids  | the same tables as ids, kept in step so reading them costs nothing|
| num_cached_blocks | per group: leading blocks already offered to the prefix cache    |
|                   | (registered, skipped as duplicates, or null); the next           |
|                   | registration starts there                                        |

Group g > 0 registers its blocks under the request's block hash salted with g, so that
the groups' blocks for the same tokens (different K/V: different layers) never collide in
the pool's one hash map. A prefix hit is the longest prefix for which every group has the
blocks it needs (all of them for full attention; the sink and window blocks for a windowed
group).

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
Host-tier hits continue a lookup only for a manager of one full-attention group (`plain`);
with windowed groups lookups stop at the device cache (evicted blocks are still offloaded).
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
from pagoda.core.kv_cache_spec import KVRetention
from pagoda.core.kv_groups import GroupHashes, group_key, longest_servable


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

    `retentions` gives one group per entry (default: one full-attention group).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_tier_blocks: int = 0,
        retentions: Sequence[KVRetention] = (KVRetention(),),
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_tier_blocks < 0:
            raise ValueError(f"num_host_tier_blocks must be >= 0, got {num_host_tier_blocks}")
        if num_host_tier_blocks and not enable_caching:
            raise ValueError("a host tier (num_host_tier_blocks > 0) needs prefix caching")
        if not retentions or len(retentions) > 255:
            raise ValueError(f"between 1 and 255 KV cache groups, got {len(retentions)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.retentions = tuple(retentions)
        self.num_groups = len(self.retentions)
        # NOTE: one full-attention group: the tables are append-only, host-tier hits
        # continue lookups and n > 1 samples fork (all of them assume nothing is freed early).
        self.plain = self.num_groups == 1 and self.retentions[0].keeps_all
        self.host_tier = HostPrefixTier(num_host_tier_blocks) if num_host_tier_blocks else None
        self.block_pool = BlockPool(num_blocks, enable_caching, self.host_tier)
        self.null_block = self.block_pool.null_block
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.req_to_block_ids: dict[str, list[list[int]]] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}
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

    @property
    def supports_fork(self) -> bool:
        """Whether `fork` may be used: a windowed parent may have freed blocks its fork
        needs, so only a plain manager forks (other samples hit the prefix cache)."""
        return self.plain

    def get_computed_blocks(self, request: _CacheRequest) -> tuple[list[KVCacheBlock], int]:
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
        self, request: _CacheRequest, max_num_blocks: int
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

    def allocate_slots(
        self,
        request: _CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's tables to cover num_computed_tokens + num_new_computed_tokens +
        num_new_tokens tokens; return the newly allocated blocks, every group's in turn
        (group-major, the same count per group; prefix hits excluded), or None, with no
        state change but the window's, if the pool is short.

        A windowed group first frees the blocks that no query from num_computed_tokens on
        reads (even when the allocation then fails: they are never read again).
        `new_computed_blocks` (from `get_computed_blocks`, only for a request that holds no
        blocks) are shared and prepended. Computed tokens past them are host-tier hits:
        each gets a new device block and a queued host -> device copy. Registers nothing
        (see `cache_blocks`).
        """
        block_size = self.block_size
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        tables = self.req_to_blocks.get(request.req_id)
        if tables is not None and not new_computed_blocks:
            # NOTE: the per-step path of a running request: O(1) unless the table grows.
            if not self.plain:
                self.free_outside_window(request)
            num_new_blocks = -(-num_tokens // block_size) - len(tables[0])
            if num_new_blocks <= 0:
                return []
            if num_new_blocks * self.num_groups > self.block_pool.get_num_free_blocks():
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks * self.num_groups)
            id_tables = self.req_to_block_ids[request.req_id]
            for g, (table, id_table) in enumerate(zip(tables, id_tables, strict=True)):
                part = new_blocks[g * num_new_blocks : (g + 1) * num_new_blocks]
                table.extend(part)
                id_table.extend(b.block_id for b in part)
            self._note_usage()
            return new_blocks
        if tables and any(tables):
            raise ValueError(f"request {request.req_id} already holds blocks")
        if self.plain:
            return self._allocate_first(
                request, num_tokens, new_computed_blocks or [], num_new_computed_tokens
            )
        return self._allocate_first_groups(
            request, num_tokens, new_computed_blocks or [], num_new_computed_tokens
        )

    def _allocate_first(
        self,
        request: _CacheRequest,
        num_tokens: int,
        computed_blocks: list[KVCacheBlock],
        num_hit_tokens: int,
    ) -> list[KVCacheBlock] | None:
        """Create the table of a request that holds no blocks (plain manager): share
        `computed_blocks`, load the host hits that follow them, then allocate the rest.
        None (and no change) if the pool is short.
        """
        self._check_still_cached(request, [computed_blocks])
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
        self._set_tables(request.req_id, [computed_blocks + new_blocks], len(computed_blocks))
        self._count_query(request, num_hit_tokens)
        return new_blocks

    def _allocate_first_groups(
        self,
        request: _CacheRequest,
        num_tokens: int,
        computed_blocks: list[KVCacheBlock],
        num_hit_tokens: int,
    ) -> list[KVCacheBlock] | None:
        """`_allocate_first` for a manager with windowed groups: every group shares its hit
        table, then gets new blocks for the entries it needs past the hit (the null block
        for the others: e.g. a swap-in's blocks outside its window)."""
        bs, null, g_count = self.block_size, self.null_block, self.num_groups
        num_hits = len(computed_blocks) // g_count
        hits = [computed_blocks[g * num_hits : (g + 1) * num_hits] for g in range(g_count)]
        self._check_still_cached(request, hits)
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_entries = -(-num_tokens // bs)
        needed = [
            [r.needs_block(j, num_computed, bs) for j in range(num_hits, num_entries)]
            for r in self.retentions
        ]
        num_new_blocks = sum(sum(n) for n in needed)
        reused = {b.block_id for b in computed_blocks if b.ref_cnt == 0 and b is not null}
        if num_new_blocks > self.block_pool.get_num_free_blocks() - len(reused):
            return None
        self.block_pool.touch(b for b in computed_blocks if b is not null)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        fresh = iter(new_blocks)
        tables = [hits[g] + [next(fresh) if n else null for n in needed[g]]
                  for g in range(g_count)]
        self._set_tables(request.req_id, tables, num_hits)
        self._count_query(request, num_hit_tokens)
        return new_blocks

    def _count_query(self, request: _CacheRequest, num_hit_tokens: int) -> None:
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def free_outside_window(self, request: _CacheRequest) -> None:
        """Free, in every windowed group, the blocks no query from the request's
        num_computed_tokens on reads, and put the null block in their table entries."""
        tables = self.req_to_blocks.get(request.req_id)
        if tables is None:
            return
        bs, null = self.block_size, self.null_block
        id_tables = self.req_to_block_ids[request.req_id]
        for retention, table, id_table in zip(self.retentions, tables, id_tables, strict=True):
            if retention.keeps_all:
                continue
            first = min(retention.first_window_block(request.num_computed_tokens, bs),
                        len(table))
            lowest = retention.num_sink_blocks(bs)
            # NOTE: the freed entries are one run ending at the window's start (earlier
            # steps freed the rest), so walking back from there is O(1) per step.
            freed = []
            j = first - 1
            while j >= lowest and table[j] is not null:
                freed.append(table[j])
                table[j], id_table[j] = null, null.block_id
                j -= 1
            if freed:
                self.block_pool.free_blocks(reversed(freed))

    def _check_still_cached(
        self, request: _CacheRequest, hit_tables: Sequence[Sequence[KVCacheBlock]]
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

    def cache_blocks(self, request: _CacheRequest, num_written_tokens: int | None = None) -> None:
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

    def free_uncomputed_tail(self, request: _CacheRequest) -> None:
        """Release, in every group, the blocks past those the request's computed tokens
        occupy: after a step that rejected draft tokens, the blocks only they used (never
        registered: drafts are not hashed). Tail first, as in `free`."""
        tables = self.req_to_blocks.get(request.req_id)
        if not tables:
            return
        num_kept = -(-request.num_computed_tokens // self.block_size)
        if num_kept >= len(tables[0]):
            return
        tail: list[KVCacheBlock] = []
        for table, id_table in zip(tables, self.req_to_block_ids[request.req_id], strict=True):
            tail += [b for b in table[num_kept:] if b is not self.null_block]
            del table[num_kept:]
            del id_table[num_kept:]
        self.block_pool.free_blocks(reversed(tail))

    def fork(
        self, parent: _CacheRequest, child: _CacheRequest, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give `child` (holding no blocks) the KV of `parent`'s first `num_tokens` tokens,
        which the parent has computed: its full blocks are shared (reference counts), and a
        partly covered last block is copied into a new block (copy-on-write: the child's
        next token is written there, where the parent writes its own). Returns the copies
        [(parent block, child block)] for the runner, or None (no change) if the pool is
        short. The child then grows like any running request. Plain managers only.
        """
        if not self.plain:
            raise ValueError("fork needs a manager of one full-attention group")
        if self.get_block_ids(child.req_id):
            raise ValueError(f"request {child.req_id} already holds blocks")
        parent_blocks = self.req_to_blocks.get(parent.req_id, [[]])[0]
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
        self._set_tables(child.req_id, [blocks], num_full)
        return copies

    def free(self, request: _CacheRequest) -> None:
        """Release the request's blocks (no-op if it holds none). Frees each table in
        reverse so that a sequence's tail is evicted before its head, which other
        requests are likelier to share.
        """
        req_id = request.req_id
        tables = self.req_to_blocks.pop(req_id, None)
        self.req_to_block_ids.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        null = self.null_block
        for blocks in tables or ():
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def _set_tables(
        self, req_id: str, tables: list[list[KVCacheBlock]], num_cached: int
    ) -> None:
        """Install a new request's block tables; their first `num_cached` entries are
        already offered to the prefix cache."""
        self.req_to_blocks[req_id] = tables
        self.req_to_block_ids[req_id] = [[block.block_id for block in t] for t in tables]
        self.num_cached_blocks[req_id] = [num_cached] * len(tables)
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
        min(block_size, c - j * block_size) tokens, at least 0. Null entries hold nothing.
        """
        block_size, null_id = self.block_size, self.null_block.block_id
        fill: dict[int, int] = {}
        for request in requests:
            num_full, rest = divmod(request.num_computed_tokens, block_size)
            for block_ids in self.req_to_block_ids.get(request.req_id, ()):
                for j, block_id in enumerate(block_ids):
                    if block_id == null_id:
                        continue
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

    def get_block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """One group's block table of the request as ids ([] if it holds none). The live
        list, so O(1): do not mutate it, and copy it to keep a snapshot.
        """
        tables = self.req_to_block_ids.get(req_id)
        return tables[group] if tables else []

    def get_group_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """Every group's block table as ids (live lists, as `get_block_ids`)."""
        tables = self.req_to_block_ids.get(req_id)
        return tuple(tables) if tables else tuple([] for _ in range(self.num_groups))

    def group_ids(self, new_blocks: Sequence[KVCacheBlock]) -> tuple[list[int], ...]:
        """`allocate_slots`'s group-major new blocks as one id list per group."""
        n = len(new_blocks) // self.num_groups
        return tuple([b.block_id for b in new_blocks[g * n : (g + 1) * n]]
                     for g in range(self.num_groups))

    def computed_block_ids(self, request: _CacheRequest) -> list[int]:
        """The blocks holding the request's computed tokens that its groups keep, group-major
        (what a swap-out copies; a swap-in's new table lists its blocks in the same order).
        Frees the blocks outside the windows first."""
        self.free_outside_window(request)
        n = -(-request.num_computed_tokens // self.block_size)
        null_id = self.null_block.block_id
        return [b for ids in self.get_group_block_ids(request.req_id) for b in ids[:n]
                if b != null_id]

    def num_kept_blocks(self, num_computed_tokens: int) -> int:
        """How many blocks `computed_block_ids` lists for that many computed tokens."""
        return sum(r.num_kept_blocks(num_computed_tokens, self.block_size)
                   for r in self.retentions)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes, host tier included; False (no change) while any block
        is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self, requests: Iterable[_CacheRequest] = ()) -> None:
        """Assert the pool's invariants plus, over every group's tables: each block's
        ref_cnt equals its number of appearances, no block is twice in one table, the null
        block only in windowed groups, all tables of a request equally long, and the id
        tables match the block tables. For each of `requests` (those that hold blocks):
        every registered block in its tables was computed, i.e. lies within its computed
        tokens and carries the (group's) hash of its own tokens there, and a windowed group
        has every block that queries from its computed tokens on read (null only before
        its window, past its sinks). Raises
        AssertionError with a message.
        """
        self.block_pool.check_integrity()
        null_id = self.null_block.block_id
        num_refs: Counter[int] = Counter()
        for req_id, tables in self.req_to_blocks.items():
            assert_that(len(tables) == self.num_groups, f"{req_id}: not one table per group")
            assert_that(len({len(t) for t in tables}) == 1, f"{req_id}: tables differ in length")
            for g, blocks in enumerate(tables):
                block_ids = [b.block_id for b in blocks if b.block_id != null_id]
                assert_that(len(set(block_ids)) == len(block_ids),
                            f"{req_id}: a block twice in table")
                assert_that(self.retentions[g].keeps_all is False or len(block_ids) ==
                            len(blocks), f"{req_id}: null block in a full-attention table")
                assert_that(self.num_cached_blocks[req_id][g] <= len(blocks),
                            f"{req_id}: cached > table")
                num_refs.update(block_ids)
            assert_that(self.req_to_block_ids.get(req_id) ==
                        [[b.block_id for b in t] for t in tables], f"{req_id}: id table stale")
        assert_that(self.req_to_block_ids.keys() == self.req_to_blocks.keys(), "tables disagree")
        for block in self.block_pool.blocks[1:]:
            assert_that(
                block.ref_cnt == num_refs[block.block_id],
                f"{block}: ref_cnt != {num_refs[block.block_id]} table appearances",
            )
        for request in requests:
            self._check_registered_were_computed(request)

    def _check_registered_were_computed(self, request: _CacheRequest) -> None:
        req_id = request.req_id
        bs = self.block_size
        num_computed_blocks = request.num_computed_tokens // bs
        tables = self.req_to_blocks.get(req_id, ())
        for g, blocks in enumerate(tables):
            assert_that(self.num_cached_blocks[req_id][g] <= num_computed_blocks,
                        f"{req_id}: more blocks offered to the cache than computed")
            retention = self.retentions[g]
            for i, block in enumerate(blocks):
                if block is self.null_block:
                    assert_that(not retention.needs_block(i, request.num_computed_tokens, bs),
                                f"{req_id}: group {g} lacks block {i}, which its window reads")
                    continue
                if block.block_hash is None:
                    continue
                assert_that(i < num_computed_blocks,
                            f"{req_id}: {block} is registered but its tokens were not computed")
                assert_that(i < len(request.block_hashes) and
                            block.block_hash == group_key(request.block_hashes[i], g),
                            f"{req_id}: {block} is registered under another prefix's hash")
