"""StepThread: steps run in order on its one thread; a failed step cancels the steps
behind it until the engine's cancel_pending(), which also cancels steps not started;
start-up calls are never cancelled; the thread ends when its owner is dropped."""

from __future__ import annotations

import gc
import threading

import pytest

from pagoda.worker.step_thread import StepCancelledError, StepThread


def fail() -> None:
    raise RuntimeError("boom")


def test_steps_run_in_order_on_the_thread() -> None:
    thread = StepThread()
    seen = []

    def step(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i

    futures = [thread.submit(step, i) for i in range(6)]
    assert [f.result() for f in futures] == list(range(6))
    assert seen == [(i, "pagoda-worker") for i in range(6)]


def test_a_failed_step_cancels_the_steps_behind_it_until_cancel_pending() -> None:
    thread = StepThread()
    gate = threading.Event()
    first = thread.submit(gate.wait)
    failing = thread.submit(fail)
    queued = thread.submit(lambda: "ran")
    gate.set()
    assert first.result() is True
    with pytest.raises(RuntimeError, match="boom"):
        failing.result()
    with pytest.raises(StepCancelledError):
        queued.result()
    with pytest.raises(StepCancelledError):
        thread.submit(lambda: "late").result()
    thread.cancel_pending()
    assert thread.submit(lambda: "after").result() == "after"


def test_cancel_pending_skips_the_steps_not_started() -> None:
    thread = StepThread()
    started, gate = threading.Event(), threading.Event()

    def running() -> str:
        started.set()
        gate.wait()
        return "done"

    first = thread.submit(running)
    queued = thread.submit(lambda: "ran")
    started.wait()
    thread.cancel_pending()
    after = thread.submit(lambda: "after")
    gate.set()
    assert first.result() == "done"
    with pytest.raises(StepCancelledError):
        queued.result()
    assert after.result() == "after"


def test_calls_raise_are_never_cancelled_and_the_thread_ends_with_its_owner() -> None:
    thread = StepThread()
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    with pytest.raises(RuntimeError):
        thread.submit(fail).result()
    assert thread.call(lambda: 3) == 3
    inner = thread._thread
    del thread
    gc.collect()
    inner.join(timeout=60)
    assert not inner.is_alive()
