"""`BurstInterrupt`: the flag that ends a running decode burst early.

A decode burst (`SchedulerOutput.decode_bursts`) runs several decode steps of the running
requests in one extension call, during which the engine applies no command. A request that arrives
meanwhile would wait for the whole burst (8 steps by default). The engine's loop raises
this flag when a command that changes what runs is queued (an add or an abort) and lowers
it when it takes its commands; the burst's call reads it before each step after the first
and starts no step once it is raised. So a new request waits for at most one decode step,
and the burst's tokens are those it would have computed anyway (it only ends sooner).

The flag is a uint8 [1] CPU tensor, which the extension reads while the engine's thread
(or the engine-core process's command reader) writes it: one byte, written and read
whole. A future worker in another process would share the same tensor's memory.
"""

from __future__ import annotations

import torch


class BurstInterrupt:
    """A flag any thread may raise or lower; `flag` is what the burst's call reads."""

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.uint8)
        self._view = self.flag.numpy()  # NOTE: a plain store, no torch op per command

    def set(self) -> None:
        self._view[0] = 1

    def clear(self) -> None:
        self._view[0] = 0

    def is_set(self) -> bool:
        return bool(self._view[0])
