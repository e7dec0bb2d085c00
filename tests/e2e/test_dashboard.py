"""GET /dashboard in a real headless Chromium (Debian's chromium, installed by
scripts/setup.sh), on a server of its own with an API key: the page loads without console
errors, its charts hold non-empty series after traffic of every SLA class, and a
screenshot is kept in tests/artifacts/dashboard.png (git-ignored)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cdp import Browser, find_chromium
from tests.e2e.server_utils import ROOT, Server, start_server, wait_idle

API_KEY = "dash-key"
ARTIFACTS = ROOT / "tests" / "artifacts"
SHARED = "You are a helpful assistant who answers every question briefly. " * 4
PAGE_TIMEOUT_S = 30.0

# Per chart: series that must hold a finite value, and those that must have been > 0.
FINITE = {"tokens": ["prompt", "generation"], "requests": ["requests"],
          "ttft": [f"{c} {q}" for c in ("interactive", "async", "batch") for q in ("p50", "p99")],
          "itl": ["interactive p50", "batch p99"], "kv": ["device KV", "host tier", "swap pool"],
          "queue": ["interactive", "async", "batch", "running (all)"],
          "preemptions": ["interactive"], "errors": ["invalid_request_error", "timeout: queue"],
          "prefix": ["hit rate"], "device": ["engine busy", "process CPU"]}
POSITIVE = {"tokens": ["prompt", "generation"], "requests": ["requests"],
            "prefix": ["hit rate"], "device": ["engine busy"]}


@pytest.fixture(scope="module")
def dash_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dash_server") / "server.log"
    srv = start_server(tiny_llama, log, "--api-key", API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _traffic(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=60.0, headers=headers) as c:
        for i, sla_class in enumerate(["interactive", "async", "batch"] * 2):
            r = c.post("/v1/completions", json={
                "prompt": SHARED + f"question {i}", "max_tokens": 8, "ignore_eos": True,
                "temperature": 0, "sla_class": sla_class})
            assert r.status_code == 200, r.text
        assert c.post("/v1/completions", json={"prompt": ""}).status_code == 400
        wait_idle(c)


def _wait_for_polls(browser: Browser, num_polls: int, deadline: float) -> None:
    expr = "window.pagodaDashboard ? window.pagodaDashboard.polls : 0"
    while (browser.evaluate(expr) or 0) < num_polls:
        assert time.monotonic() < deadline, f"the page did not poll {num_polls} times"
        time.sleep(0.1)


def test_dashboard_in_chromium(dash_server: Server, tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium on PATH: run scripts/setup.sh (apt-get install chromium "
                    "chromium-driver)")
    data = httpx.get(dash_server.url("/dashboard/data"))  # NOTE: no key needed, as /metrics
    assert data.status_code == 200 and data.json()["gauges"]["kv_cache_usage_perc"] == 0.0
    browser = Browser(binary, tmp_path / "profile")
    try:
        for domain in ("Runtime", "Log", "Page"):
            browser.send(f"{domain}.enable")
        browser.send("Page.navigate", {"url": dash_server.url("/dashboard")})
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        _wait_for_polls(browser, 1, deadline)
        # NOTE: traffic while the page polls, so its 10 s rate windows see it.
        _traffic(dash_server)
        _wait_for_polls(browser, browser.evaluate("window.pagodaDashboard.polls") + 3,
                        deadline)
        charts = browser.evaluate("""Object.fromEntries(Object.entries(
            window.pagodaDashboard.charts).map(([id, u]) => [id, Object.fromEntries(
              u.series.slice(1).map((s, i) => [s.label, u.data[i + 1]]))]))""")
        shot = browser.send("Page.captureScreenshot", {"format": "png"})["data"]
        errors = browser.console_errors()
        failures = browser.evaluate("window.pagodaDashboard.failures")
    finally:
        browser.close()
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard.png"
    path.write_bytes(base64.b64decode(shot))
    print(f"dashboard screenshot: {path}")
    assert path.stat().st_size > 10_000
    assert errors == [] and failures == 0
    assert set(charts) == set(FINITE)
    for chart, labels in FINITE.items():
        for label in labels:
            values = [v for v in charts[chart][label] if v is not None]
            assert values, f"chart {chart}: series {label!r} is empty"
    for chart, labels in POSITIVE.items():
        for label in labels:
            assert max(v or 0 for v in charts[chart][label]) > 0, (chart, label)
