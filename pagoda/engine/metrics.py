"""Prometheus metrics of the serving engine: vLLM's names under the `pagoda:` prefix, with the
same `model_name` label, so that a vLLM dashboard ports by renaming `vllm:` to `pagoda:`.

The engine's step loop (engine_core.py) feeds every step's DELTA outputs and scheduler
stats (with --engine-process, its calls are replayed in the API process, where this
registry lives: core_process.py); the HTTP layer counts error responses. Counting
rules, exact so that tests can assert them:

| metric                              | observed                                               |
|-------------------------------------|--------------------------------------------------------|
| prompt_tokens_total                 | once per request, at its first output token            |
| generation_tokens_total             | every output token of every sample                     |
| time_to_first_token_seconds         | once per request: arrival -> first token               |
| inter_token_latency_seconds         | each later output of a request that carries tokens:    |
|                                     | time since its previous one (one per token when n = 1) |
| e2e/queue/prefill/decode seconds    | once per request that finished by stop or length       |
| request_success_total{reason}       | once per finished sample (stop, length, abort, error)  |
| num_preemptions, prefix_cache_*     | the scheduler's own counters, mirrored                 |
| prefix_cache_host_hits              | (prefix-cache hit tokens loaded from the host tier, a  |
|                                     | subset of prefix_cache_hits)                           |
| num_swaps                           | (preemptions that swapped, a subset of num_preemptions)|
| sla_first_tokens{sla_class}         | the scheduler's per-class count of first tokens, and   |
| sla_ttft_misses{sla_class}          | of those later than the class's TTFT target, mirrored  |
| sla_time_to_first_token_seconds     | as time_to_first_token_seconds, by the request's class |
|   {sla_class}                       | (the classes' counts add up to the unlabeled series)   |
| sla_request_queue_time_seconds      | as request_queue_time_seconds (requests finished by    |
|   {sla_class}                       | stop or length), by the request's class                |
| sla_num_preemptions{sla_class}      | the scheduler's preemptions by the preempted request's |
|                                     | class, mirrored (they add up to num_preemptions)       |
| http_errors_total{status}           | once per HTTP response with status >= 400              |
| sla_inter_token_latency_seconds     | as inter_token_latency_seconds, by the request's class |
|   {sla_class}                       |                                                        |
| avg_prompt_throughput_toks_per_s,   | prompt_tokens / generation_tokens counted over the     |
| avg_generation_throughput_toks_per_s| last `window_s` seconds, over `window_s` (read time)   |
| avg_request_throughput_per_s        | finished requests (all samples done) likewise          |
| sla_num_requests_waiting{sla_class} | waiting sequences by class, after every engine loop    |
| sla_num_requests_running{sla_class} | running sequences by class, likewise                   |
| num_tokens_running / _waiting       | tokens (prompt + output) of the running sequences; of  |
|                                     | the waiting ones, tokens not yet computed              |
| host_tier_usage_perc,               | fill of the prefix cache's host tier / of the swap     |
| swap_pool_usage_perc                | pool (0..1), mirrored from the scheduler               |
| request_timeouts_total              | once per engine request (one prompt) aborted at its    |
|   {sla_class,stage}                 | deadline; stage = queue (never scheduled) or running   |
| request_errors_total{type}          | once per HTTP request that failed, by OpenAI error     |
|                                     | type (see `error_type`; counted by request_log.py)     |
| tenant_requests_total{tenant},      | per API-key name (never the key): requests, and the    |
| tenant_{prompt,generation}_tokens   | usage tokens of their answers                          |
| spec_decode_num_drafts,             | speculative decoding, the scheduler's counters         |
| spec_decode_num_draft_tokens,       | mirrored: verifications with drafts, drafts verified,  |
| spec_decode_num_accepted_tokens,    | drafts accepted, and accepted drafts by position in    |
| spec_decode_num_accepted_tokens_    | the draft (0-based; a series per position once one     |
|   per_pos{position}                 | was verified)                                          |

Resource gauges (busy fraction, CPU, RSS, GPU) are in resource_metrics.py.
The per-class series are pagoda's own (vLLM has no SLA classes); every class's series
exists from the start, at zero. The class comes from `RequestOutput.metrics.sla_class`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagoda.core.request import SLA_CLASS_RANKS
from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.resource_metrics import DEFAULT_WINDOW_S, ResourceMetrics, SlidingWindow
from pagoda.outputs import RequestOutput

PREFIX = "pagoda:"

# NOTE: roughly log-spaced, from a fast CPU decode step up to minutes-long requests.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 3.0,
                 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.0, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                    45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0)
_FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")
_UNSUCCESSFUL = ("abort", "error", "timeout")
TIMEOUT_STAGES = ("queue", "running")
# request_errors_total's types: OpenAI's error-body names where it has one
# (invalid_request_error, authentication_error, api_error), pagoda's for the rest.
ERROR_TYPES = ("invalid_request_error", "authentication_error", "rate_limit", "timeout",
               "engine_error", "client_disconnect", "api_error")
_ERROR_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                         404: "invalid_request_error", 405: "invalid_request_error",
                         408: "timeout", 413: "invalid_request_error", 422:
                         "invalid_request_error", 429: "rate_limit", 499: "client_disconnect",
                         500: "engine_error", 503: "engine_error"}


def error_type(status: int) -> str:
    """The error type a failed HTTP status counts as (api_error for any other status)."""
    return _ERROR_TYPE_BY_STATUS.get(status, "api_error")


@dataclass(slots=True)
class QueueSnapshot:
    """Sequences by SLA class and their tokens, as `queue_snapshot` counts them."""

    num_waiting: dict[str, int] = field(default_factory=dict)
    num_running: dict[str, int] = field(default_factory=dict)
    num_tokens_running: int = 0
    num_tokens_waiting: int = 0


def queue_snapshot(scheduler: Any) -> QueueSnapshot:
    """Counts the scheduler's `running` and `waiting` requests (engine thread only).

    Running tokens: prompt + output so far (what their KV holds once computed); waiting
    tokens: those not computed yet (a preempted request's recompute included).
    """
    snap = QueueSnapshot()
    for req in scheduler.running:
        snap.num_running[req.sla_class] = snap.num_running.get(req.sla_class, 0) + 1
        snap.num_tokens_running += req.num_tokens
    for req in scheduler.waiting:
        snap.num_waiting[req.sla_class] = snap.num_waiting.get(req.sla_class, 0) + 1
        snap.num_tokens_waiting += req.num_tokens - req.num_computed_tokens
    return snap


@dataclass(slots=True)
class _Tracked:
    """What the metrics remember about one in-flight request."""

    last_token_time: float | None = None
    finished_indices: set[int] = field(default_factory=set)
    aborted: bool = False


class EngineMetrics:
    """All of the server's Prometheus collectors, registered in `registry`.

    Thread-safety: prometheus_client collectors are thread-safe; `_tracked` is touched
    only by the engine thread (observe_* except observe_http_error), or with
    --engine-process only by the event loop, which replays the core's calls.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 device: str = "cpu", window_s: float = DEFAULT_WINDOW_S) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._init_vllm_series()
        self._init_sla_series()
        self._init_pagoda_series(window_s)
        self._init_spec_decode_series()
        self.resources = ResourceMetrics(self.registry, model_name, device, window_s)
        self._tenant_families: tuple[Counter, ...] | None = None
        self._tenant_counters: dict[str, tuple[Counter, ...]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._last_stats: SchedulerStats | None = None

    # ---- registration --------------------------------------------------------------------
    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name"],
                       registry=self.registry).labels(self.model_name)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"],
                     registry=self.registry).labels(self.model_name)

    def _per_class(self, kind: type, name: str, doc: str, **kwargs: Any) -> Any:
        metric = kind(PREFIX + name, doc, ["model_name", "sla_class"], registry=self.registry,
                      **kwargs)
        for sla_class in SLA_CLASS_RANKS:
            metric.labels(self.model_name, sla_class)  # NOTE: every class's series, at zero
        return metric

    def _init_vllm_series(self) -> None:
        """vLLM's series (its names and meanings)."""
        hist, counter, gauge = self._hist, self._counter, self._gauge
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduling.",
                               _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "First scheduling to first token.", _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.",
                                _REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.request_success = {r: success.labels(self.model_name, r) for r in _FINISH_REASONS}
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute and swap).")
        self.num_swaps = counter("num_swaps", "Preemptions that swapped KV to host memory.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.prefix_cache_host_hits = counter(
            "prefix_cache_host_hits",
            "Prompt tokens found in the prefix cache's host tier (part of the hits).")
        self.http_errors = Counter(PREFIX + "http_errors", "HTTP error responses by status.",
                                   ["model_name", "status"], registry=self.registry)
        self.num_running = gauge("num_requests_running", "Sequences running in the engine.")
        self.num_waiting = gauge("num_requests_waiting", "Sequences waiting in the engine.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.num_swapped = gauge("num_requests_swapped", "Sequences swapped out to host memory.")

    def _init_sla_series(self) -> None:
        """pagoda's per-SLA-class series."""
        per_class = self._per_class
        self.sla_first_tokens = per_class(Counter, "sla_first_tokens",
                                          "First tokens by SLA class.")
        self.sla_ttft_misses = per_class(Counter, "sla_ttft_misses",
                                         "First tokens later than their SLA class's TTFT "
                                         "target.")
        self.sla_ttft = per_class(Histogram, "sla_time_to_first_token_seconds",
                                  "Arrival to first token, by SLA class.",
                                  buckets=_TTFT_BUCKETS)
        self.sla_queue_time = per_class(Histogram, "sla_request_queue_time_seconds",
                                        "Arrival to first scheduling, by SLA class.",
                                        buckets=_REQUEST_BUCKETS)
        self.sla_preemptions = per_class(Counter, "sla_num_preemptions",
                                         "Preemptions by the preempted request's SLA class.")
        self.sla_itl = per_class(Histogram, "sla_inter_token_latency_seconds",
                                 "Time between output tokens, by SLA class.",
                                 buckets=_ITL_BUCKETS)
        self.sla_waiting = per_class(Gauge, "sla_num_requests_waiting",
                                     "Sequences waiting in the engine, by SLA class.")
        self.sla_running = per_class(Gauge, "sla_num_requests_running",
                                     "Sequences running in the engine, by SLA class.")

    def _init_pagoda_series(self, window_s: float) -> None:
        """pagoda's own: tokens in the queues, host memory, outcomes, throughput windows."""
        gauge, reg = self._gauge, self.registry
        self.num_tokens_running = gauge("num_tokens_running",
                                        "Tokens (prompt + output) of the running sequences.")
        self.num_tokens_waiting = gauge("num_tokens_waiting",
                                        "Tokens the waiting sequences still have to compute.")
        self.host_tier_usage = gauge("host_tier_usage_perc",
                                     "Fill of the prefix cache's host tier (0..1).")
        self.swap_pool_usage = gauge("swap_pool_usage_perc",
                                     "Fill of the swap preemption's host pool (0..1).")
        self.request_timeouts = Counter(PREFIX + "request_timeouts",
                                        "Requests aborted at their deadline.",
                                        ["model_name", "sla_class", "stage"], registry=reg)
        for sla_class in SLA_CLASS_RANKS:
            for stage in TIMEOUT_STAGES:
                self.request_timeouts.labels(self.model_name, sla_class, stage)
        errors = Counter(PREFIX + "request_errors", "Failed HTTP requests by error type.",
                         ["model_name", "type"], registry=reg)
        self.request_errors = {t: errors.labels(self.model_name, t) for t in ERROR_TYPES}
        self.window_s = window_s
        self._windows = {name: SlidingWindow(window_s) for name in ("prompt", "gen", "req")}
        for name, key, doc in (
                ("avg_prompt_throughput_toks_per_s", "prompt", "Prompt tokens per second."),
                ("avg_generation_throughput_toks_per_s", "gen", "Generated tokens per second."),
                ("avg_request_throughput_per_s", "req", "Finished requests per second.")):
            gauge(name, f"{doc} (sliding window of {window_s:g} s)").set_function(
                self._windows[key].rate)

    def _init_spec_decode_series(self) -> None:
        """vLLM's speculative-decoding counters."""
        counter = self._counter
        self.spec_decode_counters = {
            "spec_decode_num_drafts": counter("spec_decode_num_drafts",
                                              "Verifications of draft tokens."),
            "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens",
                                                    "Draft tokens verified."),
            "spec_decode_num_accepted_tokens": counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted."),
        }
        self.spec_decode_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.", ["model_name", "position"],
            registry=self.registry)

    def _observe_spec_decode(self, stats: SchedulerStats, last: SchedulerStats | None) -> None:
        for name, counter in self.spec_decode_counters.items():
            delta = getattr(stats, name) - (getattr(last, name) if last else 0)
            if delta > 0:
                counter.inc(delta)
        before = last.spec_decode_num_accepted_tokens_per_pos if last else []
        for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            series = self.spec_decode_accepted_per_pos.labels(self.model_name, str(pos))
            delta = count - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                series.inc(delta)

    # ---- engine thread -----------------------------------------------------------------
    def observe_outputs(self, outputs: Iterable[RequestOutput], now: float | None = None) -> None:
        """Per-request latencies and token counts from one step's DELTA outputs."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            num_new = sum(len(c.token_ids) for c in out.outputs)
            tracked = self._tracked.setdefault(out.request_id, _Tracked())
            if num_new:
                self.generation_tokens.inc(num_new)
                self._windows["gen"].add(num_new, now)
                if tracked.last_token_time is None:
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self._windows["prompt"].add(len(out.prompt_token_ids), now)
                    m = out.metrics
                    first = m.first_token_time if m and m.first_token_time else now
                    if m is not None:
                        ttft = max(first - m.arrival_time, 0.0)
                        self.ttft.observe(ttft)
                        self.sla_ttft.labels(self.model_name, m.sla_class).observe(ttft)
                else:
                    itl = max(now - tracked.last_token_time, 0.0)
                    self.itl.observe(itl)
                    if out.metrics is not None:
                        self.sla_itl.labels(self.model_name, out.metrics.sla_class).observe(itl)
                tracked.last_token_time = now
            for c in out.outputs:
                # NOTE: a DELTA output may repeat a sample that finished earlier (n > 1);
                # each sample's finish counts once.
                if c.finish_reason is not None and c.index not in tracked.finished_indices:
                    tracked.finished_indices.add(c.index)
                    tracked.aborted |= c.finish_reason in _UNSUCCESSFUL
                    self._count_finish(c.finish_reason)
            if out.finished:
                self._windows["req"].add(1, now)
                self._tracked.pop(out.request_id, None)
                if not tracked.aborted:
                    self._observe_request_times(out, now)

    def observe_error(self, request_id: str, num_samples: int) -> None:
        """A request that an engine fault ended: its `num_samples` unfinished samples count
        as `error`."""
        self._tracked.pop(request_id, None)
        self.request_success["error"].inc(num_samples)

    def observe_stats(self, stats: SchedulerStats) -> None:
        """Gauges from the scheduler; counters advance by the scheduler's own deltas."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.num_swapped.set(stats.num_swapped)
        self.host_tier_usage.set(stats.host_tier_usage)
        self.swap_pool_usage.set(stats.host_cache_usage)
        last = self._last_stats
        for counter, name in ((self.num_preemptions, "num_preemptions"),
                              (self.num_swaps, "num_swaps"),
                              (self.prefix_cache_queries, "prefix_cache_queries"),
                              (self.prefix_cache_hits, "prefix_cache_hits"),
                              (self.prefix_cache_host_hits, "prefix_cache_host_hits")):
            delta = getattr(stats, name) - (getattr(last, name) if last else 0)
            if delta > 0:
                counter.inc(delta)
        for counter, name in ((self.sla_first_tokens, "sla_first_tokens"),
                              (self.sla_ttft_misses, "sla_ttft_misses"),
                              (self.sla_preemptions, "sla_preemptions")):
            before = getattr(last, name) if last else {}
            for sla_class, count in getattr(stats, name).items():
                delta = count - before.get(sla_class, 0)
                if delta > 0:
                    counter.labels(self.model_name, sla_class).inc(delta)
        self._observe_spec_decode(stats, last)
        self._last_stats = stats

    def observe_queues(self, queues: QueueSnapshot) -> None:
        """Per-class queue depths and token counts, after an engine loop iteration."""
        for sla_class in SLA_CLASS_RANKS:
            self.sla_waiting.labels(self.model_name, sla_class).set(
                queues.num_waiting.get(sla_class, 0))
            self.sla_running.labels(self.model_name, sla_class).set(
                queues.num_running.get(sla_class, 0))
        self.num_tokens_running.set(queues.num_tokens_running)
        self.num_tokens_waiting.set(queues.num_tokens_waiting)

    def observe_step(self, duration_s: float) -> None:
        """One engine step took `duration_s` (the busy fraction's input)."""
        self.resources.observe_step(duration_s)

    def observe_timeout(self, sla_class: str, stage: str) -> None:
        self.request_timeouts.labels(self.model_name, sla_class, stage).inc()

    # ---- HTTP layer ----------------------------------------------------------------------
    def observe_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def observe_request_error(self, type_: str) -> None:
        self.request_errors[type_ if type_ in self.request_errors else "api_error"].inc()

    def add_tenants(self, names: Iterable[str]) -> None:
        """Creates the per-tenant series (at zero) for these API-key names."""
        labels = ["model_name", "tenant"]
        if self._tenant_families is None:
            self._tenant_families = tuple(
                Counter(PREFIX + name, doc, labels, registry=self.registry)
                for name, doc in (("tenant_requests", "Requests by API-key name."),
                                  ("tenant_prompt_tokens", "Prompt tokens by API-key name."),
                                  ("tenant_generation_tokens",
                                   "Generated tokens by API-key name.")))
        for name in names:
            self._tenant_counters[name] = tuple(
                f.labels(self.model_name, name) for f in self._tenant_families)

    def observe_tenant(self, tenant: str, num_prompt: int, num_generation: int) -> None:
        counters = self._tenant_counters.get(tenant)
        if counters is not None:
            counters[0].inc()
            counters[1].inc(num_prompt)
            counters[2].inc(num_generation)

    def _count_finish(self, reason: str) -> None:
        counter = self.request_success.get(reason)
        if counter is not None:
            counter.inc()

    def _observe_request_times(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        if m is None:
            return
        finished = m.finished_time or now
        self.e2e.observe(max(finished - m.arrival_time, 0.0))
        if m.first_scheduled_time is not None:
            queue_time = max(m.first_scheduled_time - m.arrival_time, 0.0)
            self.queue_time.observe(queue_time)
            self.sla_queue_time.labels(self.model_name, m.sla_class).observe(queue_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        if m.first_token_time is not None:
            self.decode_time.observe(max(finished - m.first_token_time, 0.0))
