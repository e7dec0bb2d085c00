"""The asyncio front end of the engine, for the HTTP server, in two implementations with
one interface (generate / abort / rpc / orphan_request_ids / stats / is_alive / end_grace /
inject_fault / start / shutdown):

- `AsyncLLMEngine`: the LLMEngine on one background thread of the server process (torch
  releases the GIL inside its ops, so the event loop stays responsive);
- `core_client.EngineCoreClient` (`--engine-process`): the LLMEngine in a child process.

Both drive the same step loop (engine_core.EngineCore) with the same commands; only the
transport differs:

```
event loop --commands (add / abort / rpc / fault / stop)--> EngineCore (thread or process)
EngineCore --outputs, replies, stats, per loop iteration--> event loop -> OutputStream queues
```

`EngineClient` is the event-loop half they share: streams, replies (futures named by an
int token), the waiting-queue limit, the shutdown grace. Adding is all or nothing, and
`orphan_request_ids` finds any request the engine holds that no stream waits for.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.engine_core import (
    AbortAllCommand,
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineCore,
    EngineDeadError,
    EngineFaultError,
    EngineRequest,
    EngineShutdownError,
    FaultCommand,
    Item,
    RpcCommand,
)
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.metrics import EngineMetrics
from pagoda.outputs import RequestOutput

__all__ = ["AsyncLLMEngine", "EngineClient", "EngineDeadError", "EngineFaultError",
           "EngineRequest", "EngineShutdownError", "OutputStream", "QueueFullError"]

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """More requests wait than `max_queued_requests` allows; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutputStream:
    """The DELTA outputs of a group of engine requests, in the order the engine made them.

    Iterating yields RequestOutputs until every request of the group has finished; it
    raises EngineFaultError / EngineDeadError if the engine failed one of them. Lives on
    the event loop; the engine reaches it only through the loop.
    """

    def __init__(self, request_ids: Iterable[str]) -> None:
        self.request_ids = list(request_ids)
        self._open = set(self.request_ids)
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        # Sees every output as it is handed out (the HTTP layer's request record).
        self.observer: Callable[[RequestOutput], None] | None = None

    @property
    def finished(self) -> bool:
        return not self._open

    @property
    def unfinished_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid in self._open]

    def _put(self, request_id: str, item: Item) -> None:
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


