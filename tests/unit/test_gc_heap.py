"""frozen_heap: the step loops run with the start-up heap out of the collector's walks,
and leave nothing frozen behind."""

from __future__ import annotations

import asyncio
import gc
import itertools
import weakref

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine, EngineRequest
from pagoda.engine.gc_heap import frozen_heap
from tests.unit.test_async_engine import FakeEngine


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_nested_loops_freeze_once_and_the_last_one_out_unfreezes(monkeypatch) -> None:
    # NOTE: the calls are recorded, not inferred from gc.get_freeze_count(): a thread left
    # by an earlier test may free frozen objects meanwhile, which lowers the count (CI saw
    # 554,831 -> 554,829 between the two frozen_heap entries).
    calls: list[str] = []
    freeze, unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), unfreeze())[1])
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert calls == ["freeze"] and gc.get_freeze_count() > 0
        with frozen_heap():
            assert calls == ["freeze"], "the inner entry must not freeze again"
        assert calls == ["freeze"], "the inner exit must not unfreeze"
    assert calls == ["freeze", "unfreeze"]
    assert gc.get_freeze_count() == 0


def test_garbage_made_inside_is_collected_inside() -> None:
    with frozen_heap():
        node = Node()
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None


def test_frozen_garbage_is_collected_after_the_exit() -> None:
    node = Node()
    ref = weakref.ref(node)
    with frozen_heap():
        del node
        gc.collect()
        assert ref() is not None, "a frozen cycle is skipped while frozen"
    gc.collect()
    assert ref() is None, "and freed once the loop is over"


class FreezeRecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.freeze_counts: list[int] = []

    def step(self):
        self.freeze_counts.append(gc.get_freeze_count())
        return super().step()


def test_llm_generate_steps_with_the_heap_frozen() -> None:
    fake = FreezeRecordingEngine()
    llm = LLM.__new__(LLM)  # NOTE: generate's loop without a model
    llm.llm_engine, llm._counter = fake, itertools.count()
    outs = llm.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].finished
    assert len(fake.freeze_counts) == 3 and min(fake.freeze_counts) > 0
    assert gc.get_freeze_count() == 0


def test_engine_core_loop_steps_with_the_heap_frozen() -> None:
    fake = FreezeRecordingEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        try:
            stream = await engine.generate([EngineRequest("a", "p", SamplingParams(max_tokens=3))])
            async for _ in stream:
                pass
        finally:
            await asyncio.wait_for(engine.shutdown(), 10)

    asyncio.run(main())
    assert len(fake.freeze_counts) == 3 and min(fake.freeze_counts) > 0
    assert gc.get_freeze_count() == 0


def test_engine_construction_runs_with_the_heap_frozen(monkeypatch) -> None:
    from pagoda.engine import llm_engine

    seen = []

    def fake_validate(self) -> None:
        seen.append(gc.get_freeze_count())
        raise RuntimeError("stop here")  # NOTE: only the decorator's effect is under test

    monkeypatch.setattr(llm_engine.EngineConfig, "validate", fake_validate)
    with pytest.raises(RuntimeError, match="stop here"):
        llm_engine.LLMEngine(llm_engine.EngineConfig.__new__(llm_engine.EngineConfig))
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0, "an init that raises leaves nothing frozen"
