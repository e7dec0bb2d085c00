"""The OpenMP team's size, adapted to what else holds the machine's cores.

Every kernel of a step is an OpenMP region that ends at a barrier, ~150 of them in a batch-1
decode step. When another busy process shares the cores (Linux's autogroups give each
session an equal share, whatever its nice value), a team of two threads gets one core's
worth of time between them, and each barrier waits for a thread that is off its core for a
time slice: the step runs several times slower than on one thread (measured:
docs/architecture.md, "The OpenMP team adapts"). OMP_WAIT_POLICY=PASSIVE avoids the
collapse too, but pays a wake-up at every region when the machine is quiet.

So the worker watches, over windows of `window_s`, two counters the kernel keeps:
- the run-queue delay of this process's threads (/proc/self/task/*/schedstat): time they
  were ready to run but waited for a core. With the full team, more than `wait_frac` of
  each of `windows` windows in a row means the cores are oversubscribed: the team drops
  to one thread. Half, twice in a row: far below what a multi-threaded competitor causes,
  above what a server's own benchmark client on the same cores does (both measured in
  docs/architecture.md), where one thread would serve less.
- the machine's idle time (/proc/stat): with one thread, when at least `idle_frac` of the
  other cores' time was idle, the cores are free again: the full team comes back.
Each switch is `torch.set_num_threads` on the thread that runs the steps (OpenMP's thread
count is per calling thread). Outputs do not depend on the team's size where each output
element is computed by one thread in one order whatever the count, as pagoda's kernels
do (a GEMV row, an attention head, a tile); tests/unit/test_omp_team.py switches the team
in the middle of decoding and compares tokens and logprobs with a fixed team's.

`PAGODA_OMP_ADAPT=0` keeps the team fixed. Off Linux (no /proc) it stays fixed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ENV = "PAGODA_OMP_ADAPT"
# NOTE: the team size a team lowered from, while lowered: a new engine in this process
# starts from it again (an engine may be dropped while its team is at one thread).
_lowered_from: int | None = None


def run_delay_seconds() -> float:
    """Seconds this process's threads have waited on a run queue, summed (schedstat)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # NOTE: a thread that ended between listdir and open
    return total / 1e9


def idle_core_seconds() -> float:
    """Seconds of idle (and iowait) time of all cores since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


class OmpTeam:
    """Switches torch's thread count between `max_threads` and 1 (see the module doc).

    `tick()` after each step; it reads the counters at most once per window."""

    def __init__(
        self,
        max_threads: int,
        window_s: float = 0.25,
        wait_frac: float = 0.5,
        idle_frac: float = 0.6,
        windows: int = 2,
        run_delay: Callable[[], float] = run_delay_seconds,
        idle: Callable[[], float] = idle_core_seconds,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if max_threads < 2:
            raise ValueError(f"OmpTeam needs at least 2 threads to adapt, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s, self.wait_frac, self.idle_frac = window_s, wait_frac, idle_frac
        self.windows = windows
        self._waiting = 0  # consecutive windows above wait_frac
        self._run_delay, self._idle, self._clock = run_delay, idle, clock
        self._set_threads = set_threads
        self.switches = 0  # NOTE: diagnostics and tests
        self._start()

    def _start(self) -> None:
        self._t0, self._wait0, self._idle0 = self._clock(), self._run_delay(), self._idle()

    def tick(self) -> None:
        now = self._clock()
        span = now - self._t0
        if span < self.window_s:
            return
        waited = (self._run_delay() - self._wait0) / span
        idle = (self._idle() - self._idle0) / span
        self._waiting = self._waiting + 1 if waited > self.wait_frac else 0
        if self.threads > 1 and self._waiting >= self.windows:
            self._switch(1, f"threads waited for a core {waited:.0%} of the last {span:.2f} s")
        elif self.threads == 1 and idle >= self.idle_frac * (self.max_threads - 1):
            self._switch(self.max_threads, f"{idle:.1f} cores idle over the last {span:.2f} s")
        self._start()

    def _switch(self, threads: int, why: str) -> None:
        global _lowered_from
        logger.info("OpenMP team: %d -> %d threads (%s)", self.threads, threads, why)
        self._set_threads(threads)
        _lowered_from = self.max_threads if threads < self.max_threads else None
        self.threads = threads
        self.switches += 1


def omp_team_for(device: torch.device) -> OmpTeam | None:
    """The adaptive team for a worker on `device`: None on a GPU, with one thread, with
    `PAGODA_OMP_ADAPT=0`, or where the counters cannot be read."""
    global _lowered_from
    if _lowered_from is not None:
        torch.set_num_threads(_lowered_from)
        _lowered_from = None
    if device.type != "cpu" or os.environ.get(ENV, "1") == "0":
        return None
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    try:
        return OmpTeam(threads)
    except (OSError, IndexError, ValueError):
        return None
