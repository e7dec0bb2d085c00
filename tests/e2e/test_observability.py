"""Observability over HTTP on one server of this module: exact metric counts after scripted
traffic (throughput windows, per-tenant counts, error classes, timeouts in the queue and
while running, each freeing its KV), 408 against a stream's "timeout" finish, X-Request-Id,
and the JSON request log.

The server runs one sequence at a time (so later requests queue), with a 2.5 s request
timeout, a 1 s maximum queue time for the batch class, two tenants' keys, JSON logs and no
dashboard. Its model has 12 layers, so that a long request cannot finish within the
timeout (about 8 ms a token here, 2000 tokens).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import Server, sse_payloads, start_server, wait_idle
from tests.e2e.test_server_load import scrape

KEYS = {"alice": "key-a", "bob": "key-b"}
REQUEST_TIMEOUT_S = 2.5
LONG = {"prompt": "tell me", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
ERROR_TYPES = ("invalid_request_error", "authentication_error", "rate_limit", "timeout",
               "engine_error", "client_disconnect", "api_error")


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def obs_server(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=2048, num_hidden_layers=12)
    log = tmp_path_factory.mktemp("obs_server") / "server.log"
    srv = start_server(model, log, "--max-num-seqs", "1", "--max-queued-requests", "2",
                       "--request-timeout", str(REQUEST_TIMEOUT_S),
                       "--sla-max-queue-time", "batch=1.0",
                       "--api-key", ",".join(f"{k}={v}" for k, v in KEYS.items()),
                       "--log-format", "json", "--disable-dashboard")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture
def oc(obs_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=obs_server.base_url, timeout=60.0, headers=auth("alice")) as c:
        yield c


def deltas(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """The series of `prefix` that changed, by their labels."""
    return {k[len(prefix):]: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix + "{") and after[k] != before.get(k, 0.0)}


def log_records(server: Server) -> list[dict]:
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # NOTE: fails on any line that is not JSON


def request_records(server: Server) -> dict[str, dict]:
    return {r["request_id"]: r for r in log_records(server) if r["message"] == "request"}


def test_1_traffic_counts_tenants_and_request_ids(oc: httpx.Client, obs_server: Server) -> None:
    """First traffic of the server: the 10 s throughput windows hold exactly it."""
    before = scrape(oc)
    body = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
    r1 = oc.post("/v1/completions", json={**body, "prompt": "hello"},
                 headers={"X-Request-Id": "obs-1"})
    assert r1.status_code == 200 and r1.headers["x-request-id"] == "obs-1"
    chat = {**body, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "stream_options": {"include_usage": True}}
    with oc.stream("POST", "/v1/chat/completions", json=chat,
                   headers={"X-Request-Id": "obs-2"}) as s:
        assert s.headers["x-request-id"] == "obs-2"
        events = sse_payloads(s.iter_lines())
    r3 = oc.post("/v1/completions", json={**body, "prompt": "two", "n": 2, "max_tokens": 2},
                 headers=auth("bob"))
    assert r3.status_code == 200
    generated = r3.headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    after = scrape(oc)

    alice_prompt = r1.json()["usage"]["prompt_tokens"] + events[-2]["usage"]["prompt_tokens"]
    bob_prompt = r3.json()["usage"]["prompt_tokens"]
    assert deltas(before, after, "pagoda:tenant_requests_total") == {
        "{tenant=alice}": 2, "{tenant=bob}": 1}
    assert deltas(before, after, "pagoda:tenant_generation_tokens_total") == {
        "{tenant=alice}": 7, "{tenant=bob}": 4}
    assert deltas(before, after, "pagoda:tenant_prompt_tokens_total") == {
        "{tenant=alice}": alice_prompt, "{tenant=bob}": bob_prompt}
    assert not deltas(before, after, "pagoda:request_errors_total")
    assert after["pagoda:avg_generation_throughput_toks_per_s{}"] == pytest.approx(11 / 10)
    assert after["pagoda:avg_prompt_throughput_toks_per_s{}"] == pytest.approx(
        (alice_prompt + bob_prompt) / 10)
    assert after["pagoda:avg_request_throughput_per_s{}"] == pytest.approx(3 / 10)
    assert 0 < after["pagoda:engine_busy_fraction{}"] <= 1
    assert after["pagoda:process_cpu_usage{}"] > 0
    assert after["pagoda:process_resident_memory_bytes{}"] > 50 << 20
    assert oc.get("/dashboard").status_code == 404  # --disable-dashboard


def test_2_error_classes(oc: httpx.Client, obs_server: Server) -> None:
    wait_idle(oc)
    before = scrape(oc)
    assert oc.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    assert oc.post("/v1/completions", content=b"{nope",
                   headers={"Content-Type": "application/json"}).status_code == 400
    assert oc.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}).status_code == 404
    r = oc.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401
    assert oc.post("/debug/fault", json={"num_steps": 1}).status_code == 200
    assert oc.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 500
    assert oc.post("/debug/fault", json={"num_steps": 1}).status_code == 200
    with oc.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
        assert s.status_code == 200
        events = sse_payloads(s.iter_lines())
    assert events[-2]["error"]["code"] == 500 and events[-1] == "[DONE]"
    # A non-streamed request whose client gives up (499), and a stream left after one chunk.
    with pytest.raises(httpx.ReadTimeout):
        oc.post("/v1/completions", json=LONG, headers={"X-Request-Id": "obs-gone"},
                timeout=0.5)
    wait_idle(oc)
    with oc.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                   headers={"X-Request-Id": "obs-left"}) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))
    report = wait_idle(oc)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    after = scrape(oc)
    assert deltas(before, after, "pagoda:request_errors_total") == {
        "{type=invalid_request_error}": 3, "{type=authentication_error}": 1,
        "{type=engine_error}": 2, "{type=client_disconnect}": 2}
    assert deltas(before, after, "pagoda:http_errors_total") == {
        "{status=400}": 2, "{status=404}": 1, "{status=401}": 1, "{status=500}": 2,
        "{status=499}": 1}
    # NOTE: tenants count their authorised requests; the 401 has no tenant.
    assert deltas(before, after, "pagoda:tenant_requests_total") == {"{tenant=alice}": 7}


async def _timeout_traffic(base_url: str) -> dict[str, object]:
    """A: a long stream (times out running); B, C: batch requests queued behind it (time
    out in the queue, one streamed); D: refused while B and C wait; then F: a long
    non-streamed request (times out running)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0,
                                 headers=auth("alice")) as client:
        async def stream(body: dict, request_id: str, started: asyncio.Event | None = None):
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                                     headers={"X-Request-Id": request_id}) as s:
                events = []
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if started is not None:
                            started.set()
                return events

        started = asyncio.Event()
        a = asyncio.create_task(stream(LONG, "obs-a", started))
        await asyncio.wait_for(started.wait(), 30)
        batch = {"prompt": "later", "max_tokens": 2, "sla_class": "batch"}
        b = asyncio.create_task(client.post("/v1/completions", json=batch,
                                            headers={"X-Request-Id": "obs-b"}))
        c = asyncio.create_task(stream(batch, "obs-c"))
        for _ in range(200):
            if (await client.get("/debug/integrity")).json()["num_waiting"] == 2:
                break
            await asyncio.sleep(0.005)
        d = await client.post("/v1/completions", json={"prompt": "full", "max_tokens": 2})
        out: dict[str, object] = {"a": await a, "b": await b, "c": await c, "d": d}
        out["f"] = await client.post("/v1/completions", json={**LONG, "sla_class": "async"},
                                     headers={"X-Request-Id": "obs-f"})
        return out


