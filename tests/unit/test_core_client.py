"""EngineCoreClient over an engine-core process that runs the fake engine of
test_async_engine.py (forked, not spawned: no interpreter start-up; the server's spawn
is tests/e2e/test_engine_process.py's): streams, metrics replayed in this process, an abort, a step fault,
refusals, the orphan check, shutdown reaping the child, a factory's error, the
child's death failing every waiter with EngineDeadError, prompts crossing once, messages
larger than the pipe's buffer on asyncio's and uvloop's loops, a core that cannot be
reached killed, and a core whose server is gone stopping quietly."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import uvloop

from pagoda.engine.async_engine import EngineDeadError, EngineFaultError
from pagoda.engine.core_client import EngineCoreClient
from pagoda.engine.core_process import PipeSink, _read_commands, elide_prompts, restore_prompts
from pagoda.engine.engine_core import AddCommand, EngineCore
from pagoda.engine.metrics import EngineMetrics
from pagoda.outputs import CompletionOutput, RequestOutput
from tests.unit.test_async_engine import FOREVER, FakeEngine, req


class CoreFakeEngine(FakeEngine):
    """The fake engine with the facts and checks the core reports."""

    tokenizer, model_path, max_model_len, vocab_size, device = None, "/m/fake", 64, 100, "cpu"
    num_blocks = 8

    def __init__(self) -> None:
        super().__init__()
        self.scheduler.waiting = []  # NOTE: the core always counts its queues for metrics

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        self.scheduler.running[-1] = SimpleNamespace(
            req_id=request_id, sla_class=kwargs.get("sla_class", "interactive"), num_tokens=1)

    def get_num_unfinished_requests(self) -> int:
        return len(self.left)

    def check_integrity(self) -> None:
        pass


def refuse() -> CoreFakeEngine:
    raise ValueError("no such model")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serves_over_the_pipe_and_shutdown_reaps_the_child() -> None:
    async def main() -> tuple[int, dict]:
        client = EngineCoreClient.spawn(CoreFakeEngine, start_method="fork")
        client.metrics = metrics = EngineMetrics("fake")
        client.start()
        try:
            stream = await client.generate([req("a", 3), req("b", 2)])
            texts: dict[str, str] = {}
            async for out in stream:
                texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
            tokens = metrics.registry.get_sample_value("pagoda:generation_tokens_total",
                                                       {"model_name": "fake"})
            long = await client.generate([req("c", FOREVER)])
            await long.__anext__()
            client.abort(["c"])
            reason = [out async for out in long][-1].outputs[0].finish_reason
            client.inject_fault(1)
            faulty = await client.generate([req("d", 5)])
            with pytest.raises(EngineFaultError, match="injected"):
                _ = [out async for out in faulty]
            with pytest.raises(ValueError, match="empty"):
                await client.generate([req("e", 2), req("f", 2, prompt="")])
            after = [o.outputs[0].text async for o in await client.generate([req("g", 2)])]
            report = await client.rpc("integrity")
            orphans = await client.orphan_request_ids()
        finally:
            await asyncio.wait_for(client.shutdown(), 30)
        return client.process.pid, {"texts": texts, "tokens": tokens, "reason": reason,
                                    "after": after, "report": report, "orphans": orphans}

    pid, got = asyncio.run(asyncio.wait_for(main(), 60))
    assert got["texts"] == {"a": "ttt", "b": "tt"} and got["tokens"] == 5
    assert got["reason"] == "abort" and got["after"] == ["t", "t"]
    assert got["report"]["pid"] == pid != os.getpid() and got["report"]["num_unfinished"] == 0
    assert got["orphans"] == []
    assert not _alive(pid)


def test_spawn_reraises_the_factory_error() -> None:
    with pytest.raises(ValueError, match="no such model"):
        EngineCoreClient.spawn(refuse, start_method="fork")


def test_the_child_s_death_fails_every_waiter() -> None:
    async def main() -> tuple[bool, type, type]:
        client = EngineCoreClient.spawn(CoreFakeEngine, start_method="fork")
        client.start()
        try:
            stream = await client.generate([req("a", FOREVER)])
            await stream.__anext__()
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            errors = []
            for call in (client.generate([req("b", 1)]), client.rpc("integrity")):
                try:
                    await call
                except EngineDeadError as e:
                    errors.append(type(e))
            return client.is_alive, errors
        finally:
            await asyncio.wait_for(client.shutdown(), 30)

    alive, errors = asyncio.run(asyncio.wait_for(main(), 60))
    assert alive is False and errors == [EngineDeadError, EngineDeadError]


def test_a_prompt_crosses_the_pipe_once() -> None:
    steps = [[("a", _output("a", False))], [("a", _output("a", False)), ("b", _output("b", True))],
             [("a", _output("a", True)), ("b", _output("b", True))]]
    sent: set[str] = set()
    prompts: dict = {}
    got = []
    for items in steps:
        elide_prompts(items, sent)
        wire = pickle.loads(pickle.dumps(items))
        got.append([out.prompt_token_ids is None for _, out in wire])
        restore_prompts(wire, prompts)
        assert all(out.prompt == f"p{rid}" and out.prompt_token_ids == [7, 8]
                   for rid, out in wire)
    # "b" was finished at once, so its id is new again at the last step (a reused id).
    assert got == [[False], [True, False], [True, False]]
    assert sent == set() and prompts == {}


def _output(rid: str, finished: bool) -> RequestOutput:
    return RequestOutput(rid, f"p{rid}", [7, 8], [CompletionOutput(0, "t", [5])], finished)


class EchoFakeEngine(CoreFakeEngine):
    """The fake engine whose outputs carry the request's prompt, as LLMEngine's do, and
    whose tokens are 8 MiB of text each for the prompt "big"."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: dict[str, str] = {}

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        self.prompts[request_id] = prompt

    def _output(self, rid: str, num: int, reason: str | None) -> RequestOutput:
        out = super()._output(rid, num, reason)
        out.prompt = self.prompts[rid]
        if out.prompt == "big":
            out.outputs[0].text *= 8 << 20
        return out


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("big", ["command", "output"])
def test_a_message_larger_than_the_pipe_s_buffer_crosses_whole(big: str, loop: str) -> None:
    # NOTE: 8 MiB, far past a socket's buffer, so the message reaches the other end in
    # parts: an add's prompt (and the first output, which carries it back), or a step's
    # output. uvloop, which uvicorn runs on, made the pipe non-blocking, and a message
    # half-read or half-sent read as the core's death.
    prompt = "x" * (8 << 20) if big == "command" else "big"

    async def main() -> tuple[list[str | None], list[int], bool]:
        client = EngineCoreClient.spawn(EchoFakeEngine, start_method="fork")
        client.start()
        try:
            outs = [out async for out in await client.generate([req("a", 3, prompt=prompt)])]
            return ([o.prompt for o in outs], [len(o.outputs[0].text) for o in outs],
                    client.is_alive)
        finally:
            await asyncio.wait_for(client.shutdown(), 30)

    run = uvloop.run if loop == "uvloop" else asyncio.run
    prompts, lengths, alive = run(asyncio.wait_for(main(), 60))
    assert alive and prompts == [prompt] * 3
    assert lengths == [1 if big == "command" else 8 << 20] * 3


