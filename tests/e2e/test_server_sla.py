"""`sla_class` over HTTP on the shared server: requests count in their class's series with
exact counts, on both endpoints, streamed or not; an unknown class is a 400 naming it."""

from __future__ import annotations

import httpx

from tests.e2e.server_utils import sse_payloads, wait_idle
from tests.e2e.test_server_errors import assert_error
from tests.e2e.test_server_load import scrape

CHAT = [{"role": "user", "content": "hi"}]
GEN = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


def test_sla_class_counts_in_its_class_series(client: httpx.Client) -> None:
    wait_idle(client)
    before = scrape(client)
    # batch: 2 prompts in one completion + 1 streamed chat; async: 1 chat;
    # interactive: 1 completion without the field + 1 with it and a vLLM priority.
    r = client.post("/v1/completions",
                    json={**GEN, "prompt": ["one", "two"], "sla_class": "batch"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    body = {**GEN, "messages": CHAT, "sla_class": "batch", "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        assert sse_payloads(s.iter_lines())[-1] == "[DONE]"
    r = client.post("/v1/chat/completions", json={**GEN, "messages": CHAT, "sla_class": "async"})
    assert r.status_code == 200
    assert client.post("/v1/completions", json={**GEN, "prompt": "three"}).status_code == 200
    r = client.post("/v1/completions", json={**GEN, "prompt": "four", "priority": -3,
                                             "sla_class": "interactive"})
    assert r.status_code == 200
    after = scrape(client)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    expected = {"interactive": 2, "async": 1, "batch": 3}
    for sla_class, count in expected.items():
        for name in ("sla_time_to_first_token_seconds_count",
                     "sla_request_queue_time_seconds_count", "sla_first_tokens_total"):
            assert delta(f"pagoda:{name}{{sla_class={sla_class}}}") == count, (name, sla_class)
        assert after[f"pagoda:sla_num_preemptions_total{{sla_class={sla_class}}}"] == 0
    assert delta("pagoda:time_to_first_token_seconds_count{}") == 6
    assert delta("pagoda:request_queue_time_seconds_count{}") == 6
    assert wait_idle(client)["ok"]


def test_unknown_sla_class_is_400(client: httpx.Client) -> None:
    before = scrape(client)
    for path, body in (("/v1/completions", {"prompt": "hi", "sla_class": "gold"}),
                       ("/v1/chat/completions", {"messages": CHAT, "sla_class": "Batch"}),
                       ("/v1/completions", {"prompt": "hi", "sla_class": 2})):
        err = assert_error(client.post(path, json=body), 400, "sla_class")
        assert "sla_class" in err["message"]
    after = scrape(client)
    assert after["pagoda:http_errors_total{status=400}"] == (
        before.get("pagoda:http_errors_total{status=400}", 0) + 3)
    key = "pagoda:time_to_first_token_seconds_count{}"
    assert after[key] == before[key]
