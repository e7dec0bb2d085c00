"""The dashboard's JSON: one snapshot of the server's Prometheus registry (the one /metrics
exposes), with latency percentiles and the prefix-cache hit rate over a sliding window.

Window rule: percentiles and the hit rate use the increase of the cumulative counts since
the newest earlier snapshot at least `window_s` old (the first snapshot: since start-up),
as PromQL's `histogram_quantile(q, increase(...[window]))` would. Counters are sent as
totals (the page turns them into per-second rates between two polls).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from pagoda.core.request import SLA_CLASS_RANKS
from pagoda.engine.metrics import PREFIX, TIMEOUT_STAGES

_LATENCIES = {"ttft": "sla_time_to_first_token_seconds", "itl": "sla_inter_token_latency_seconds"}
_GAUGES = ("avg_prompt_throughput_toks_per_s", "avg_generation_throughput_toks_per_s",
           "avg_request_throughput_per_s", "kv_cache_usage_perc", "host_tier_usage_perc",
           "swap_pool_usage_perc", "num_requests_running", "num_requests_waiting",
           "num_tokens_running", "num_tokens_waiting", "engine_busy_fraction",
           "process_cpu_usage", "process_resident_memory_bytes", "gpu_utilization_perc",
           "gpu_memory_used_bytes", "gpu_memory_total_bytes")
Samples = dict[str, list[tuple[dict[str, str], float]]]


def bucket_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """The q-quantile of a histogram given its ascending upper bounds (the last +Inf) and
    cumulative counts, interpolating linearly inside a bucket; None if it is empty. A rank
    in the +Inf bucket gives the highest finite bound (Prometheus's rule)."""
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    for i, (bound, count) in enumerate(zip(bounds, counts)):
        if count >= rank:
            if math.isinf(bound):
                return bounds[i - 1] if i > 0 else None
            low, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
            if count == below:
                return bound
            return low + (bound - low) * (rank - below) / (count - below)
    return None


def read_samples(registry: CollectorRegistry) -> Samples:
    """Every sample of `registry`: name -> [(labels, value)]."""
    out: Samples = collections.defaultdict(list)
    for family in registry.collect():
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    for got, value in samples.get(PREFIX + name, ()):
        if all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def _histograms(samples: Samples, name: str) -> dict[str, tuple[list[float], list[float]]]:
    """sla_class -> (bounds, cumulative counts) of a per-class histogram."""
    rows: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for labels, value in samples.get(PREFIX + name + "_bucket", ()):
        rows[labels["sla_class"]].append((float(labels["le"]), value))
    return {c: ([b for b, _ in sorted(r)], [v for _, v in sorted(r)]) for c, r in rows.items()}


class DashboardData:
    """Builds the JSON snapshots (thread-safe; any number of pages may poll)."""

    def __init__(self, registry: CollectorRegistry, window_s: float = 60.0) -> None:
        self.registry, self.window_s = registry, window_s
        self._history: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self._lock = threading.Lock()

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        samples = read_samples(self.registry)
        cumulative = {key: _histograms(samples, name) for key, name in _LATENCIES.items()}
        cumulative["prefix"] = (_value(samples, "prefix_cache_hits_total") or 0.0,
                                _value(samples, "prefix_cache_queries_total") or 0.0)
        base = self._baseline(now, cumulative)
        return {
            "time": time.time(),
            "window_s": self.window_s,
            "gauges": {g: _value(samples, g) for g in _GAUGES},
            "latency": {key: self._percentiles(cumulative[key], base.get(key, {}))
                        for key in _LATENCIES},
            "queue": {c: _value(samples, "sla_num_requests_waiting", sla_class=c)
                      for c in SLA_CLASS_RANKS},
            "preemptions_total": {c: _value(samples, "sla_num_preemptions_total", sla_class=c)
                                  for c in SLA_CLASS_RANKS},
            "errors_total": {labels["type"]: v for labels, v in
                             samples.get(PREFIX + "request_errors_total", ())},
            "timeouts_total": {stage: sum(v for labels, v in
                                          samples.get(PREFIX + "request_timeouts_total", ())
                                          if labels["stage"] == stage)
                               for stage in TIMEOUT_STAGES},
            "prefix_cache_hit_rate": _ratio(cumulative["prefix"], base.get("prefix")),
        }

    def _baseline(self, now: float, cumulative: dict[str, Any]) -> dict[str, Any]:
        """The newest snapshot at least `window_s` old ({} if none); records this one."""
        with self._lock:
            history = self._history
            while len(history) > 1 and history[1][0] <= now - self.window_s:
                history.popleft()
            base = history[0][1] if history and history[0][0] <= now - self.window_s else {}
            history.append((now, cumulative))
            return base

    @staticmethod
    def _percentiles(now: dict[str, tuple[list[float], list[float]]],
                     base: dict[str, tuple[list[float], list[float]]]) -> dict[str, Any]:
        out = {}
        for sla_class, (bounds, counts) in now.items():
            before = base.get(sla_class, (bounds, [0.0] * len(counts)))[1]
            delta = [c - b for c, b in zip(counts, before)]
            out[sla_class] = {"p50": bucket_quantile(0.5, bounds, delta),
                              "p99": bucket_quantile(0.99, bounds, delta),
                              "count": delta[-1] if delta else 0.0}
        return out


def _ratio(now: tuple[float, float], base: tuple[float, float] | None) -> float | None:
    hits, queries = now
    if base is not None:
        hits, queries = hits - base[0], queries - base[1]
    return hits / queries if queries > 0 else None
