"""A second server, with an API key (from $PAGODA_API_KEY), one sequence at a time and a
waiting queue of two: 401, 429 with Retry-After, and a graceful SIGTERM (last test): the
short stream finishes; the long one ends with a 503 error event and `[DONE]`, and a
waiting non-streamed one gets a 503 body, type "service_unavailable"."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server_utils import MODEL_NAME, Server, sse_payloads, start_server, wait_idle

API_KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SHUTDOWN_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def limited(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("limited") / "server.log"
    srv = start_server(tiny_llama, log, "--max-num-seqs", "1", "--max-queued-requests", "2",
                       "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                       env={"PAGODA_API_KEY": API_KEY})
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture
def authed(limited: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.base_url, timeout=60.0, headers=AUTH) as c:
        yield c


def test_api_key(limited: Server, authed: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(limited.url("/v1/completions"), json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(limited.url("/v1/models")).status_code == 401
    assert httpx.post(limited.url("/tokenize"), json={"prompt": "hi"}).status_code == 401
    assert httpx.get(limited.url("/health")).status_code == 200
    assert httpx.get(limited.url("/metrics")).status_code == 200
    assert authed.post("/v1/completions", json=body).status_code == 200
    oai = openai.OpenAI(base_url=limited.url("/v1"), api_key=API_KEY, max_retries=0)
    assert oai.models.list().data[0].id == MODEL_NAME
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.url("/v1"), api_key="nope", max_retries=0).models.list()


def test_full_queue_is_429_with_retry_after(limited: Server, authed: httpx.Client) -> None:
    long = {"prompt": "busy", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=limited.base_url, timeout=30.0, headers=AUTH) as a, \
            httpx.Client(base_url=limited.base_url, timeout=30.0, headers=AUTH) as b, \
            httpx.Client(base_url=limited.base_url, timeout=30.0, headers=AUTH) as c, \
            a.stream("POST", "/v1/completions", json=long) as running:
        lines = running.iter_lines()  # NOTE: kept referenced: closing it would disconnect
        while not next(lines).startswith("data: "):
            pass
        with b.stream("POST", "/v1/completions", json=long) as waiting, \
                c.stream("POST", "/v1/completions", json=long) as waiting_too:
            assert waiting.status_code == 200  # accepted: it waits behind the running one
            assert waiting_too.status_code == 200
            r = authed.post("/v1/completions", json={"prompt": "one too many"})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "RateLimitError"
            assert int(r.headers["Retry-After"]) >= 1
    report = wait_idle(authed, timeout_s=5.0)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    assert authed.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success


def test_sigterm_finishes_in_flight_and_aborts_the_rest(limited: Server,
                                                        authed: httpx.Client) -> None:
    """Must run last in this module: it stops the server."""
    results: dict[str, list] = {}

    def stream(name: str, max_tokens: int, started: threading.Event) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        payloads: list = []
        try:
            with httpx.Client(base_url=limited.base_url, timeout=30.0, headers=AUTH) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                started.set()
                for line in r.iter_lines():
                    payloads.extend(sse_payloads(iter([line])))
        except httpx.HTTPError as e:
            payloads.append(e)
        results[name] = payloads

    def plain() -> None:
        body = {"prompt": "plain", "max_tokens": 2000, "ignore_eos": True}
        with httpx.Client(base_url=limited.base_url, timeout=30.0, headers=AUTH) as c:
            results["plain"] = [c.post("/v1/completions", json=body)]

    short_started, long_started = threading.Event(), threading.Event()
    short = threading.Thread(target=stream, args=("short", 100, short_started))
    long = threading.Thread(target=stream, args=("long", 2000, long_started))
    waiting = threading.Thread(target=plain)
    short.start()
    assert short_started.wait(30)
    long.start()
    assert long_started.wait(30)
    waiting.start()
    for _ in range(300):  # NOTE: until the engine holds all three
        if authed.get("/debug/integrity").json()["num_unfinished"] == 3:
            break
        time.sleep(0.01)
    start = time.monotonic()
    code_holder: list[int] = []
    stopper = threading.Thread(target=lambda: code_holder.append(limited.stop(30)))
    stopper.start()
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(limited.url("/health"), timeout=2.0)
    for t in (short, long, waiting, stopper):
        t.join(timeout=40)
    assert code_holder == [0], limited.log_tail()
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 15
    assert results["short"][-1] == "[DONE]"
    tokens = [c for p in results["short"][:-1] for c in p["choices"]]
    assert tokens[-1]["finish_reason"] == "length"
    # NOTE: the long one outlived the grace: an error event (503), then [DONE], not a cut.
    assert results["long"][-1] == "[DONE]", results["long"][-3:]
    err = results["long"][-2]["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable", err
    assert "shutting down" in err["message"]
    r = results["plain"][0]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable" and r.json()["error"]["code"] == 503
