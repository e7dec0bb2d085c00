"""The API process's end of the engine-core process (`--engine-process`): the same front
end as AsyncLLMEngine (async_engine.EngineClient), over a pipe to a spawned child that
runs the LLMEngine's step loop (core_process.py has the wire protocol).

Why a process: on the engine thread, the step loop's Python (scheduling, input
preparation, output processing, detokenization) shares the GIL with the event loop's
(HTTP parsing, JSON, SSE, tokenization); in its own process it shares neither the GIL nor
the allocator. The API process keeps HTTP, tokenization of prompts and the metrics
registry, and runs torch on one thread (it runs no model); the child gets the OpenMP
setting from the environment (`apply_openmp_defaults` ran before the spawn).

The event loop reads the pipe (`add_reader`, one message per readiness), so outputs,
replies and stats are applied in the order the core made them. Failure semantics, as in
the thread: a step fault fails only its running requests; if the child dies, every
waiting stream and reply gets EngineDeadError and `is_alive` (/health) turns false;
`shutdown()` stops the child and reaps it (SIGTERM, then SIGKILL, if it does not stop).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.async_engine import EngineClient
from pagoda.engine.core_process import (
    FORWARDED_METRICS,
    CoreInfo,
    StopCommand,
    restore_prompts,
    run_engine_core,
)
from pagoda.engine.deadlines import TimeoutPolicy
from pagoda.engine.engine_core import EngineDeadError
from pagoda.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 30.0


class EngineCoreClient(EngineClient):
    """The front end over an engine-core child process (see the module docstring)."""

    def __init__(self, process: BaseProcess, conn: Connection, info: CoreInfo,
                 stats: SchedulerStats, max_queued_requests: int | None = None) -> None:
        super().__init__(stats, max_queued_requests)
        self.engine = info  # NOTE: read-only facts (tokenizer, max_model_len), as in-thread
        self.metrics: EngineMetrics | None = None
        self.process = process
        self._conn = conn
        self._reading = False
        self._stopping = False  # shutdown() began: the pipe's end is expected
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # restore_prompts

    @classmethod
    def spawn(cls, factory: Callable[[], Any], policy: TimeoutPolicy | None = None,
              max_queued_requests: int | None = None,
              setup: Callable[[], None] | None = None,
              start_method: str = "spawn") -> EngineCoreClient:
        """Starts the child, which builds the engine with `factory()` (picklable, e.g.
        `partial(LLMEngine, config)`: the model loads there), and waits until it is ready;
        re-raises what the factory raised. `setup()` runs first in the child (logging).

        `start_method` "fork" is for tests of a fake engine only (no interpreter start-up):
        a forked child would inherit an OpenMP runtime already started and the server's
        open sockets and pipe ends."""
        import torch

        # NOTE: this process runs no model; its cores belong to the child's OpenMP team.
        torch.set_num_threads(1)
        ctx = multiprocessing.get_context(start_method)
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=run_engine_core, args=(theirs, factory, policy, setup),
                              name="pagoda-engine-core", daemon=True)
        process.start()
        theirs.close()  # NOTE: else the child's death would never read as EOF here
        # NOTE: the child ignores SIGTERM, so multiprocessing's exit hook (terminate, then
        # join) would wait forever for one that shutdown() never stopped; closing our end
        # first (atexit runs the later registration first) makes it see EOF and stop.
        atexit.register(ours.close)
        try:
            message = ours.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the engine-core process exited with code {process.exitcode} "
                               "before it was ready (see its log above)") from None
        if message[0] == "failed":
            process.join()
            raise message[1]
        _, info, stats = message
        return cls(process, ours, info, stats, max_queued_requests)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def start(self) -> None:
        """Starts reading the core's messages on the running event loop."""
        self._loop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        self._loop.add_reader(fd, self._on_readable)
        # NOTE: uvloop's add_reader (libuv's uv_poll_init) makes the fd non-blocking, and
        # Connection assumes a blocking one: a message that arrives in parts (larger than
        # the socket's buffer) then reads EAGAIN halfway, and a large command's send fails
        # halfway, either of which read as the core's death. Blocking, a readable pipe's
        # recv waits only for the rest of a message the core is writing.
        os.set_blocking(fd, True)
        self._reading = True

    async def shutdown(self) -> None:
        """Stops the core (it aborts whatever still runs) and reaps the child."""
        self._stopping = True
        if self._dead is None:
            self._send(StopCommand())
        await asyncio.to_thread(self.process.join, _STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %g s; killing it", _STOP_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self._stop_reading()
        self._conn.close()
        if self._dead is None:
            self._dead = EngineDeadError("the engine core has stopped")
        self._fail_everything(self._dead)

    def _send(self, command: Any) -> None:
        if self._dead is not None:
            return
        try:
            self._conn.send(command)
        except (OSError, ValueError) as e:  # NOTE: the child is gone; its EOF says so too.
            self._core_died(f"the engine core cannot be reached: {e}")

    def _on_readable(self) -> None:
        try:
            events = self._conn.recv()
        except (EOFError, OSError):
            if self._stopping:
                self._stop_reading()
            else:
                self._core_died(f"the engine-core process exited (code {self._exit_code()})")
            return
        self._apply(events)

    def _apply(self, events: list[tuple[Any, ...]]) -> None:
        # NOTE: first, so that the metrics events, which share these outputs (one pickle),
        # see the prompts too.
        for event in events:
            if event[0] == "deliver":
                restore_prompts(event[1], self._prompts)
        for event in events:
            kind = event[0]
            if kind == "metric":
                if self.metrics is not None and event[1] in FORWARDED_METRICS:
                    getattr(self.metrics, event[1])(*event[2])
            elif kind == "deliver":
                self._dispatch(event[1])
            elif kind == "reply":
                self._settle(*event[1:])
            elif kind == "stats":
                self._set_stats(event[1], event[2])
            elif kind == "died":
                self._core_died(f"engine core died: {event[1]}")

    def _core_died(self, message: str) -> None:
        if self._dead is None:
            logger.error("%s", message)
            self._dead = EngineDeadError(message)
        if self.process.is_alive():
            # NOTE: a core this end can no longer reach (a broken pipe, a garbled message)
            # would step on unwatched, and shutdown() would wait its whole stop timeout.
            self.process.kill()
        self._stop_reading()
        self._fail_everything(self._dead)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._conn.fileno())

    def _exit_code(self) -> int | None:
        # NOTE: the pipe closes as the child exits; a short wait usually reaps it.
        self.process.join(timeout=0.1)
        return self.process.exitcode
