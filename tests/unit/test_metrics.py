"""EngineMetrics counts exactly what its docstring table says, from synthetic outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.metrics import EngineMetrics, error_type, queue_snapshot
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput


def delta(req_id: str, samples: list[tuple[int, int, str | None]], finished: bool,
          metrics: RequestMetrics, prompt_len: int = 4) -> RequestOutput:
    """samples: (index, number of new tokens, finish_reason)."""
    outs = [CompletionOutput(index=i, text="x" * k, token_ids=[7] * k, finish_reason=r)
            for i, k, r in samples]
    return RequestOutput(req_id, None, list(range(prompt_len)), outs, finished,
                         metrics=metrics)


def value(m: EngineMetrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if got is None else got


def test_one_request_lifecycle() -> None:
    m = EngineMetrics("m")
    rm = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5)
    rm.first_token_time = 11.0
    m.observe_outputs([delta("a", [(0, 1, None)], False, rm)], now=11.0)
    m.observe_outputs([delta("a", [(0, 1, None)], False, rm)], now=11.25)
    rm.finished_time = 11.5
    m.observe_outputs([delta("a", [(0, 1, "length")], True, rm)], now=11.5)
    assert value(m, "pagoda:prompt_tokens_total") == 4
    assert value(m, "pagoda:generation_tokens_total") == 3
    assert value(m, "pagoda:time_to_first_token_seconds_count") == 1
    assert value(m, "pagoda:time_to_first_token_seconds_sum") == 1.0
    assert value(m, "pagoda:inter_token_latency_seconds_count") == 2
    assert value(m, "pagoda:inter_token_latency_seconds_sum") == 0.5
    assert value(m, "pagoda:e2e_request_latency_seconds_sum") == 1.5
    assert value(m, "pagoda:request_queue_time_seconds_sum") == 0.5
    assert value(m, "pagoda:request_prefill_time_seconds_sum") == 0.5
    assert value(m, "pagoda:request_decode_time_seconds_sum") == 0.5
    assert value(m, "pagoda:request_success_total", finished_reason="length") == 1
    assert not m._tracked


def test_n_samples_count_each_finish_once_and_aborts_skip_latencies() -> None:
    m = EngineMetrics("m")
    rm = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0)
    m.observe_outputs([delta("b", [(0, 1, "stop"), (1, 1, None)], False, rm)], now=1.0)
    # NOTE: a DELTA output may repeat the sample that finished earlier.
    m.observe_outputs([delta("b", [(0, 0, "stop"), (1, 1, "length")], True, rm)], now=2.0)
    assert value(m, "pagoda:request_success_total", finished_reason="stop") == 1
    assert value(m, "pagoda:request_success_total", finished_reason="length") == 1
    assert value(m, "pagoda:e2e_request_latency_seconds_count") == 1
    m.observe_outputs([delta("c", [(0, 2, None)], False, rm)], now=3.0)
    m.observe_outputs([delta("c", [(0, 0, "abort")], True, rm)], now=4.0)
    assert value(m, "pagoda:request_success_total", finished_reason="abort") == 1
    assert value(m, "pagoda:e2e_request_latency_seconds_count") == 1
    m.observe_error("d", 2)
    assert value(m, "pagoda:request_success_total", finished_reason="error") == 2
    assert value(m, "pagoda:generation_tokens_total") == 5


def test_stats_gauges_and_counter_deltas() -> None:
    m = EngineMetrics("m")
    def stats(running: int, waiting: int, usage: float, preempted: int, queries: int,
              hits: int) -> SchedulerStats:
        return SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                              num_preemptions=preempted, prefix_cache_queries=queries,
                              prefix_cache_hits=hits)

    m.observe_stats(stats(3, 2, 0.25, 1, 100, 40))
    m.observe_stats(stats(0, 0, 0.0, 4, 150, 60))
    assert value(m, "pagoda:num_requests_running") == 0
    assert value(m, "pagoda:num_requests_waiting") == 0
    assert value(m, "pagoda:kv_cache_usage_perc") == 0
    assert value(m, "pagoda:num_preemptions_total") == 4
    assert value(m, "pagoda:prefix_cache_queries_total") == 150
    assert value(m, "pagoda:prefix_cache_hits_total") == 60
    m.observe_http_error(429)
    assert m.registry.get_sample_value("pagoda:http_errors_total",
                                       {"model_name": "m", "status": "429"}) == 1
    text = generate_latest(m.registry).decode()
    assert 'pagoda:kv_cache_usage_perc{model_name="m"}' in text


def test_per_class_ttft_and_queue_time() -> None:
    """Each request counts in its own class's series, as in the unlabeled ones; the other
    classes' series exist at zero."""
    m = EngineMetrics("m")
    batch = RequestMetrics(arrival_time=0.0, first_scheduled_time=2.0, first_token_time=3.0,
                           sla_class="batch")
    inter = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=1.5)
    assert inter.sla_class == "interactive"
    m.observe_outputs([delta("i", [(0, 1, None)], False, inter)], now=1.5)
    m.observe_outputs([delta("b", [(0, 1, None)], False, batch),
                       delta("i", [(0, 1, "length")], True, inter)], now=3.0)
    # NOTE: b finished by abort: its TTFT counts, its queue time does not (as unlabeled).
    m.observe_outputs([delta("b", [(0, 1, "abort")], True, batch)], now=4.0)
    m.observe_outputs([delta("b2", [(0, 2, "stop")], True, batch)], now=4.0)

    def cls(name: str, sla_class: str) -> float:
        return value(m, f"pagoda:{name}", sla_class=sla_class)

    assert cls("sla_time_to_first_token_seconds_count", "interactive") == 1
    assert cls("sla_time_to_first_token_seconds_sum", "interactive") == 0.5
    assert cls("sla_time_to_first_token_seconds_count", "batch") == 2
    assert cls("sla_time_to_first_token_seconds_sum", "batch") == 6.0
    assert cls("sla_request_queue_time_seconds_count", "interactive") == 1
    assert cls("sla_request_queue_time_seconds_sum", "interactive") == 0.25
    assert cls("sla_request_queue_time_seconds_count", "batch") == 1
    assert cls("sla_request_queue_time_seconds_sum", "batch") == 2.0
    assert value(m, "pagoda:time_to_first_token_seconds_count") == 3
    assert value(m, "pagoda:request_queue_time_seconds_count") == 2
    assert value(m, "pagoda:request_queue_time_seconds_sum") == 2.25
    # Buckets: the interactive TTFT (0.5 s) is in le=0.5, the batch ones (3 s) are not.
    le = {"model_name": "m", "sla_class": "interactive", "le": "0.5"}
    assert m.registry.get_sample_value("pagoda:sla_time_to_first_token_seconds_bucket", le) == 1
    le["sla_class"] = "batch"
    assert m.registry.get_sample_value("pagoda:sla_time_to_first_token_seconds_bucket", le) == 0
    assert m.registry.get_sample_value(
        "pagoda:sla_time_to_first_token_seconds_count",
        {"model_name": "m", "sla_class": "async"}) == 0
    text = generate_latest(m.registry).decode()
    assert 'pagoda:sla_num_preemptions_total{model_name="m",sla_class="async"} 0.0' in text


