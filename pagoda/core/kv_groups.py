"""Helpers of the KV cache manager's groups: the prefix-cache key of a group's block, a
request's hashes seen as a group's keys, and the longest prefix hit one group can serve."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.core.block_pool import KVCacheBlock
from pagoda.core.hashing import BlockHash
from pagoda.core.kv_cache_spec import KVRetention


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The key group `group` registers a block of these tokens under (group 0: the hash)."""
    return block_hash if group == 0 else block_hash + bytes((group,))


class GroupHashes(Sequence[BlockHash]):
    """A request's block hashes as group g's keys, salted on access (no copy per commit)."""

    __slots__ = ("_group", "_hashes")

    def __init__(self, hashes: Sequence[BlockHash], group: int) -> None:
        self._hashes, self._group = hashes, group

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i):  # type: ignore[override]
        return group_key(self._hashes[i], self._group)


def longest_servable(
    found: Sequence[KVCacheBlock | None], retention: KVRetention, limit: int, block_size: int
) -> int:
    """The largest e <= limit such that every block a query at position e * block_size
    needs among the first e blocks is in `found` (not None): a prefix hit of e blocks."""
    if retention.keeps_all:
        for j in range(limit):
            if found[j] is None:
                return j
        return limit
    num_sinks = retention.num_sink_blocks(block_size)
    first_miss = next((j for j in range(min(num_sinks, limit)) if found[j] is None), None)
    last_miss = -1  # the last miss before e, updated as e grows
    best = 0
    for e in range(1, limit + 1):
        if found[e - 1] is None:
            last_miss = e - 1
        if first_miss is not None and first_miss < min(num_sinks, e):
            break
        start = max(retention.first_window_block(e * block_size, block_size), num_sinks)
        if last_miss < start:
            best = e
    return best
