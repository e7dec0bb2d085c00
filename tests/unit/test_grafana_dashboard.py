"""deploy/: every metric the Grafana dashboard queries is one pagoda exports (CPU and GPU
series, tenants included), and the Prometheus config scrapes /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from pagoda.engine.metrics import EngineMetrics
from pagoda.engine.resource_metrics import ResourceMetrics
from tests.unit.test_resource_metrics import FakeCuda, FakeNvml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"pagoda:[A-Za-z0-9_:]+")
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names() -> set[str]:
    metrics = EngineMetrics("m")
    metrics.add_tenants(["alice"])
    gpu_registry = CollectorRegistry()
    from pagoda.engine.resource_metrics import GpuSampler

    ResourceMetrics(gpu_registry, "m", "cuda:0", gpu=GpuSampler(0, FakeNvml(), FakeCuda()))
    names = set()
    for registry in (metrics.registry, gpu_registry):
        for family in registry.collect():
            # NOTE: a labelled counter has no sample before its first use (http_errors).
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
            names.update(s.name for s in family.samples)
    return names


def grafana_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_queried_metric_is_exported() -> None:
    exported = exported_names()
    queried = {name for expr in grafana_exprs() for name in METRIC.findall(expr)}
    assert len(queried) >= 30
    assert queried - exported == set()


def test_the_check_catches_a_wrong_name() -> None:
    assert "pagoda:generation_tokens" not in exported_names()  # NOTE: only with _total
    assert "pagoda:generation_tokens_total" in exported_names()


def test_grafana_panels_cover_the_live_dashboards_charts() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda.json").read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("tokens/s", "requests/s", "ttft", "itl", "kv cache", "queue depth",
                  "preemptions", "errors", "timeouts", "prefix-cache hit rate", "device"):
        assert topic in titles, topic
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])


def test_prometheus_config_scrapes_metrics() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
