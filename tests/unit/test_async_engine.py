"""AsyncLLMEngine over a fake engine: streams, aborts, faults, a dead engine thread, and the
waiting-queue limit, without a model or a server."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineFaultError,
    EngineRequest,
    QueueFullError,
)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams


class FakeEngine:
    """Every request gets one token per step until max_tokens; all of them count as
    waiting (so the queue limit can be tested) and as running (for fault handling)."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.output_processor = SimpleNamespace(requests=self.left, child_to_parent={})
        self.scheduler = SimpleNamespace(running=[])
        self.added: dict[str, tuple[int, str | None, str]] = {}  # priority, salt, class
        self.failed_request_ids: list[str] = []  # as LLMEngine after a rolled-back step

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0,
                    output_kind=None, cache_salt=None, sla_class="interactive") -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        self.added[request_id] = (priority, cache_salt, sla_class)
        self.left[request_id] = params.max_tokens
        self.output_processor.child_to_parent[request_id] = (request_id, 0)
        self.scheduler.running.append(SimpleNamespace(req_id=request_id))

    def _output(self, rid: str, num: int, reason: str | None) -> RequestOutput:
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "t" * num, [5] * num,
                                                               finish_reason=reason)],
                             reason is not None)

    def _forget(self, rid: str) -> None:
        del self.left[rid]
        self.scheduler.running = [r for r in self.scheduler.running if r.req_id != rid]

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outs.append(self._output(rid, 1, "length" if done else None))
            if done:
                self._forget(rid)
        return outs

    def abort_request(self, ids) -> list[RequestOutput]:
        outs = []
        for rid in [ids] if isinstance(ids, str) else ids:
            if rid in self.left:
                self._forget(rid)
                outs.append(self._output(rid, 0, "abort"))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.left), num_waiting=len(self.left),
                              kv_cache_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                              prefix_cache_hits=0)


# NOTE: a request that outlives any test. A fake step takes microseconds, so one of
# 10,000 tokens finished in 0.3 s, within a test's pauses on a fast or busy machine: the
# queue-limit test then saw one request waiting where it held two (a Zen 5 full-suite run).
FOREVER = 10**9


def run(coro_fn, fake: FakeEngine | None = None, **kwargs):
    async def main():
        engine = AsyncLLMEngine(fake or FakeEngine(), **kwargs)
        engine.start()
        try:
            return await asyncio.wait_for(coro_fn(engine), 10)
        finally:
            await asyncio.wait_for(engine.shutdown(), 10)

    return asyncio.run(main())


def req(rid: str, max_tokens: int, prompt: str = "p") -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens))


def test_streams_until_finished_and_rejects_invalid() -> None:
    async def body(engine: AsyncLLMEngine):
        stream = await engine.generate([req("a", 3), req("b", 2)])
        texts: dict[str, str] = {}
        async for out in stream:
            texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([req("c", 2), req("d", 2, prompt="")])
        return texts, dict(engine.engine.left)

    texts, left = run(body)
    assert texts == {"a": "ttt", "b": "tt"} and left == {}


def test_abort_ends_the_stream_and_frees_the_request() -> None:
    async def body(engine: AsyncLLMEngine):
        stream = await engine.generate([req("a", FOREVER)])
        first = await stream.__anext__()
        engine.abort(["a"])
        rest = [out async for out in stream]
        return first, rest, dict(engine.engine.left)

    first, rest, left = run(body)
    assert first.outputs[0].text == "t" and rest[-1].outputs[0].finish_reason == "abort"
    assert left == {}


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on() -> None:
    async def body(engine: AsyncLLMEngine):
        engine.inject_fault(1)
        stream = await engine.generate([req("a", 5)])
        with pytest.raises(EngineFaultError, match="injected"):
            async for _ in stream:
                pass
        after = await engine.generate([req("b", 2)])
        return [o.outputs[0].text async for o in after], engine.is_alive

    texts, alive = run(body)
    assert texts == ["t", "t"] and alive


def test_a_dead_engine_thread_fails_waiters_and_refuses_new_work() -> None:
    fake = FakeEngine()

    async def body(engine: AsyncLLMEngine):
        stream = await engine.generate([req("a", FOREVER)])
        await stream.__anext__()

        def broken() -> SchedulerStats:
            raise RuntimeError("bug outside step")

        fake.get_stats = broken
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.generate([req("b", 1)])
        return engine.is_alive

    assert run(body, fake) is False


def test_waiting_queue_limit() -> None:
    async def body(engine: AsyncLLMEngine):
        first = await engine.generate([req("a", FOREVER)])
        with pytest.raises(QueueFullError):
            await engine.generate([req("b", 1)])
        engine.abort(first.request_ids)
        _ = [out async for out in first]
        for _ in range(500):  # NOTE: the stats that free the queue follow the abort output
            try:
                again = await engine.generate([req("c", 1)])
                return [out async for out in again]
            except QueueFullError:
                await asyncio.sleep(0.01)
        raise AssertionError("the queue never freed up")

    assert len(run(body, max_queued_requests=1)) == 1


