"""Preemption: how a running request gives its device blocks back, and how a swapped one
comes back. Which request is the victim is the scheduling policy's choice
(core/request_queue.py); this module only carries it out.

| mode      | on preemption                             | waits as  | on resume                   |
|-----------|-------------------------------------------|-----------|-----------------------------|
| recompute | free the blocks, num_computed_tokens = 0  | PREEMPTED | prefill again (prefix cache |
|           |                                           |           | hits make that cheap)       |
| swap      | copy the computed blocks to host blocks,  | SWAPPED   | new device blocks, KV copied|
|           | free the device blocks                    |           | back, num_computed_tokens   |
|           |                                           |           | kept: no recompute          |

Swap falls back to recompute when the host pool cannot hold the victim, and when the
victim has computed nothing (there is nothing to keep).

NOTE: copying out the blocks that cover `num_computed_tokens` is right with steps in
flight too (async scheduling): the worker runs the steps in order, so a swap-out copy,
done before its own step's forward, comes after every earlier step has written its K/V.
"""

from __future__ import annotations

from pagoda.core.block_pool import KVCacheBlock, assert_that
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.swap import HostBlockPool

PREEMPTION_MODES = ("recompute", "swap")


class Preemptor:
    """Carries out preemptions and swap-ins over one KVCacheManager and, in swap mode, one
    HostBlockPool of `num_host_blocks` blocks. Counts preemptions (all modes) and swaps.
    """

    def __init__(
        self, kv: KVCacheManager, mode: str = "recompute", num_host_blocks: int = 0
    ) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.kv = kv
        self.mode = mode
        self.host_pool = HostBlockPool(num_host_blocks) if mode == "swap" else None
        self.num_preemptions = 0
        self.num_swaps = 0

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is in the host pool now."""
        return len(self.host_pool.req_to_host_ids) if self.host_pool else 0

    def preempt(self, req: Request) -> list[tuple[int, int]]:
        """Free `req`'s device blocks; return the (device, host) copies to perform before
        the next forward ([] for recompute). Sets `req.status` to SWAPPED or PREEMPTED; the
        caller requeues `req` and tells the runner to drop its state.
        """
        self.num_preemptions += 1
        req.num_preemptions += 1
        pairs = None
        if self.host_pool is not None and req.num_computed_tokens > 0:
            device_ids = self.kv.computed_block_ids(req)
            pairs = self.host_pool.swap_out(req.req_id, device_ids)
        self.kv.free(req)
        if pairs is None:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            return []
        req.status = RequestStatus.SWAPPED
        self.num_swaps += 1
        return pairs

    def swap_in(
        self, req: Request, num_new_tokens: int
    ) -> tuple[list[KVCacheBlock], list[tuple[int, int]]] | None:
        """Give a SWAPPED `req` device blocks for its computed tokens plus `num_new_tokens`:
        (new blocks, (host, device) copies to perform before the forward), or None, with no
        change, if the device pool is short. Leading full blocks still in the prefix cache
        are shared instead of copied. `req.num_computed_tokens` is unchanged.
        """
        assert self.host_pool is not None, "swap_in without a host pool"
        if not self.kv.plain:
            # NOTE: with windowed groups every kept block is copied back (no hits shared):
            # the new tables list them in the order `computed_block_ids` copied them out.
            new_blocks = self.kv.allocate_slots(req, num_new_tokens)
            if new_blocks is None:
                return None
            table = self.kv.computed_block_ids(req)
            return new_blocks, self.host_pool.swap_in(req.req_id, table)
        hits, _ = self.kv.get_computed_blocks(req)
        # NOTE: only hits inside the swapped part: those blocks' copies are skipped; the
        # tokens past num_computed_tokens are scheduled as usual.
        del hits[req.num_computed_tokens // self.kv.block_size :]
        # NOTE: the hits are passed as blocks but not as new computed tokens: the table is
        # sized from num_computed_tokens, which already covers them.
        new_blocks = self.kv.allocate_slots(req, num_new_tokens, hits, 0)
        if new_blocks is None:
            return None
        table = self.kv.get_block_ids(req.req_id)
        return new_blocks, self.host_pool.swap_in(req.req_id, table, num_skipped=len(hits))

    def free(self, req: Request) -> None:
        """Release everything an ending request holds: device blocks and host blocks."""
        self.kv.free(req)
        if self.host_pool is not None:
            self.host_pool.free(req.req_id)

    def end_step(self) -> None:
        if self.host_pool is not None:
            self.host_pool.end_step()

    def check_integrity(self, waiting: list[Request]) -> None:
        """Assert the host pool's accounting against the waiting requests: exactly the
        SWAPPED ones hold host blocks, as many as cover their computed tokens.
        """
        swapped = {
            r.req_id: self.kv.num_kept_blocks(r.num_computed_tokens)
            for r in waiting
            if r.status == RequestStatus.SWAPPED
        }
        if self.host_pool is None:
            assert_that(not swapped, f"swapped requests {sorted(swapped)} without a host pool")
            return
        self.host_pool.check_integrity(swapped)
