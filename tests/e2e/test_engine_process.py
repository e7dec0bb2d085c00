"""The server with --engine-process (the engine in a child process of its own, the default;
the shared server of the other e2e tests runs so too): the same answers as the in-thread
server (--no-engine-process) token for token, an abort on disconnect frees the core's
blocks, a step fault fails only its request, /metrics counts what the core did, and the
core's death fails every waiter and /health (503) without hanging. That shutdown stops
and reaps a live core: tests/unit/test_core_client.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server_utils import (
    MAX_LOGPROBS,
    Server,
    integrity,
    sse_payloads,
    start_server,
    wait_idle,
)
from tests.e2e.test_server_load import scrape

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
REQUESTS = [
    ("/v1/completions", {"prompt": "The quick brown fox", "logprobs": 2, **GREEDY}),
    ("/v1/completions", {"prompt": [5, 17, 99, 3], "n": 2, "seed": 3, **GREEDY}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                              "logprobs": True, "top_logprobs": 2, **GREEDY}),
]


def _server_in_mode(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
                    mode_flag: str) -> Iterator[Server]:
    """A server with the same limits either way, the engine where `mode_flag` puts it."""
    log = tmp_path_factory.mktemp(mode_flag.strip("-")) / "server.log"
    srv = start_server(tiny_llama, log, mode_flag, "--max-num-seqs", "16",
                       "--max-logprobs", str(MAX_LOGPROBS))
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def core_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server_in_mode(tiny_llama, tmp_path_factory, "--engine-process")


@pytest.fixture(scope="module")
def thread_server(tiny_llama: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server_in_mode(tiny_llama, tmp_path_factory, "--no-engine-process")


@pytest.fixture
def core(core_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=core_server.base_url, timeout=60.0) as c:
        yield c


def _comparable(payload: Any) -> Any:
    """A response body without what differs between two servers by design: ids, creation
    times, and cached prompt tokens (each server's prefix cache has its own history)."""
    if isinstance(payload, dict):
        out = {k: _comparable(v) for k, v in payload.items() if k not in ("id", "created")}
        if isinstance(out.get("usage"), dict):
            out["usage"].pop("prompt_tokens_details", None)
        return out
    return payload


def _answers(client: httpx.Client) -> list[Any]:
    out = []
    for path, body in REQUESTS:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        out.append(_comparable(r.json()))
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            out.append([_comparable(p) for p in sse_payloads(r.iter_lines())])
    return out


def test_answers_equal_the_in_thread_server(core: httpx.Client, core_server: Server,
                                            thread_server: Server) -> None:
    with httpx.Client(base_url=thread_server.base_url, timeout=60.0) as thread:
        assert _answers(core) == _answers(thread)
        # The in-thread server steps the model in its own process.
        assert wait_idle(thread)["pid"] == thread_server.proc.pid
    report = wait_idle(core)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    # The engine runs in a child, which got the OpenMP setting of the server's environment.
    assert report["pid"] != core_server.proc.pid
    environ = Path(f"/proc/{report['pid']}/environ").read_bytes().split(b"\0")
    assert any(v.startswith((b"GOMP_SPINCOUNT=", b"OMP_WAIT_POLICY=")) for v in environ)


def test_metrics_count_the_core_s_work(core: httpx.Client) -> None:
    before = scrape(core)
    r = core.post("/v1/completions", json={"prompt": "count me", **GREEDY, "max_tokens": 5})
    assert r.status_code == 200
    after = scrape(core)
    assert after["pagoda:generation_tokens_total{}"] == before[
        "pagoda:generation_tokens_total{}"] + 5
    key = "pagoda:request_success_total{finished_reason=length}"
    assert after[key] == before[key] + 1
    ttft = "pagoda:time_to_first_token_seconds_count{}"
    assert after[ttft] == before[ttft] + 1
    assert after["pagoda:num_requests_running{}"] == 0


def test_disconnect_frees_the_core_s_blocks(core: httpx.Client, core_server: Server) -> None:
    body = {"prompt": "walk away", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=core_server.base_url, timeout=30.0) as own, own.stream(
            "POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # NOTE: kept referenced: closing it would disconnect early
        while not next(lines).startswith("data: "):
            pass
        assert integrity(core)["num_running"] == 1
    report = wait_idle(core, timeout_s=5.0)
    assert report["ok"] and report["kv_cache_usage"] == 0.0 and report["num_orphans"] == 0


def test_step_fault_fails_only_its_request(core: httpx.Client) -> None:
    body = {"prompt": "fault", "max_tokens": 8}
    core.post("/debug/fault", json={"num_steps": 1}).raise_for_status()
    r = core.post("/v1/completions", json=body)
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    report = wait_idle(core)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    assert core.post("/v1/completions", json=body).status_code == 200


def test_core_death_fails_every_waiter_and_health(core: httpx.Client,
                                                 core_server: Server) -> None:
    """Last in this module: the core is gone afterwards (the server still exits 0)."""
    pid = integrity(core)["pid"]
    long = {"prompt": "doomed", "max_tokens": 2000, "ignore_eos": True}
    answers: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: answers.append(
        httpx.post(core_server.url("/v1/completions"), json=long, timeout=60.0)))
    with core.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        waiter.start()
        wait_running(core, 2)
        os.kill(pid, signal.SIGKILL)
        payloads = sse_payloads(lines)
    waiter.join(timeout=30)
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == 500
    assert answers[0].status_code == 500, answers[0].text
    assert core.get("/health").status_code == 503
    assert core.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503


def wait_running(client: httpx.Client, num: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while integrity(client)["num_running"] < num:
        assert time.monotonic() < deadline, f"{num} requests never ran together"
        time.sleep(0.02)
