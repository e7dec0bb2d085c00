"""The host block pool of swap preemption: block accounting only (the runner holds the
tensors, one K and one V per layer shaped like the device cache).

| per swapped request | meaning                                                           |
|---------------------|-------------------------------------------------------------------|
| req_to_host_ids     | host block i holds the request's block i, tokens [i*bs, (i+1)*bs) |
|                     | of its computed tokens (the last block may be partly filled)      |

Every host block is free, held by exactly one swapped request, or (only inside a step)
released by a swap-in.

NOTE: blocks released by a swap-in stay reserved until `end_step()`. The runner performs a
step's swap-outs before its swap-ins, so a host block that a swap-in still has to read
must not become the target of a swap-out decided later in the same step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from pagoda.core.block_pool import assert_that


class HostBlockPool:
    """Host blocks handed out first free, first used (so tests can name exact ids)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._released: list[int] = []
        self.req_to_host_ids: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of host blocks held by swapped requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def swap_out(self, req_id: str, device_block_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Take one host block per device block for `req_id`: the (device, host) copy
        pairs, in table order; None, with no change, if too few host blocks are free.
        """
        if req_id in self.req_to_host_ids:
            raise ValueError(f"request {req_id} is already swapped out")
        if len(device_block_ids) > len(self._free):
            return None
        host_ids = [self._free.popleft() for _ in device_block_ids]
        self.req_to_host_ids[req_id] = host_ids
        return list(zip(device_block_ids, host_ids, strict=True))

    def swap_in(
        self, req_id: str, device_block_ids: Sequence[int], num_skipped: int = 0
    ) -> list[tuple[int, int]]:
        """Release `req_id`'s host blocks and return the (host, device) pairs that copy
        host block i into `device_block_ids[i]`, for i >= `num_skipped` (leading blocks the
        caller already has, e.g. from the prefix cache). The table may be longer than the
        swapped part; KeyError if `req_id` is not swapped out.
        """
        host_ids = self.req_to_host_ids.pop(req_id)
        self._released.extend(host_ids)
        return list(
            zip(host_ids[num_skipped:], device_block_ids[num_skipped : len(host_ids)], strict=True)
        )

    def free(self, req_id: str) -> None:
        """Drop a swapped request that ended (abort) without coming back; no-op if it holds
        no host blocks. Between steps only: its blocks are free at once.
        """
        host_ids = self.req_to_host_ids.pop(req_id, None)
        if host_ids:
            self._free.extend(host_ids)

    def end_step(self) -> None:
        """Make this step's swapped-in blocks free (the step's copies are all decided)."""
        self._free.extend(self._released)
        self._released.clear()

    def check_integrity(self, num_blocks_by_req: Mapping[str, int]) -> None:
        """Assert free + held == total with every block once, nothing pending release, and
        that exactly the requests in `num_blocks_by_req` hold that many host blocks each.
        """
        assert_that(not self._released, "host blocks released but not freed between steps")
        held = [h for ids in self.req_to_host_ids.values() for h in ids]
        every = [*self._free, *held]
        assert_that(len(every) == self.num_blocks, "host pool: free + held != total")
        assert_that(len(set(every)) == self.num_blocks, "host pool: a block twice")
        assert_that(not every or 0 <= min(every) <= max(every) < self.num_blocks,
                    "host pool: id out of range")
        assert_that(
            self.req_to_host_ids.keys() == num_blocks_by_req.keys(),
            f"host tables {sorted(self.req_to_host_ids)} != swapped {sorted(num_blocks_by_req)}",
        )
        for req_id, ids in self.req_to_host_ids.items():
            assert_that(
                len(ids) == num_blocks_by_req[req_id],
                f"{req_id}: {len(ids)} host blocks for {num_blocks_by_req[req_id]} computed",
            )
