"""One thread that owns a worker, for async scheduling: the engine hands it steps and goes
on (scheduling the next step, committing and detokenizing the last) while a step runs.

Steps run one at a time, in submission order; that order is what lets the scheduler's
block accounting run ahead of the forward (core/scheduler.py). Everything that touches
the worker's tensors goes through this thread, start-up included (the model is built
here): libgomp throttles its spin-waiting once more threads have run OpenMP regions than
there are CPUs, so the process keeps one OpenMP team, this thread's.

A step that raises cancels the steps queued behind it, and any submitted after it, until
the engine, having seen the failure, calls `cancel_pending()` (they would run on a state
the failure left half-updated). `cancel_pending()` also cancels the steps not started yet
after a failure the engine saw first (Ctrl-C while waiting): the step running then
finishes in the background, and steps submitted afterwards run after it.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class StepCancelledError(RuntimeError):
    """A step queued behind a failed one (or cancelled by the engine) did not run."""


@dataclass(slots=True)
class _Item:
    fn: Callable[..., Any]
    args: tuple
    future: Future
    epoch: int | None  # None: not a step (a start-up call), never cancelled


class _Epochs:
    """What the engine and the thread share (not the StepThread: the thread must not keep
    it alive). Steps of an epoch below `floor`, or of the epoch in which a step failed,
    are cancelled."""

    def __init__(self) -> None:
        self.current = 0
        self.floor = 0
        self.failed: int | None = None


class StepThread:
    def __init__(self, name: str = "pagoda-worker") -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._epochs = _Epochs()
        self._thread = threading.Thread(target=_serve, args=(self._queue, self._epochs),
                                        name=name, daemon=True)
        self._thread.start()
        # NOTE: the thread ends when its owner is dropped (an engine per test, in tests).
        self._finalizer = weakref.finalize(self, self._queue.put, None)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the thread and return its result (or raise its exception)."""
        future: Future = Future()
        self._queue.put(_Item(fn, args, future, None))
        return future.result()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """Queue one step, `fn(*args)`; its future raises StepCancelledError if it was
        cancelled (see the module docstring)."""
        future: Future = Future()
        self._queue.put(_Item(fn, args, future, self._epochs.current))
        return future

    def cancel_pending(self) -> None:
        """Cancel every step submitted so far that has not started; steps submitted from
        now on run (also after a failed step)."""
        e = self._epochs
        e.current += 1
        e.floor = e.current

    def shutdown(self) -> None:
        """Stop the thread once the queued work is done."""
        self._finalizer()


def _serve(work: queue.SimpleQueue, epochs: _Epochs) -> None:
    while (item := work.get()) is not None:
        _run(item, epochs)
        del item  # NOTE: hold nothing of a finished step while waiting for the next one


def _run(item: _Item, epochs: _Epochs) -> None:
    if item.epoch is not None and (item.epoch < epochs.floor or item.epoch == epochs.failed):
        item.future.set_exception(StepCancelledError("a step before this one failed"))
        return
    try:
        result = item.fn(*item.args)
    except BaseException as e:  # noqa: BLE001 - handed to the engine (Ctrl-C included)
        if item.epoch is not None:
            epochs.failed = item.epoch
        item.future.set_exception(e)
        return
    item.future.set_result(result)
