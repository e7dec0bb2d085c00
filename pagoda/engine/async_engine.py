"""The asyncio front end of the synchronous engine, for the HTTP server.

One background thread owns the LLMEngine exclusively and runs its step loop (torch
releases the GIL inside its ops, so the event loop stays responsive). Nothing else touches
the engine:

```
event loop --commands (add / abort / call / stop), a deque under a Condition--> engine thread
engine thread --one loop.call_soon_threadsafe per step--> event loop -> OutputStream queues
```

The engine thread sleeps on the Condition when it has neither commands nor unfinished
requests (no busy spin). Commands are applied between steps, so an abort frees its KV
blocks before the next step. A step that raises fails the requests it was running with
EngineFaultError (their blocks are freed) and the loop goes on; the server stays up.
Adding is all or nothing: a request the engine refuses leaves nothing behind, and
`orphan_request_ids` finds any request the engine holds that no stream waits for.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.core.request import DEFAULT_SLA_CLASS
from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.deadlines import DeadlineTracker, request_stage
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.metrics import EngineMetrics, queue_snapshot
from pagoda.engine.output_processor import OutputKind
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
_Item = RequestOutput | BaseException


class EngineFaultError(RuntimeError):
    """An engine step failed while this request was running; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineShutdownError(RuntimeError):
    """The server's shutdown grace ran out before this request finished; it was aborted."""


class QueueFullError(RuntimeError):
    """More requests wait than `max_queued_requests` allows; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class EngineRequest:
    """One prompt for the engine (an HTTP request with several prompts makes several)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    sla_class: str = DEFAULT_SLA_CLASS


