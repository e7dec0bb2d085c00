"""The shared server under load: 64 concurrent streams, clients that walk away, /health
latency while the engine is busy, and exact Prometheus counts."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_utils import MODEL_NAME, Server, wait_idle

PROMPTS = [f"Story {i}: once upon a time there was a" for i in range(8)]


def scrape(client: httpx.Client) -> dict[str, float]:
    """`name{labels}` -> value, without the model_name label (one model per server)."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name" and not (k == "le" and v != "+Inf"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_64_concurrent_streams(client: httpx.Client, server: Server) -> None:
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    expected = {p: client.post("/v1/completions", json={**body, "prompt": p}).json()
                ["choices"][0]["text"] for p in PROMPTS}

    async def one(oai: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await oai.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                              max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        oai = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", timeout=120.0,
                                 max_retries=0)
        async with oai:
            return await asyncio.wait_for(
                asyncio.gather(*(one(oai, PROMPTS[i % 8]) for i in range(64))), 120)

    texts = asyncio.run(run_all())
    assert texts == [expected[PROMPTS[i % 8]] for i in range(64)]
    assert wait_idle(client)["ok"]


def test_disconnect_mid_stream_frees_blocks(client: httpx.Client, server: Server) -> None:
    before = scrape(client)
    body = {"prompt": "walk away", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30.0) as own, own.stream(
            "POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # NOTE: kept referenced: closing it would disconnect early
        while not next(lines).startswith("data: "):
            pass
        assert integrity_running(client) == 1
    report = wait_idle(client, timeout_s=5.0)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    after = scrape(client)
    key = "pagoda:request_success_total{finished_reason=abort}"
    assert after[key] == before[key] + 1
    assert after["pagoda:num_requests_running{}"] == 0
    assert after["pagoda:kv_cache_usage_perc{}"] == 0


def test_client_timeout_without_stream_aborts(client: httpx.Client, server: Server) -> None:
    body = {"prompt": "too slow", "max_tokens": 2000, "ignore_eos": True}
    try:
        httpx.post(server.url("/v1/completions"), json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    report = wait_idle(client, timeout_s=5.0)
    assert report["ok"] and report["kv_cache_usage"] == 0.0


def integrity_running(client: httpx.Client) -> int:
    return client.get("/debug/integrity").json()["num_running"]


def test_health_is_fast_while_busy(client: httpx.Client, server: Server) -> None:
    long_prompt = list(range(1000, 2900))  # 1,900 tokens: prefills of a full token budget
    body = {"prompt": long_prompt, "max_tokens": 100, "ignore_eos": True}
    done = []

    def load() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
            done.append(c.post("/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    latencies = []
    deadline = time.monotonic() + 60
    time.sleep(0.05)
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=60)
    assert done == [200] * 8
    assert len(latencies) >= 5, "the load ended before /health was sampled"
    print(f"/health latencies while busy (ms): {[round(x * 1e3, 1) for x in latencies]}")
    assert statistics.median(latencies) < 0.1 and max(latencies) < 0.3, latencies


def test_metrics_counts_are_exact(client: httpx.Client) -> None:
    wait_idle(client)
    before = scrape(client)
    n_prompt = client.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["count"]
    for _ in range(3):
        body = {"prompt": PROMPTS[0], "max_tokens": 5, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
    after = scrape(client)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pagoda:request_success_total{finished_reason=length}") == 3
    assert delta("pagoda:prompt_tokens_total{}") == 3 * n_prompt
    assert delta("pagoda:generation_tokens_total{}") == 15
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert delta(f"pagoda:{name}_count{{}}") == 3, name
    assert delta("pagoda:inter_token_latency_seconds_count{}") == 12
    assert delta("pagoda:http_errors_total{status=400}") == 1
    assert delta("pagoda:prefix_cache_queries_total{}") == 3 * n_prompt
    assert delta("pagoda:prefix_cache_hits_total{}") >= 2 * (n_prompt // 16) * 16
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"pagoda:{gauge}{{}}"] == 0, gauge
