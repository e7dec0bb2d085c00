"""The engine-core process (`--engine-process`): its main, and the sink that sends the
step loop's events to the API process over a multiprocessing Connection.

Wire protocol (every message a pickle; core_client.py is the other end):

| direction  | message                                                                    |
|------------|----------------------------------------------------------------------------|
| API -> core| an engine_core command, or `StopCommand`                                   |
| core -> API| once: `("ready", CoreInfo, SchedulerStats)` or `("failed", exception)`     |
| core -> API| then batches: a list of events, in the order the loop made them:           |
|            | `("metric", observe_method_name, args)`, `("deliver", items)`,             |
|            | `("reply", token, result, exc)`, `("died", message)`,                      |
|            | `("stats", SchedulerStats, added_through)`: the last add token they count  |

A request's prompt (text and token ids) crosses once, with its first output; later outputs
carry None there and the API process puts its copy back (`elide_prompts` /
`restore_prompts`): every DELTA output repeats the whole prompt, which at 32 requests of
~1,000 tokens is 32,000 ints to pickle and unpickle per step, on the cores the forward
needs.

The core sends at most two batches per loop iteration (replies before the step, then the
step's outputs), so a step's outputs cost one pickle and one pipe write. Metrics are
observed in the API process (its registry serves /metrics): the core records the calls
it would have made (`MetricsRecorder`) and they are replayed there, before the outputs
they came with are dispatched.

The core ends when told to stop, when the API process's end of the pipe closes (the
server died: no orphan is left running), or on a bug in its loop (`died`). It ignores
SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and so does a service
manager's SIGTERM; the server's graceful shutdown, not an interrupted step or a core
gone before the grace ends, decides what happens to running requests.
"""

from __future__ import annotations

import faulthandler
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.deadlines import DeadlineTracker, TimeoutPolicy
from pagoda.engine.engine_core import EngineCore, Item
from pagoda.outputs import RequestOutput

logger = logging.getLogger(__name__)

# EngineMetrics' engine-side methods, the ones EngineCore calls.
FORWARDED_METRICS = frozenset({"observe_outputs", "observe_error", "observe_stats",
                               "observe_queues", "observe_step", "observe_timeout"})


@dataclass(slots=True)
class StopCommand:
    """Abort everything, send the aborts' outputs, and exit."""


@dataclass(slots=True)
class CoreInfo:
    """The read-only facts about the engine that the API process needs (the attribute
    names are LLMEngine's, so the server reads either alike)."""

    tokenizer: Any
    model_path: str
    max_model_len: int
    vocab_size: int
    device: Any  # torch.device


class PipeSink:
    """Buffers the core's events and sends each batch as one message on `flush`."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.events: list[tuple[Any, ...]] = []
        self.prompt_sent: set[str] = set()  # requests whose prompt ids went already

    def deliver(self, items: list[tuple[str, Item]]) -> None:
        elide_prompts(items, self.prompt_sent)
        self.events.append(("deliver", items))

    def reply(self, token: int, result: Any, exc: BaseException | None) -> None:
        self.events.append(("reply", token, result, None if exc is None else _picklable(exc)))

    def publish_stats(self, stats: SchedulerStats, added_through: int) -> None:
        self.events.append(("stats", stats, added_through))

    def flush(self) -> None:
        if self.events:
            events, self.events = self.events, []
            try:
                self.conn.send(events)
            except (BrokenPipeError, ConnectionResetError):
                # NOTE: the API process is gone (killed mid-step): nobody is left to tell,
                # and the reader thread, seeing the pipe's EOF, stops the loop. Not a bug
                # of the loop, which an exception here would have logged it as.
                pass

    def died(self, exc: BaseException) -> None:
        self.events.append(("died", f"{type(exc).__name__}: {exc}"))
        try:
            self.flush()
        except OSError:
            pass  # NOTE: the API process is gone too; nobody is left to tell.


class MetricsRecorder:
    """Stands in for EngineMetrics in the core: each forwarded observe_* call becomes an
    event, replayed on the API process's EngineMetrics."""

    def __init__(self, events_of: PipeSink) -> None:
        self._sink = events_of

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in FORWARDED_METRICS:
            raise AttributeError(name)
        return lambda *args: self._sink.events.append(("metric", name, args))


def run_engine_core(conn: Connection, factory: Callable[[], Any],
                    policy: TimeoutPolicy | None, setup: Callable[[], None] | None = None) -> None:
    """The engine-core process's main: builds the engine with `factory()` (an LLMEngine:
    the model loads here), says ready (or why it failed), then runs the step loop until
    stopped. `setup()` runs first (the server's logging)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # NOTE: a crash in a kernel then leaves the threads' Python stacks in the server's log.
    faulthandler.enable()
    if setup is not None:
        setup()
    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001 - re-raised in the API process
        conn.send(("failed", _picklable(e)))
        return
    info = CoreInfo(engine.tokenizer, engine.model_path, engine.max_model_len,
                    engine.vocab_size, engine.device)
    conn.send(("ready", info, engine.get_stats()))
    sink = PipeSink(conn)
    deadlines = DeadlineTracker(policy) if policy is not None and policy.enabled else None
    core = EngineCore(engine, sink, MetricsRecorder(sink), deadlines)
    threading.Thread(target=_read_commands, args=(conn, core), name="pagoda-core-reader",
                     daemon=True).start()
    core.run()


def _read_commands(conn: Connection, core: EngineCore) -> None:
    """Feeds the API process's commands to the loop; stops it when the pipe closes."""
    try:
        while True:
            command = conn.recv()
            if isinstance(command, StopCommand):
                break
            core.send(command)
    except (EOFError, OSError):
        logger.warning("the API process closed the pipe; the engine core stops")
    core.stop()


def elide_prompts(items: list[tuple[str, Item]], sent: set[str]) -> None:
    """Drops the prompt (text and ids) of every output but a request's first (core side;
    the outputs are the core's to change: fresh per step, sent, then dropped)."""
    for rid, item in items:
        if isinstance(item, RequestOutput):
            if rid in sent:
                item.prompt, item.prompt_token_ids = None, None  # type: ignore[assignment]
            else:
                sent.add(rid)
        if isinstance(item, BaseException) or item.finished:
            sent.discard(rid)


def restore_prompts(items: list[tuple[str, Item]],
                    prompts: dict[str, tuple[str | None, list[int]]]) -> None:
    """Puts back the prompts `elide_prompts` dropped (API side), keeping each request's
    until its last output."""
    for rid, item in items:
        if isinstance(item, RequestOutput):
            if item.prompt_token_ids is None:
                item.prompt, item.prompt_token_ids = prompts[rid]
            else:
                prompts[rid] = item.prompt, item.prompt_token_ids
        if isinstance(item, BaseException) or item.finished:
            prompts.pop(rid, None)


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure means: send the text instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")