def test_per_class_preemptions_follow_scheduler_deltas() -> None:
    m = EngineMetrics("m")

    def stats(preempted: int, by_class: dict[str, int]) -> SchedulerStats:
        return SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                              num_preemptions=preempted, prefix_cache_queries=0,
                              prefix_cache_hits=0, sla_preemptions=by_class)

    m.observe_stats(stats(2, {"batch": 2}))
    m.observe_stats(stats(5, {"batch": 4, "interactive": 1}))
    m.observe_stats(stats(5, {"batch": 4, "interactive": 1}))
    assert value(m, "pagoda:sla_num_preemptions_total", sla_class="batch") == 4
    assert value(m, "pagoda:sla_num_preemptions_total", sla_class="interactive") == 1
    assert value(m, "pagoda:sla_num_preemptions_total", sla_class="async") == 0
    assert value(m, "pagoda:num_preemptions_total") == 5
def test_prefix_cache_host_hits_counter_follows_the_scheduler() -> None:
    m = EngineMetrics("m")
    for host_hits in (0, 32, 48, 48):
        m.observe_stats(SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                       num_preemptions=0, prefix_cache_queries=100,
                                       prefix_cache_hits=64, prefix_cache_host_hits=host_hits))
    assert value(m, "pagoda:prefix_cache_host_hits_total") == 48
    assert value(m, "pagoda:prefix_cache_hits_total") == 64


