"""Read-only views of the KV cache manager's tables: `KVCacheManager.occupancy` (how full
the held blocks are, for the benchmarks) and `KVCacheManager.check_integrity` (the pool's
and the tables' invariants, run between steps by the tests and `/debug/integrity`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.core.block_pool import assert_that
from pagoda.core.kv_groups import group_key
from pagoda.core.prefix_cache import CacheRequest

if TYPE_CHECKING:
    from pagoda.core.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class KVOccupancy:
    """How full the blocks of a set of requests are (see `KVCacheManager.occupancy`)."""

    num_blocks: int  # distinct blocks the requests hold
    num_slots: int  # num_blocks * block_size: token slots allocated
    num_tokens: int  # tokens whose K/V those blocks store

    @property
    def num_wasted_slots(self) -> int:
        return self.num_slots - self.num_tokens


def kv_occupancy(kv: KVCacheManager, requests: Iterable[CacheRequest]) -> KVOccupancy:
    """Read-only: the distinct blocks that `requests` hold, their slots, and the tokens
    stored in them. A block shared by several requests (prefix hits, n > 1 samples)
    counts once, holding as many tokens as its fullest holder has computed in it: a
    request with c computed tokens fills its table's block j with
    min(block_size, c - j * block_size) tokens, at least 0. Null entries hold nothing.
    """
    block_size, null_id = kv.block_size, kv.null_block.block_id
    fill: dict[int, int] = {}
    for request in requests:
        num_full, rest = divmod(request.num_computed_tokens, block_size)
        for block_ids in kv.req_to_block_ids.get(request.req_id, ()):
            for j, block_id in enumerate(block_ids):
                if block_id == null_id:
                    continue
                n = block_size if j < num_full else (rest if j == num_full else 0)
                if n > fill.get(block_id, -1):
                    fill[block_id] = n
    return KVOccupancy(len(fill), len(fill) * block_size, sum(fill.values()))


def check_manager_integrity(kv: KVCacheManager, requests: Iterable[CacheRequest]) -> None:
    """Assert the pool's invariants plus, over every group's tables: each block's
    ref_cnt equals its number of appearances, no block is twice in one table, the null
    block only in windowed groups, all tables of a request equally long, the id tables
    match the block tables, and every reservation belongs to a request that holds
    blocks. For each of `requests` (those that hold blocks): every registered block in
    its tables was computed, i.e. lies within its computed tokens and carries the
    (group's) hash of its own tokens there, and a windowed group has every block that
    queries from its computed tokens on read (null only before its window, past its
    sinks). Raises AssertionError with a message.
    """
    kv.block_pool.check_integrity()
    null_id = kv.null_block.block_id
    num_refs: Counter[int] = Counter()
    for req_id, tables in kv.req_to_blocks.items():
        assert_that(len(tables) == kv.num_groups, f"{req_id}: not one table per group")
        assert_that(len({len(t) for t in tables}) == 1, f"{req_id}: tables differ in length")
        for g, blocks in enumerate(tables):
            block_ids = [b.block_id for b in blocks if b.block_id != null_id]
            assert_that(len(set(block_ids)) == len(block_ids),
                        f"{req_id}: a block twice in table")
            assert_that(kv.retentions[g].keeps_all is False or len(block_ids) ==
                        len(blocks), f"{req_id}: null block in a full-attention table")
            assert_that(kv.num_cached_blocks[req_id][g] <= len(blocks),
                        f"{req_id}: cached > table")
            num_refs.update(block_ids)
        assert_that(kv.req_to_block_ids.get(req_id) ==
                    [[b.block_id for b in t] for t in tables], f"{req_id}: id table stale")
    assert_that(kv.req_to_block_ids.keys() == kv.req_to_blocks.keys(), "tables disagree")
    for block in kv.block_pool.blocks[1:]:
        assert_that(
            block.ref_cnt == num_refs[block.block_id],
            f"{block}: ref_cnt != {num_refs[block.block_id]} table appearances",
        )
        assert_that(block.reserved_for is None or block.reserved_for in kv.req_to_blocks,
                    f"{block} is reserved for a request that holds no blocks")
    assert_that(kv.req_to_reserved.keys() <= kv.req_to_blocks.keys(),
                "a reservation list outlived its request's tables")
    for request in requests:
        _check_registered_were_computed(kv, request)


def _check_registered_were_computed(kv: KVCacheManager, request: CacheRequest) -> None:
    req_id = request.req_id
    bs = kv.block_size
    num_computed_blocks = request.num_computed_tokens // bs
    tables = kv.req_to_blocks.get(req_id, ())
    for g, blocks in enumerate(tables):
        assert_that(kv.num_cached_blocks[req_id][g] <= num_computed_blocks,
                    f"{req_id}: more blocks offered to the cache than computed")
        retention = kv.retentions[g]
        for i, block in enumerate(blocks):
            if block is kv.null_block:
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
