"""request_log.py: a record counts tokens, TTFT and finish reasons from engine outputs; the
first error noted wins; X-Request-Id is taken only when sane; JSON log lines."""

from __future__ import annotations

import json
import logging

from pagoda.entrypoints.openai.request_log import JsonFormatter, RequestRecord, _request_id
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput


def out(rid: str, index: int, num: int, reason: str | None) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(index, "x", [5] * num,
                                                                 finish_reason=reason)],
                         reason is not None, metrics=RequestMetrics(0.0, sla_class="async"))


def test_record_counts_outputs() -> None:
    rec = RequestRecord("r", "POST", "/v1/completions", start=0.0)
    rec.observe(out("p0", 0, 0, None))
    assert rec.ttft_s is None and rec.prompt_tokens == 3 and rec.sla_class == "async"
    rec.observe(out("p0", 0, 2, None))
    assert rec.ttft_s is not None
    rec.observe(out("p1", 0, 1, "length"))
    rec.observe(out("p0", 0, 1, "timeout"))
    assert (rec.prompt_tokens, rec.completion_tokens) == (6, 4)
    assert rec.error_type == "timeout"
    rec.fail("client_disconnect")
    log = rec.as_log()
    assert log["error_type"] == "timeout" and log["finish_reason"] == ["timeout", "length"]


def test_request_id_header() -> None:
    def scope(value: bytes | None) -> dict:
        return {"headers": [] if value is None else [(b"x-request-id", value)]}

    assert _request_id(scope(b"abc-1")) == "abc-1"
    for bad in (None, b"", b"x" * 129, "é".encode("latin-1"), b"a\tb"):
        got = _request_id(scope(bad))
        assert len(got) == 32 and int(got, 16) >= 0


def test_json_formatter() -> None:
    record = logging.LogRecord("pagoda.request", logging.INFO, __file__, 1, "request", None,
                               None)
    record.request = {"request_id": "r", "ttft_s": 0.5}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request" and line["level"] == "INFO"
    assert line["request_id"] == "r" and line["ttft_s"] == 0.5 and "T" in line["time"]