def test_timeouts_errors_windows_and_per_class_itl() -> None:
    m = EngineMetrics("m", window_s=10.0)
    rm = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0,
                        sla_class="batch")
    m.observe_outputs([delta("t", [(0, 2, None)], False, rm)], now=1.0)
    m.observe_outputs([delta("t", [(0, 1, None)], False, rm)], now=1.5)
    m.observe_outputs([delta("t", [(0, 0, "timeout")], True, rm)], now=2.0)
    m.observe_timeout("batch", "running")
    assert value(m, "pagoda:request_success_total", finished_reason="timeout") == 1
    assert value(m, "pagoda:e2e_request_latency_seconds_count") == 0  # NOTE: not a success
    assert value(m, "pagoda:request_timeouts_total", sla_class="batch", stage="running") == 1
    assert value(m, "pagoda:request_timeouts_total", sla_class="batch", stage="queue") == 0
    assert value(m, "pagoda:sla_inter_token_latency_seconds_sum", sla_class="batch") == 0.5
    assert value(m, "pagoda:sla_inter_token_latency_seconds_count", sla_class="async") == 0
    gen = m._windows["gen"]
    assert gen.rate(now=5.0) == pytest.approx(0.3) and gen.rate(now=12.0) == 0.0
    assert m._windows["req"].total(now=5.0) == 1
    assert m._windows["prompt"].total(now=5.0) == 4
    for status, type_ in ((400, "invalid_request_error"), (401, "authentication_error"),
                          (408, "timeout"), (429, "rate_limit"), (499, "client_disconnect"),
                          (500, "engine_error"), (503, "engine_error"), (418, "api_error")):
        assert error_type(status) == type_
    m.observe_request_error("rate_limit")
    m.observe_request_error("no such type")
    assert value(m, "pagoda:request_errors_total", type="rate_limit") == 1
    assert value(m, "pagoda:request_errors_total", type="api_error") == 1
    m.add_tenants(["alice"])
    m.observe_tenant("alice", 5, 7)
    m.observe_tenant("mallory", 1, 1)  # NOTE: unknown names make no series
    assert value(m, "pagoda:tenant_requests_total", tenant="alice") == 1
    assert value(m, "pagoda:tenant_generation_tokens_total", tenant="alice") == 7
    assert m.registry.get_sample_value("pagoda:tenant_requests_total",
                                       {"model_name": "m", "tenant": "mallory"}) is None

    def req(sla_class: str, num_tokens: int, num_computed: int) -> SimpleNamespace:
        return SimpleNamespace(sla_class=sla_class, num_tokens=num_tokens,
                               num_computed_tokens=num_computed)

    scheduler = SimpleNamespace(running=[req("interactive", 10, 9)],
                                waiting=[req("batch", 8, 0), req("batch", 6, 4)])
    m.observe_queues(queue_snapshot(scheduler))
    assert value(m, "pagoda:sla_num_requests_waiting", sla_class="batch") == 2
    assert value(m, "pagoda:sla_num_requests_waiting", sla_class="interactive") == 0
    assert value(m, "pagoda:sla_num_requests_running", sla_class="interactive") == 1
    assert value(m, "pagoda:num_tokens_running") == 10
    assert value(m, "pagoda:num_tokens_waiting") == 10


def test_spec_decode_counters_follow_the_scheduler() -> None:
    m = EngineMetrics("m")
    for drafts, tokens, accepted, per_pos in ((0, 0, 0, [0, 0]), (2, 7, 5, [2, 2]),
                                              (3, 9, 6, [3, 2]), (3, 9, 6, [3, 2])):
        m.observe_stats(SchedulerStats(
            num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0,
            prefix_cache_queries=0, prefix_cache_hits=0, spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=tokens, spec_decode_num_accepted_tokens=accepted,
            spec_decode_num_accepted_tokens_per_pos=per_pos))
    assert value(m, "pagoda:spec_decode_num_drafts_total") == 3
    assert value(m, "pagoda:spec_decode_num_draft_tokens_total") == 9
    assert value(m, "pagoda:spec_decode_num_accepted_tokens_total") == 6
    assert value(m, "pagoda:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert value(m, "pagoda:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