def test_a_core_that_cannot_be_reached_is_killed() -> None:
    # NOTE: e.g. a garbled message: the child still runs, and nothing would stop it.
    async def main() -> int | None:
        client = EngineCoreClient.spawn(CoreFakeEngine, start_method="fork")
        client.start()
        try:
            client._core_died("the engine core cannot be reached: test")
            await asyncio.to_thread(client.process.join, 10)
            return client.process.exitcode
        finally:
            await asyncio.wait_for(client.shutdown(), 30)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == -signal.SIGKILL


def test_a_core_whose_server_is_gone_stops_quietly(caplog: pytest.LogCaptureFixture) -> None:
    # NOTE: the server killed mid-step: the core's next send breaks the pipe; that is no
    # bug of its loop (it once logged "engine loop died" with a traceback).
    ours, theirs = multiprocessing.Pipe()
    core = EngineCore(CoreFakeEngine(), PipeSink(theirs))
    threading.Thread(target=_read_commands, args=(theirs, core), daemon=True).start()
    loop = threading.Thread(target=core.run, daemon=True)
    with caplog.at_level(logging.WARNING):
        loop.start()
        ours.send(AddCommand([req("a", FOREVER)], time.monotonic(), 0))
        ours.recv()  # NOTE: the add's reply: the request is stepping
        ours.close()
        loop.join(30)
    assert not loop.is_alive()
    assert "the engine core stops" in caplog.text and "died" not in caplog.text
