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

Prefix-cache lookups and the registration at commit (`get_computed_blocks`,
`cache_blocks`) are core/prefix_cache.py's `PrefixCache`; the integrity check and the
occupancy view are core/kv_cache_checks.py's.

Block placement (`growth_reserve_blocks` > 0, plain managers): a request's new blocks are
taken from its reservation first (the free blocks that follow its last one, held for it),
and otherwise as a run in ascending id order from the next free blocks in eviction order,
with up to `growth_reserve_blocks` of the next ones reserved for its growth (fewer where
its max_tokens ends sooner, or the free blocks run out; BlockPool.peek_run). A table is then a few
runs of consecutive blocks rather than one block per run, which decode attention streams at
up to 1.4x the speed (docs/architecture.md, "Block placement"). Reservations count as free
and are stolen only once no unreserved block is free, so admission and capacity are as
without them; `free` returns a request's unused reservation ahead of its table.

With a host tier (`num_host_tier_blocks` > 0, core/host_tier.py), admission gives each host
hit a new device block and queues the host -> device copy (performed before the step's
forward); the request skips those tokens as computed, and the block is registered at
commit like any other. The step's copies, device -> host offloads of evicted blocks
included, are handed to the scheduler by `end_step()`; `discard_offloads` forgets the
offloads of a failed step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.host_tier import HostPrefixTier
from pagoda.core.kv_cache_checks import (  # NOTE: KVOccupancy is also imported from here
    KVOccupancy,
    check_manager_integrity,
    kv_occupancy,
)
from pagoda.core.kv_cache_spec import KVRetention
from pagoda.core.prefix_cache import CacheRequest, PrefixCache


class KVCacheManager(PrefixCache):
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
        growth_reserve_blocks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_tier_blocks < 0:
            raise ValueError(f"num_host_tier_blocks must be >= 0, got {num_host_tier_blocks}")
        if num_host_tier_blocks and not enable_caching:
            raise ValueError("a host tier (num_host_tier_blocks > 0) needs prefix caching")
        if growth_reserve_blocks < 0:
            raise ValueError(f"growth_reserve_blocks must be >= 0, got {growth_reserve_blocks}")
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
        # NOTE: placement needs tables that only grow at the end: plain managers only.
        self.growth_reserve_blocks = growth_reserve_blocks if self.plain else 0
        # Per request: the blocks reserved for its growth, lowest id first (entries a
        # prefix hit or a steal has taken since are skipped when reached).
        self.req_to_reserved: dict[str, deque[KVCacheBlock]] = {}
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

    def allocate_slots(
        self,
        request: CacheRequest,
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
            if self.growth_reserve_blocks:
                new_blocks = self._place(request, num_new_blocks, len(tables[0]))
            else:
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
        request: CacheRequest,
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
        if self.growth_reserve_blocks:
            new_blocks = self._place(request, num_new_blocks, len(computed_blocks))
        else:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if host_slots:
            self.host_tier.load(host_slots, [b.block_id for b in new_blocks[: len(host_slots)]])
            if request.num_preemptions == 0:
                self.prefix_cache_host_hits += len(host_slots) * self.block_size
        self._set_tables(request.req_id, [computed_blocks + new_blocks], len(computed_blocks))
        self._count_query(request, num_hit_tokens)
        return new_blocks

    def _place(self, request: CacheRequest, n: int, num_held: int) -> list[KVCacheBlock]:
        """`n` new blocks for the table of `request` (which holds `num_held`), in the order
        they extend it: its reserved blocks first, then a run of the next free blocks
        in eviction order, sorted by id, with the following ones reserved for its growth
        (`BlockPool.peek_run`). The caller has checked that `n` blocks are free.
        """
        pool, req_id = self.block_pool, request.req_id
        blocks: list[KVCacheBlock] = []
        reserved = self.req_to_reserved.get(req_id)
        while reserved and len(blocks) < n:
            block = reserved.popleft()
            if block.reserved_for == req_id:
                blocks.append(block)
        pool.take(blocks)
        rest = n - len(blocks)
        if rest == 0:
            return blocks
        room = self.growth_reserve_blocks
        max_tokens = request.max_num_tokens
        if max_tokens is not None:
            room = min(room, max(0, -(-max_tokens // self.block_size) - num_held - n))
        run, spare = pool.peek_run(rest, room)
        pool.take(run)
        if len(run) < rest:
            # NOTE: only reserved blocks are left: steal them (the newest reservation's
            # far end first).
            run = sorted(run + pool.get_new_blocks(rest - len(run)), key=lambda b: b.block_id)
        blocks += run
        if spare:
            pool.reserve(spare, req_id)
            self.req_to_reserved[req_id] = deque(spare)
        else:
            self.req_to_reserved.pop(req_id, None)
        return blocks

    def _allocate_first_groups(
        self,
        request: CacheRequest,
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

    def free_outside_window(self, request: CacheRequest) -> None:
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

    def free_uncomputed_tail(self, request: CacheRequest) -> None:
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
        if self.growth_reserve_blocks:
            # NOTE: the freed blocks are where the table grows next: hold them for it again.
            back = [b for b in tail if b.ref_cnt == 0 and b.reserved_for is None]
            self.block_pool.reserve(back, request.req_id)
            self.req_to_reserved.setdefault(request.req_id, deque()).extendleft(reversed(back))

    def fork(
        self, parent: CacheRequest, child: CacheRequest, num_tokens: int
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

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks (no-op if it holds none). Frees each table in
        reverse so that a sequence's tail is evicted before its head, which other
        requests are likelier to share.
        """
        req_id = request.req_id
        tables = self.req_to_blocks.pop(req_id, None)
        self.req_to_block_ids.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        reserved = self.req_to_reserved.pop(req_id, None)
        if reserved:
            # NOTE: they lie past the table's last block: like its tail, evicted first.
            self.block_pool.unreserve(reversed(reserved), req_id)
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

    def occupancy(self, requests: Iterable[CacheRequest]) -> KVOccupancy:
        """Read-only: the distinct blocks that `requests` hold, their slots, and the tokens
        stored in them (a shared block once; core/kv_cache_checks.py)."""
        return kv_occupancy(self, requests)

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

    def computed_block_ids(self, request: CacheRequest) -> list[int]:
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

    def check_integrity(self, requests: Iterable[CacheRequest] = ()) -> None:
        """Assert the pool's and the tables' invariants, and that every registered block
        in the tables of `requests` was computed (core/kv_cache_checks.py)."""
        check_manager_integrity(self, requests)