class EngineClient:
    """The event-loop half of the front end (see the module docstring). Subclasses give
    `_send(command)`, `is_alive`, `start()` and `shutdown()`; every other method runs on
    the event loop, and so do `_dispatch`, `_settle` and `_fail_everything`."""

    def __init__(self, stats: SchedulerStats, max_queued_requests: int | None = None) -> None:
        self.max_queued_requests = max_queued_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        self._draining: EngineShutdownError | None = None  # set by end_grace()
        self._futures: dict[int, asyncio.Future] = {}  # answers the engine still owes
        self._tokens = itertools.count()
        # NOTE: an add's sequences count against the queue limit until stats that include
        # it arrive (the add's token <= the stats' `added_through`), not until its reply is
        # awaited: stats and reply reach the loop apart, and a request in both the stats
        # and the pending count once refused the next one (a full queue one short).
        self._pending_adds: dict[int, int] = {}  # add token -> sequences
        self._published: tuple[SchedulerStats, int] = (stats, -1)  # stats, added_through
        self._dead: BaseException | None = None

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's numbers as of the end of the engine's last loop iteration."""
        return self._published[0]

    def _set_stats(self, stats: SchedulerStats, added_through: int) -> None:
        """New stats, which count every add up to the token `added_through`."""
        self._published = (stats, added_through)

    def _num_queued(self) -> int:
        """Sequences waiting in the engine, or sent to it and not yet in its stats."""
        stats, added_through = self._published
        for token in [t for t in self._pending_adds if t <= added_through]:
            del self._pending_adds[token]
        return stats.num_waiting + sum(self._pending_adds.values())

    def _send(self, command: Any) -> None:
        raise NotImplementedError

    async def generate(
        self, requests: list[EngineRequest], arrival_time: float | None = None,
        more_coming: int = 0,
    ) -> OutputStream:
        """Adds all `requests` (or none) and returns their output stream. `more_coming`:
        other requests received and not yet sent (an idle engine waits a little for them).

        Raises ValueError from the engine's validation, QueueFullError, EngineDeadError.
        Returns once the engine has accepted them (at most one step later).
        """
        if self._draining is not None:
            raise self._draining
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        num_seqs = sum(r.params.n for r in requests)
        limit = self.max_queued_requests
        if limit is not None and self._num_queued() >= limit:
            raise QueueFullError(
                f"the waiting queue is full ({limit} requests); retry later"
            )
        stream = OutputStream(r.request_id for r in requests)
        ids = stream.request_ids
        if len(set(ids)) < len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError("request id is already in use")
        for rid in ids:
            self._streams[rid] = stream
        try:
            await self._request(lambda token: AddCommand(
                requests, arrival_time or time.monotonic(), token, more_coming), num_seqs)
        except asyncio.CancelledError:
            self.abort(stream.request_ids)
            raise
        except BaseException:
            for rid in stream.request_ids:
                self._streams.pop(rid, None)
            raise
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); returns at once."""
        ids = list(request_ids)
        if ids:
            self._send(AbortCommand(ids))

    async def rpc(self, name: str, **kwargs: Any) -> Any:
        """The engine's answer to the named query (engine/core_rpcs.py), between two steps."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        return await self._request(lambda token: RpcCommand(name, token, kwargs))

    async def orphan_request_ids(self) -> list[str]:
        """Requests the engine holds that no OutputStream waits for (a leak: none may be).

        NOTE: exact, not racy: the engine removes a request before its last output is
        sent, outputs and replies arrive in the order the engine made them, and a stream
        is registered before its request is sent; so when the reply arrives, every id in
        it has a stream unless it leaked.
        """
        ids = await self.rpc("request_ids")
        return [rid for rid in ids if rid not in self._streams]

    def end_grace(self, message: str) -> None:
        """Fails every request now (EngineShutdownError), in flight or being added, refuses
        new ones, and has the engine abort them all; for the end of a shutdown's grace
        period, so that each request gets an answer before the server stops."""
        self._draining = exc = EngineShutdownError(message)
        for stream in set(self._streams.values()):
            stream._put("", exc)
        for future in self._futures.values():
            if not future.done():
                future.set_exception(exc)
        self._send(AbortAllCommand())

    def inject_fault(self, num_steps: int = 1) -> None:
        """Test hook: the next `num_steps` engine steps raise as if the model had failed."""
        self._send(FaultCommand(num_steps))

    async def _request(self, make: Callable[[int], Any], num_seqs: int = 0) -> Any:
        """Sends the command `make(token)` and awaits the engine's reply to it; an add
        says how many sequences it queues."""
        token = next(self._tokens)
        future = self._futures[token] = self._loop.create_future()
        if num_seqs:
            self._pending_adds[token] = num_seqs
        try:
            self._send(make(token))
            return await future
        finally:
            self._futures.pop(token, None)

    def _settle(self, token: int, result: Any, exc: BaseException | None) -> None:
        future = self._futures.get(token)
        if future is None or future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _dispatch(self, items: list[tuple[str, Item]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            stream._put(rid, item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[rid]

    def _fail_everything(self, exc: BaseException) -> None:
        self._pending_adds.clear()
        for rid, stream in list(self._streams.items()):
            stream._put(rid, exc)
        self._streams.clear()
        for future in self._futures.values():
            if not future.done():
                future.set_exception(exc)


class AsyncLLMEngine(EngineClient):
    """The engine on one thread of this process (see the module docstring); it is also
    the EngineCore's sink, handing each event to the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        super().__init__(engine.get_stats(), max_queued_requests)
        self.engine = engine  # NOTE: for read-only facts (tokenizer, max_model_len) only.
        self._core = EngineCore(engine, self, metrics)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()  # set by start(): the event loop is attached

    @property
    def metrics(self) -> EngineMetrics | None:
        return self._core.metrics

    @metrics.setter
    def metrics(self, value: EngineMetrics | None) -> None:
        self._core.metrics = value

    @property
    def deadlines(self) -> Any:
        """Request timeouts (engine/deadlines.py); set before start()."""
        return self._core.deadlines

    @deadlines.setter
    def deadlines(self, value: Any) -> None:
        self._core.deadlines = value

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
            engine._core.run()

        thread = threading.Thread(target=main, name="pagoda-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            thread.join()
            raise built["error"]
        engine = built["engine"]
        engine._thread = thread
        return engine

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._core.run, name="pagoda-engine",
                                            daemon=True)
            self._thread.start()
        self._started.set()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between two steps; returns its result.
        In-process only (tests, tools): the server's queries are the named `rpc`s."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        return await self._request(lambda token: CallCommand(fn, token))

    async def shutdown(self) -> None:
        """Aborts whatever is still running and stops the engine thread."""
        self._core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _send(self, command: Any) -> None:
        self._core.send(command)

    # ---- CoreSink: called on the engine thread -----------------------------------------
    def deliver(self, items: list[tuple[str, Item]]) -> None:
        self._to_loop(self._dispatch, items)

    def reply(self, token: int, result: Any, exc: BaseException | None) -> None:
        self._to_loop(self._settle, token, result, exc)

    def publish_stats(self, stats: SchedulerStats, added_through: int) -> None:
        self._set_stats(stats, added_through)

    def flush(self) -> None:
        pass  # NOTE: every event went to the loop as it came.

    def died(self, exc: BaseException) -> None:
        self._dead = exc
        self._to_loop(self._fail_everything, EngineDeadError(f"engine thread died: {exc}"))

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # NOTE: the loop is closed: the server is gone and nobody is listening.
