"""The engine's side of serving: one loop that owns an LLMEngine, applies commands between
steps, steps it, and hands every result to a `CoreSink`.

The loop runs on the server's engine thread (async_engine.AsyncLLMEngine) or, with
`--engine-process`, on the main thread of an engine-core process (core_process.py); the
commands and the sink's events are the same in both, and cross the process boundary as
pickles. Commands are applied between steps, so an abort frees its KV blocks before the
next step. A step that raises fails the requests it was running with EngineFaultError
(their blocks are freed) and the loop goes on. Adding is all or nothing: a request the
engine refuses leaves nothing behind. The loop sleeps on a Condition when it has neither
commands nor unfinished requests (no busy spin).

A burst of requests that finds the engine idle is gathered into one first step: an add
says how many other requests the front end had received and not yet sent
(`AddCommand.more_coming`), and the idle loop waits for them, at most `gather_s`
(`PAGODA_BURST_GATHER_MS`, default 20 ms; 0: off), before it steps. Without this the
first request of a burst took a step alone, and the rest waited for it (measured in
docs/architecture.md). A request that comes alone, or to a busy engine, waits for nothing.

A decode burst (the running requests' several decode steps in one call) would hold a command for
the whole burst: an add or an abort raises the engine's `burst_interrupt` flag as it is
queued, the burst ends after its current decode step, and the loop lowers the flag as it
takes its commands (worker/burst_interrupt.py).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.core.request import DEFAULT_SLA_CLASS
from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.core_rpcs import RPCS, all_request_ids
from pagoda.engine.deadlines import DeadlineTracker, request_stage
from pagoda.engine.gc_heap import frozen_heap
from pagoda.engine.metrics import queue_snapshot
from pagoda.engine.output_processor import OutputKind
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Item = RequestOutput | BaseException


class EngineFaultError(RuntimeError):
    """An engine step failed while this request was running; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread (or engine-core process) has stopped; no request can be served."""


class EngineShutdownError(RuntimeError):
    """The server's shutdown grace ran out before this request finished; it was aborted."""


@dataclass(slots=True)
class EngineRequest:
    """One prompt for the engine (an HTTP request with several prompts makes several)."""

    request_id: str
    prompt: Any  # llm_engine.PromptType
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    sla_class: str = DEFAULT_SLA_CLASS


# ---- commands (front end -> core); `token` names the reply the front end awaits ----------
@dataclass(slots=True)
class AddCommand:
    requests: list[EngineRequest]
    arrival_time: float
    token: int
    # Requests the front end had received but not yet sent when it sent this one.
    more_coming: int = 0


@dataclass(slots=True)
class AbortCommand:
    request_ids: list[str]


@dataclass(slots=True)
class AbortAllCommand:
    pass


@dataclass(slots=True)
class RpcCommand:
    """A named query the core answers (core_rpcs.RPCS), picklable unlike a callable."""

    name: str
    token: int
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CallCommand:
    """Runs `fn(engine)`; in-thread only (tests and tools; a callable stays in-process)."""

    fn: Callable[[Any], Any]
    token: int


@dataclass(slots=True)
class FaultCommand:
    """Test hook: the next `num_steps` steps raise as if the model had failed."""

    num_steps: int


# The commands that change what runs: each ends a decode burst under way.
_INTERRUPTING = (AddCommand, AbortCommand, AbortAllCommand)


class CoreSink(Protocol):
    """Where the core's results go. Called on the core's thread only."""

    def deliver(self, items: list[tuple[str, Item]]) -> None:
        """Outputs (or a request's EngineFaultError) for the request ids' streams."""

    def reply(self, token: int, result: Any, exc: BaseException | None) -> None:
        """The answer to the command that carried `token`."""

    def publish_stats(self, stats: SchedulerStats, added_through: int) -> None:
        """The scheduler's numbers after a loop iteration or an add; they count every
        AddCommand up to the token `added_through` (-1: none yet)."""

    def flush(self) -> None:
        """Hands over what was buffered (a no-op where nothing is)."""

    def died(self, exc: BaseException) -> None:
        """The loop failed outside a step (a bug); it has stopped."""