class OutputStream:
    """The DELTA outputs of a group of engine requests, in the order the engine made them.

    Iterating yields RequestOutputs until every request of the group has finished; it
    raises EngineFaultError / EngineDeadError if the engine failed one of them. Lives on
    the event loop; the engine thread reaches it only through `call_soon_threadsafe`.
    """

    def __init__(self, request_ids: Iterable[str]) -> None:
        self.request_ids = list(request_ids)
        self._open = set(self.request_ids)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        # Sees every output as it is handed out (the HTTP layer's request record).
        self.observer: Callable[[RequestOutput], None] | None = None

    @property
    def finished(self) -> bool:
        return not self._open

    @property
    def unfinished_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid in self._open]

    def _put(self, request_id: str, item: _Item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        if self.observer is not None:
            self.observer(item)
        return item


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    arrival_time: float
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _AbortAll:
    pass


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


class AsyncLLMEngine:
    """Serves concurrent asyncio callers from one engine thread (see the module docstring)."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.engine = engine  # NOTE: for read-only facts (tokenizer, max_model_len) only.
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        # NOTE: written on the event loop, read on the engine thread by orphan_request_ids.
        self._streams_lock = threading.Lock()
        self._draining: EngineShutdownError | None = None  # set by end_grace()
        self._futures: set[asyncio.Future] = set()  # answers the engine thread still owes
        self._num_pending = 0  # sequences sent to the engine thread, not yet added
        self._stats: SchedulerStats = engine.get_stats()
        self._dead: BaseException | None = None
        self._fault_steps = 0  # test hook: this many next steps raise
        # Request timeouts (engine/deadlines.py); set before start(), engine thread only.
        self.deadlines: DeadlineTracker | None = None
        self._started = threading.Event()  # set by start(): the event loop is attached

    @classmethod
    def build(
        cls,
        factory: Callable[[], LLMEngine],
        metrics: EngineMetrics | None = None,
        max_queued_requests: int | None = None,
    ) -> AsyncLLMEngine:
        """Creates the engine with `factory()` on the engine thread itself, which then
        waits for `start()`; re-raises whatever the factory raised.

        NOTE: libgomp throttles its spin-waiting once more threads have run OpenMP regions
        than there are CPUs. If the main thread loaded the model (leaving an OpenMP team of
        its own) and another thread then ran it, every parallel region of every step would
        pay a futex wake-up: single-request decode was 1.8x slower on this 2-core machine.
        Built here, the process keeps one OpenMP team, the engine thread's.
        """
        ready = threading.Event()
        built: dict[str, Any] = {}

        def main() -> None:
            try:
                built["engine"] = engine = cls(factory(), metrics, max_queued_requests)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                built["error"] = e
                return
            finally:
                ready.set()
            engine._started.wait()
            engine._run()

        thread = threading.Thread(target=main, name="pagoda-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            thread.join()
            raise built["error"]
        engine = built["engine"]
        engine._thread = thread
        return engine

    # ---- event loop side ---------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
            self._thread.start()
        self._started.set()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's numbers as of the end of the engine thread's last iteration."""
        return self._stats

    async def generate(
        self, requests: list[EngineRequest], arrival_time: float | None = None
    ) -> OutputStream:
        """Adds all `requests` (or none) and returns their output stream.

        Raises ValueError from the engine's validation, QueueFullError, EngineDeadError.
        Returns once the engine thread has accepted them (at most one step later).
        """
        if self._draining is not None:
            raise self._draining
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        num_seqs = sum(r.params.n for r in requests)
        limit = self.max_queued_requests
        if limit is not None and self._stats.num_waiting + self._num_pending >= limit:
            raise QueueFullError(
                f"the waiting queue is full ({limit} requests); retry later"
            )
        stream = OutputStream(r.request_id for r in requests)
        ids = stream.request_ids
        if len(set(ids)) < len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError("request id is already in use")
        with self._streams_lock:
            for rid in ids:
                self._streams[rid] = stream
        future = self._new_future()
        self._num_pending += num_seqs
        self._send(_Add(requests, arrival_time or time.monotonic(), future))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(stream.request_ids)
            raise
        except BaseException:
            with self._streams_lock:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)
            raise
        finally:
            self._num_pending -= num_seqs
            self._futures.discard(future)
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); returns at once."""
        ids = list(request_ids)
        if ids:
            self._send(_Abort(ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between two steps; returns its result."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future = self._new_future()
        self._send(_Call(fn, future))
        try:
            return await future
        finally:
            self._futures.discard(future)

    async def orphan_request_ids(self) -> list[str]:
        """Requests the engine holds that no OutputStream waits for (a leak: none may be).

        NOTE: exact, not racy: the engine removes a request before its last output is
        dispatched, and a stream is registered before its request is sent, so between two
        commands every engine request has a stream unless it leaked.
        """
        def orphans(engine: LLMEngine) -> list[str]:
            with self._streams_lock:
                return [rid for rid in _all_request_ids(engine) if rid not in self._streams]

        return await self.call(orphans)

    def end_grace(self, message: str) -> None:
        """Fails every request now (EngineShutdownError), in flight or being added, refuses
        new ones, and has the engine thread abort them all; for the end of a shutdown's
        grace period, so that each request gets an answer before the server stops."""
        self._draining = exc = EngineShutdownError(message)
        for stream in set(self._streams.values()):
            stream._put("", exc)
        for future in self._futures:
            if not future.done():
                future.set_exception(exc)
        self._send(_AbortAll())

    def inject_fault(self, num_steps: int = 1) -> None:
        """Test hook: the next `num_steps` engine steps raise as if the model had failed."""
        self._fault_steps = num_steps

    async def shutdown(self) -> None:
        """Aborts whatever is still running and stops the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _new_future(self) -> asyncio.Future:
        future = self._loop.create_future()
        self._futures.add(future)
        return future

    def _send(self, command: Any) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _dispatch(self, items: list[tuple[str, _Item]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            stream._put(rid, item)
            if isinstance(item, BaseException) or item.finished:
                with self._streams_lock:
                    del self._streams[rid]

    def _fail_everything(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream._put(rid, exc)
        with self._streams_lock:
            self._streams.clear()
        for future in self._futures:
            if not future.done():
                future.set_exception(exc)

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands, stopping = self._wait_for_work()
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._abort_everything()
                    return
                self._expire_deadlines()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException as e:  # NOTE: a bug outside step(): fail loudly, not silently.
            logger.exception("engine thread died")
            self._dead = e
            self._to_loop(self._fail_everything, EngineDeadError(f"engine thread died: {e}"))

    def _wait_for_work(self) -> tuple[list[Any], bool]:
        with self._cond:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands, self._stopping

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._resolve(command.future, *self._add(command))
        elif isinstance(command, _Abort):
            outputs = self.engine.abort_request(command.request_ids)
            self._deliver(outputs)
        elif isinstance(command, _AbortAll):
            self._abort_everything()
        elif isinstance(command, _Call):
            try:
                self._resolve(command.future, command.fn(self.engine), None)
            except Exception as e:  # noqa: BLE001 - handed to the caller, who re-raises it
                self._resolve(command.future, None, e)

    def _add(self, command: _Add) -> tuple[None, BaseException | None]:
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
            return None, e
        finally:
            self._publish_stats()
        return None, None

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
               or _all_request_ids(self.engine))
        error = EngineFaultError(f"engine step failed: {type(exc).__name__}: {exc}")
        for rid in ids if self.deadlines is not None else ():
            self.deadlines.discard(rid)
        for out in self.engine.abort_request(ids):
            if self.metrics is not None:
                num = sum(1 for c in out.outputs if c.finish_reason == "abort")
                self.metrics.observe_error(out.request_id, num)
        items: list[tuple[str, _Item]] = [(rid, error) for rid in ids]
        self._to_loop(self._dispatch, items)

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
        self._to_loop(self._dispatch, [(out.request_id, out) for out in outputs])

    def _abort_everything(self) -> None:
        self._deliver(self.engine.abort_request(_all_request_ids(self.engine)))
        self._publish_stats()

    def _publish_stats(self) -> None:
        self._stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.observe_stats(self._stats)
            self.metrics.observe_queues(queue_snapshot(self.engine.scheduler))

    def _resolve(self, future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        def settle() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._to_loop(settle)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # NOTE: the loop is closed: the server is gone and nobody is listening.


def _all_request_ids(engine: LLMEngine) -> list[str]:
    return list(engine.output_processor.requests)


def _running_request_ids(engine: LLMEngine) -> list[str]:
    """Parent ids of the requests the scheduler is running (those a failed step touched).

    NOTE: reads engine internals (scheduler.running, output_processor.child_to_parent);
    an `LLMEngine.running_request_ids()` hook would keep this knowledge in the engine.
    """
    parents = engine.output_processor.child_to_parent
    ids = dict.fromkeys(parents[r.req_id][0] for r in engine.scheduler.running
                        if r.req_id in parents)
    return list(ids)