def hold_the_loop_until(done) -> None:
    """Blocks the event loop (on purpose: no reply can land) until `done()`, then a bit
    more, for the engine thread to queue what follows."""
    deadline = time.monotonic() + 5
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)


def test_an_added_request_counts_once_against_the_queue_limit() -> None:
    """The engine thread publishes stats holding B before B's add reply reaches the loop;
    a request in that window must still fit a queue of 2 (B counted once, not twice)."""
    async def body(engine: AsyncLLMEngine):
        b = asyncio.create_task(engine.generate([req("b", FOREVER)]))
        await asyncio.sleep(0)  # NOTE: B's add is sent
        hold_the_loop_until(lambda: engine.stats.num_waiting == 1)
        c = await engine.generate([req("c", FOREVER)])
        with pytest.raises(QueueFullError):
            await engine.generate([req("d", 1)])
        engine.abort(["b", "c"])
        return sorted((await b).request_ids + c.request_ids)

    assert run(body, max_queued_requests=2) == ["b", "c"]


def test_priority_salt_and_sla_class_reach_the_engine() -> None:
    async def body(engine: AsyncLLMEngine):
        params = SamplingParams(max_tokens=1)
        stream = await engine.generate([
            EngineRequest("a", "p", params, priority=5, cache_salt="s", sla_class="batch"),
            EngineRequest("b", "p", params),
        ])
        [out async for out in stream]
        return engine.engine.added

    assert run(body) == {"a": (5, "s", "batch"), "b": (0, None, "interactive")}


def test_build_creates_and_runs_the_engine_on_one_thread() -> None:
    """build() runs the factory on the engine thread, and that same thread steps it
    (the OpenMP reason is in AsyncLLMEngine.build)."""
    threads: dict[str, object] = {}

    class RecordingEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            threads["built"] = threading.current_thread()

        def step(self) -> list[RequestOutput]:
            threads["stepped"] = threading.current_thread()
            return super().step()

    engine = AsyncLLMEngine.build(RecordingEngine)
    assert threads["built"].name == "pagoda-engine"
    assert threads["built"] is not threading.main_thread()

    async def main():
        engine.start()
        try:
            stream = await engine.generate([req("a", 2)])
            return [o.outputs[0].text async for o in stream]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == ["t", "t"]
    assert threads["stepped"] is threads["built"]
    assert not engine.is_alive


def test_build_reraises_the_factory_error() -> None:
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build(factory)


class HalfAddingEngine(FakeEngine):
    """Refuses a prompt "half" after registering it, as an out-of-range seed once did."""

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        if prompt == "half":
            raise ValueError("seed overflow after registering")


def test_a_refused_add_leaves_nothing_and_orphans_are_found() -> None:
    fake = HalfAddingEngine()

    async def body(engine: AsyncLLMEngine):
        with pytest.raises(ValueError, match="overflow"):
            await engine.generate([req("a", 5), req("b", 5, prompt="half")])
        left_after_refusal = dict(fake.left)
        clean = await engine.orphan_request_ids()
        # A request the engine holds that no stream waits for: the leak the check finds.
        await engine.call(lambda e: e.add_request("stray", "p", SamplingParams(max_tokens=FOREVER)))
        return left_after_refusal, clean, await engine.orphan_request_ids()

    left, clean, orphans = run(body, fake)
    assert left == {} and clean == [] and orphans == ["stray"]


def test_a_request_id_in_use_is_refused() -> None:
    async def body(engine: AsyncLLMEngine):
        first = await engine.generate([req("a", FOREVER)])
        with pytest.raises(ValueError, match="in use"):
            await engine.generate([req("a", 1)])
        with pytest.raises(ValueError, match="in use"):
            await engine.generate([req("b", 1), req("b", 1)])
        engine.abort(first.request_ids)
        return [out async for out in first][-1].outputs[0].finish_reason

    assert run(body) == "abort"


def test_end_grace_fails_every_request_and_refuses_new_ones() -> None:
    from pagoda.engine.async_engine import EngineShutdownError

    async def body(engine: AsyncLLMEngine):
        running = await engine.generate([req("a", FOREVER), req("b", FOREVER)])
        await running.__anext__()
        engine.end_grace("grace over")
        with pytest.raises(EngineShutdownError, match="grace over"):
            async for _ in running:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.generate([req("c", 1)])
        for _ in range(500):  # NOTE: the engine thread aborts them at its next command
            if not engine.engine.left:
                break
            await asyncio.sleep(0.01)
        return dict(engine.engine.left), await engine.orphan_request_ids()

    left, orphans = run(body)
    assert left == {} and orphans == []