class EngineCore:
    """The step loop over `engine` (see the module docstring); `metrics` is anything with
    EngineMetrics' `observe_*` engine-side methods, `deadlines` a DeadlineTracker."""

    def __init__(self, engine: Any, sink: CoreSink, metrics: Any = None,
                 deadlines: DeadlineTracker | None = None,
                 gather_s: float | None = None) -> None:
        self.engine = engine
        self.gather_s = burst_gather_s() if gather_s is None else gather_s
        self.sink = sink
        self.metrics = metrics
        self.deadlines = deadlines
        self._fault_steps = 0
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._stopping = False
        self._added_through = -1  # the token of the last AddCommand applied
        self._interrupt = getattr(engine, "burst_interrupt", None)

    def send(self, command: Any) -> None:
        """Queues a command for the loop; any thread."""
        with self._cond:
            self._commands.append(command)
            if isinstance(command, _INTERRUPTING) and self._interrupt is not None:
                self._interrupt.set()
            self._cond.notify()

    def stop(self) -> None:
        """Has the loop abort everything and return; any thread."""
        with self._cond:
            self._stopping = True
            if self._interrupt is not None:
                self._interrupt.set()
            self._cond.notify()

    def _take_commands(self) -> tuple[list[Any], bool]:
        """The queued commands and whether the loop stops; with `_cond` held. The burst
        flag goes down with them: only a command queued after this raises it again."""
        if self._interrupt is not None:
            self._interrupt.clear()
        commands = list(self._commands)
        self._commands.clear()
        return commands, self._stopping

    def run(self) -> None:
        """The loop; returns after `stop()`, or after `sink.died` on a bug outside a step."""
        with frozen_heap():
            self._run()

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands, stopping = self._wait_for_work()
                more = self._apply_all(commands)
                if idle and more and not stopping:
                    stopping = self._gather(more)
                if stopping:
                    self._abort_everything()
                    self.sink.flush()
                    return
                # NOTE: replies (an add's acceptance) go out before a step that may be long.
                self.sink.flush()
                self._expire_deadlines()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
                self.sink.flush()
        except BaseException as e:  # NOTE: a bug outside step(): fail loudly, not silently.
            logger.exception("engine loop died")
            self.sink.died(e)

    def _wait_for_work(self) -> tuple[list[Any], bool]:
        with self._cond:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            return self._take_commands()

    def _apply_all(self, commands: list[Any]) -> int | None:
        """Applies `commands`; the last add's `more_coming` (None without an add)."""
        more = None
        for command in commands:
            self._apply(command)
            if isinstance(command, AddCommand):
                more = command.more_coming
        return more

    def _gather(self, more: int) -> bool:
        """Applies the commands that arrive within `gather_s` while adds still announce
        `more` requests to come; returns whether the loop is stopping."""
        deadline = time.monotonic() + self.gather_s
        while more > 0:
            with self._cond:
                while not (self._commands or self._stopping):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                commands, stopping = self._take_commands()
            last = self._apply_all(commands)
            if stopping:
                return True
            if last is not None:
                more = last
        return False

    def _apply(self, command: Any) -> None:
        if isinstance(command, AddCommand):
            self._added_through = command.token
            self.sink.reply(command.token, None, self._add(command))
        elif isinstance(command, AbortCommand):
            self._deliver(self.engine.abort_request(command.request_ids))
        elif isinstance(command, AbortAllCommand):
            self._abort_everything()
        elif isinstance(command, FaultCommand):
            self._fault_steps = command.num_steps
        elif isinstance(command, (RpcCommand, CallCommand)):
            try:
                if isinstance(command, RpcCommand):
                    result = RPCS[command.name](self.engine, **command.kwargs)
                else:
                    result = command.fn(self.engine)
            except Exception as e:  # noqa: BLE001 - handed to the caller, who re-raises it
                self.sink.reply(command.token, None, e)
            else:
                self.sink.reply(command.token, result, None)
        else:
            raise TypeError(f"unknown engine command {type(command).__name__}")

    def _add(self, command: AddCommand) -> BaseException | None:
        tried: list[str] = []
        try:
            for r in command.requests:
                tried.append(r.request_id)
                self.engine.add_request(
                    r.request_id, r.prompt, r.params, arrival_time=command.arrival_time,
                    priority=r.priority, output_kind=OutputKind.DELTA, cache_salt=r.cache_salt,
                    sla_class=r.sla_class,
                )
                if self.deadlines is not None:
                    self.deadlines.add(r.request_id, r.sla_class, command.arrival_time)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who re-raises it
            # NOTE: all or nothing: a batch with one invalid prompt adds none of them, and
            # the refused one itself is aborted too, in case the engine refused it halfway
            # (an out-of-range seed once failed after the request was registered). The
            # ids are this engine's own (generate refuses one in use), so none is another's.
            self.engine.abort_request(tried)
            for rid in tried if self.deadlines is not None else ():
                self.deadlines.discard(rid)
            return e
        finally:
            self._publish_stats()
        return None

    def _step(self) -> None:
        try:
            if self._fault_steps > 0:
                self._fault_steps -= 1
                raise RuntimeError("injected engine fault (test hook)")
            start = time.perf_counter()
            outputs = self.engine.step()
            if self.metrics is not None:
                self.metrics.observe_step(time.perf_counter() - start)
        except Exception as e:
            logger.exception("engine step failed; aborting the requests it was running")
            self._fail_running(e)
            return
        self._deliver(outputs)

    def _fail_running(self, exc: Exception) -> None:
        # NOTE: a step that failed inside LLMEngine.step was rolled back: its requests wait.
        ids = (self.engine.failed_request_ids or _running_request_ids(self.engine)
               or all_request_ids(self.engine))
        error = EngineFaultError(f"engine step failed: {type(exc).__name__}: {exc}")
        for rid in ids if self.deadlines is not None else ():
            self.deadlines.discard(rid)
        for out in self.engine.abort_request(ids):
            if self.metrics is not None:
                num = sum(1 for c in out.outputs if c.finish_reason == "abort")
                self.metrics.observe_error(out.request_id, num)
        self.sink.deliver([(rid, error) for rid in ids])

    def _expire_deadlines(self) -> None:
        """Aborts the requests past their deadline (finish_reason "timeout", KV freed)."""
        if not self.deadlines:
            return
        expired = self.deadlines.expired(time.monotonic(),
                                         lambda rid: request_stage(self.engine, rid))
        if not expired:
            return
        outputs = self.engine.abort_request([e.request_id for e in expired], reason="timeout")
        if self.metrics is not None:
            for e in expired:
                self.metrics.observe_timeout(e.sla_class, e.stage)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        if self.deadlines is not None:
            for out in outputs:
                if out.finished:
                    self.deadlines.discard(out.request_id)
        if self.metrics is not None:
            self.metrics.observe_outputs(outputs, time.monotonic())
        self.sink.deliver([(out.request_id, out) for out in outputs])

    def _abort_everything(self) -> None:
        self._deliver(self.engine.abort_request(all_request_ids(self.engine)))
        self._publish_stats()

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        self.sink.publish_stats(stats, self._added_through)
        if self.metrics is not None:
            self.metrics.observe_stats(stats)
            self.metrics.observe_queues(queue_snapshot(self.engine.scheduler))


def burst_gather_s() -> float:
    """`PAGODA_BURST_GATHER_MS` in seconds (default 20 ms); ValueError naming it if bad."""
    text = os.environ.get("PAGODA_BURST_GATHER_MS", "20").strip() or "20"
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"PAGODA_BURST_GATHER_MS={text!r}: expected milliseconds") from None
    if not 0 <= ms <= 1000:
        raise ValueError(f"PAGODA_BURST_GATHER_MS={text!r}: expected 0 to 1000 ms")
    return ms / 1e3


def _running_request_ids(engine: Any) -> list[str]:
    """Parent ids of the requests the scheduler is running (those a failed step touched).

    NOTE: reads engine internals (scheduler.running, output_processor.child_to_parent);
    an `LLMEngine.running_request_ids()` hook would keep this knowledge in the engine.
    """
    parents = engine.output_processor.child_to_parent
    ids = dict.fromkeys(parents[r.req_id][0] for r in engine.scheduler.running
                        if r.req_id in parents)
    return list(ids)