def test_3_timeouts_in_queue_and_running_free_kv(oc: httpx.Client, obs_server: Server) -> None:
    wait_idle(oc)
    before = scrape(oc)
    out = asyncio.run(_timeout_traffic(obs_server.base_url))
    a, c = out["a"], out["c"]
    # A stream that has begun ends with finish_reason "timeout" after some tokens.
    assert a[-1] == "[DONE]" and a[-2]["choices"][0]["finish_reason"] == "timeout"
    assert sum(len(e["choices"][0]["text"]) for e in a[:-1]) > 0
    assert c[-1] == "[DONE]" and [e["choices"][0]["finish_reason"] for e in c[:-1]] == [
        "timeout"]
    assert out["d"].status_code == 429
    for r in (out["b"], out["f"]):  # NOTE: nothing was sent yet: 408
        assert r.status_code == 408, r.text
        assert r.json()["error"]["code"] == 408
    report = wait_idle(oc)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    after = scrape(oc)
    assert deltas(before, after, "pagoda:request_timeouts_total") == {
        "{sla_class=interactive,stage=running}": 1, "{sla_class=batch,stage=queue}": 2,
        "{sla_class=async,stage=running}": 1}
    assert deltas(before, after, "pagoda:request_errors_total") == {
        "{type=timeout}": 4, "{type=rate_limit}": 1}
    assert deltas(before, after, "pagoda:request_success_total") == {
        "{finished_reason=timeout}": 4}
    assert deltas(before, after, "pagoda:http_errors_total") == {
        "{status=408}": 2, "{status=429}": 1}


def test_4_json_request_log(obs_server: Server) -> None:
    records = request_records(obs_server)
    ok = records["obs-1"]
    assert ok["status"] == 200 and ok["tenant"] == "alice" and ok["sla_class"] == "interactive"
    assert ok["completion_tokens"] == 4 and ok["prompt_tokens"] > 0
    assert ok["finish_reason"] == "length" and ok["error_type"] is None
    assert 0 < ok["ttft_s"] <= ok["e2e_s"]
    assert ok["path"] == "/v1/completions" and ok["level"] == "INFO"
    assert records["obs-2"]["completion_tokens"] == 3
    assert records["obs-gone"]["error_type"] == "client_disconnect"
    assert records["obs-left"]["error_type"] == "client_disconnect"
    for rid, status, sla_class in (("obs-a", 200, "interactive"), ("obs-b", 408, "batch"),
                                   ("obs-c", 200, "batch"), ("obs-f", 408, "async")):
        rec = records[rid]
        assert (rec["status"], rec["sla_class"], rec["error_type"], rec["finish_reason"]) == (
            status, sla_class, "timeout", "timeout"), rec
        assert rec["e2e_s"] >= (1.0 if sla_class == "batch" else REQUEST_TIMEOUT_S)
    assert records["obs-c"]["completion_tokens"] == 0
    # Every line of the log is JSON (uvicorn's own lines included), none holds a key.
    text = Path(obs_server.log_path).read_text()
    assert all(key not in text for key in KEYS.values())
    assert any(r["logger"].startswith("uvicorn") for r in log_records(obs_server))
