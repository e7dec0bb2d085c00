"""An idle engine core gathers a burst into its first step: an add announcing more
requests (`more_coming`) makes it wait for them, at most `gather_s`; a lone request, or
one that finds the engine busy, waits for nothing. The front end's count of requests still
arriving (request_log.Arrivals) goes back to zero whether a request reached the engine or
failed before."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.engine.engine_core import AddCommand, EngineCore, burst_gather_s
from pagoda.entrypoints.openai.request_log import Arrivals, RequestObserver, current_record
from tests.unit.test_async_engine import FOREVER, FakeEngine, req


class StepLog(FakeEngine):
    """The fake engine, recording the request ids of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[set[str]] = []

    def step(self):
        self.steps.append(set(self.left))
        return super().step()


class Sink:
    def __init__(self) -> None:
        self.first_output: dict[str, float] = {}

    def deliver(self, items) -> None:
        for rid, _ in items:
            self.first_output.setdefault(rid, time.monotonic())

    def reply(self, token, result, exc) -> None:
        pass

    def publish_stats(self, stats, added_through) -> None:
        pass

    def flush(self) -> None:
        pass

    def died(self, exc) -> None:
        raise AssertionError(f"the loop died: {exc!r}")


def started(gather_s: float) -> tuple[EngineCore, StepLog, Sink, threading.Thread]:
    engine, sink = StepLog(), Sink()
    core = EngineCore(engine, sink, gather_s=gather_s)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    return core, engine, sink, loop


def add(core: EngineCore, rid: str, more: int, token: int, max_tokens: int = 2) -> float:
    sent = time.monotonic()
    core.send(AddCommand([req(rid, max_tokens)], sent, token, more))
    return sent


def wait_for(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def first_output_after(sink: Sink, rid: str, sent: float) -> float:
    """Seconds from `sent` to request `rid`'s first output (waits for it)."""
    wait_for(lambda: rid in sink.first_output)
    return sink.first_output[rid] - sent


def stop(core: EngineCore, loop: threading.Thread) -> None:
    core.stop()
    loop.join(10)
    assert not loop.is_alive()


def test_an_announced_burst_is_one_first_step() -> None:
    core, engine, sink, loop = started(gather_s=30.0)
    try:
        add(core, "a", 2, 0)
        time.sleep(0.2)
        assert engine.steps == []  # NOTE: two more announced: it waits
        add(core, "b", 1, 1)
        time.sleep(0.1)
        assert engine.steps == []
        add(core, "c", 0, 2)
        wait_for(lambda: len(sink.first_output) == 3)
        assert engine.steps[0] == {"a", "b", "c"}
    finally:
        stop(core, loop)


def test_a_lone_request_waits_for_nothing() -> None:
    core, _engine, sink, loop = started(gather_s=30.0)
    try:
        assert first_output_after(sink, "a", add(core, "a", 0, 0)) < 5.0
    finally:
        stop(core, loop)


def test_the_wait_is_bounded() -> None:
    core, engine, sink, loop = started(gather_s=0.3)
    try:
        sent = add(core, "a", 3, 0)  # NOTE: announced requests that never come
        assert 0.3 <= first_output_after(sink, "a", sent) < 10.0
        assert engine.steps[0] == {"a"}
    finally:
        stop(core, loop)


def test_a_busy_engine_does_not_wait() -> None:
    core, _engine, sink, loop = started(gather_s=30.0)
    try:
        first_output_after(sink, "x", add(core, "x", 0, 0, max_tokens=FOREVER))
        assert first_output_after(sink, "a", add(core, "a", 5, 1)) < 5.0
    finally:
        stop(core, loop)


def test_stop_ends_a_gather() -> None:
    core, engine, _sink, loop = started(gather_s=30.0)
    add(core, "a", 1, 0)
    time.sleep(0.1)
    start = time.monotonic()
    stop(core, loop)
    assert time.monotonic() - start < 5.0 and engine.steps == []


def test_gather_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_BURST_GATHER_MS", raising=False)
    assert burst_gather_s() == 0.02
    monkeypatch.setenv("PAGODA_BURST_GATHER_MS", "0")
    assert burst_gather_s() == 0.0
    for bad in ("soon", "-1", "5000"):
        monkeypatch.setenv("PAGODA_BURST_GATHER_MS", bad)
        with pytest.raises(ValueError, match="PAGODA_BURST_GATHER_MS"):
            burst_gather_s()


def test_arrivals_count_generation_requests_until_they_leave() -> None:
    arrivals = Arrivals()
    seen: list[Any] = []

    async def app(scope, receive, send) -> None:
        record = current_record()
        seen.append(arrivals.pending)
        if scope["path"] == "/v1/completions" and scope["query_string"] == b"submit":
            seen.append(record.leave_arrivals())  # what submit() hands the engine
            seen.append(record.leave_arrivals())  # once only
        elif scope["path"] == "/v1/chat/completions":
            raise RuntimeError("failed before reaching the engine")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    observer = RequestObserver(app, SimpleNamespace(observe_request_error=lambda t: None),
                               None, (), False, arrivals=arrivals)

    async def call(method: str, path: str, query: bytes = b"") -> None:
        async def send(message) -> None:
            pass
        scope = {"type": "http", "method": method, "path": path, "headers": [],
                 "query_string": query}
        await observer(scope, None, send)

    async def main() -> None:
        arrivals.pending = 2  # NOTE: two others mid-way through their handlers
        await call("POST", "/v1/completions", b"submit")
        assert seen == [3, 2, 0] and arrivals.pending == 2
        seen.clear()
        await call("POST", "/v1/completions")  # answered without the engine (a 400)
        assert seen == [3] and arrivals.pending == 2
        seen.clear()
        with pytest.raises(RuntimeError):
            await call("POST", "/v1/chat/completions")
        assert seen == [3] and arrivals.pending == 2
        seen.clear()
        await call("GET", "/v1/models")
        await call("POST", "/tokenize")
        assert seen == [2, 2] and arrivals.pending == 2

    asyncio.run(main())
