"""dashboard/data.py: histogram quantiles as Prometheus interpolates them, and the JSON
snapshot read from the same registry as /metrics, windowed percentiles included."""

from __future__ import annotations

import math

import pytest

from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.openai.dashboard.data import DashboardData, bucket_quantile
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput

INF = math.inf


def test_bucket_quantile() -> None:
    bounds = [0.1, 0.2, 0.5, INF]
    assert bucket_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert bucket_quantile(0.5, bounds, [10, 10, 10, 10]) == pytest.approx(0.05)
    # 4 in (0.1, 0.2], 4 in (0.2, 0.5]: the median is the top of the first of them.
    assert bucket_quantile(0.5, bounds, [0, 4, 8, 8]) == pytest.approx(0.2)
    assert bucket_quantile(0.75, bounds, [0, 4, 8, 8]) == pytest.approx(0.35)
    assert bucket_quantile(0.99, bounds, [0, 4, 8, 10]) == pytest.approx(0.5)  # +Inf bucket
    assert bucket_quantile(0.5, [INF], [3]) is None


def first_token(m: EngineMetrics, rid: str, sla_class: str, ttft: float, now: float) -> None:
    rm = RequestMetrics(arrival_time=now - ttft, first_scheduled_time=now - ttft,
                        first_token_time=now, sla_class=sla_class)
    out = RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "x", [7])], False,
                        metrics=rm)
    m.observe_outputs([out], now=now)


def test_snapshot_reads_the_registry_and_windows_percentiles() -> None:
    m = EngineMetrics("m")
    data = DashboardData(m.registry, window_s=60.0)
    first_token(m, "a", "batch", 0.04, now=1000.0)
    snap = data.snapshot(now=1000.0)
    batch = snap["latency"]["ttft"]["batch"]
    assert batch["count"] == 1 and 0.025 < batch["p50"] <= 0.05
    assert snap["latency"]["ttft"]["interactive"] == {"p50": None, "p99": None, "count": 0.0}
    assert snap["queue"] == {"interactive": 0.0, "async": 0.0, "batch": 0.0}
    assert snap["errors_total"]["timeout"] == 0.0
    assert snap["timeouts_total"] == {"queue": 0.0, "running": 0.0}
    assert snap["prefix_cache_hit_rate"] is None
    m.observe_timeout("batch", "queue")
    m.observe_request_error("timeout")
    first_token(m, "b", "batch", 2.5, now=1070.0)
    snap = data.snapshot(now=1070.0)
    # The window now starts at the snapshot of t=1000: only b's TTFT is in it.
    assert snap["latency"]["ttft"]["batch"]["count"] == 1
    assert 2.0 < snap["latency"]["ttft"]["batch"]["p50"] <= 3.0
    assert snap["timeouts_total"]["queue"] == 1.0 and snap["errors_total"]["timeout"] == 1.0
    assert snap["gauges"]["avg_prompt_throughput_toks_per_s"] is not None
    assert snap["gauges"]["gpu_memory_used_bytes"] is None  # NOTE: CPU: not exported
