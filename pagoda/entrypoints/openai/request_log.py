"""One record per HTTP request: its id (`X-Request-Id`), tenant, tokens, TTFT, end-to-end
time, finish reasons and error type; counted into the error and tenant metrics once the
response has ended, and written as one JSON log line under `--log-format json`.

The `RequestObserver` middleware (outermost) opens the record and makes it the current
one (a context variable, so the handler and its streaming body reach it); the handler's
OutputStream feeds it every engine output (`observe`); failures that do not show in the
status code (a stream that ends in an engine error, a timeout or a lost client) are noted
with `note_error`. Error type: the first one noted, else the one of the status code.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.engine.metrics import EngineMetrics, error_type
from pagoda.entrypoints.openai.tenants import APIKeys
from pagoda.outputs import RequestOutput

request_logger = logging.getLogger("pagoda.request")
_MAX_REQUEST_ID_LEN = 128
# NOTE: monitoring routes are polled every second or so; a line each would bury the rest.
_UNLOGGED_PREFIXES = ("/metrics", "/health", "/dashboard")
_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "pagoda_request_record", default=None)


# The routes whose requests go to the engine: counted in `Arrivals` until they do.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class Arrivals:
    """Generation requests received and not yet handed to the engine (or failed first);
    an add tells the engine how many others are still coming (engine_core.py: an idle
    engine gathers a burst into one step). Event-loop state: no lock."""

    pending: int = 0


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    start: float
    tenant: str | None = None
    status: int | None = None
    sla_class: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error_type: str | None = None
    finish_reasons: dict[tuple[str, int], str] = field(default_factory=dict)
    _prompts_seen: set[str] = field(default_factory=set)
    arrivals: Arrivals | None = None  # counted there until leave_arrivals()

    def leave_arrivals(self) -> int:
        """Stops counting this request as arriving (once); the others still arriving."""
        if self.arrivals is None:
            return 0
        self.arrivals.pending -= 1
        others, self.arrivals = self.arrivals.pending, None
        return others

    def observe(self, out: RequestOutput) -> None:
        """Counts one engine output of this request (on the event loop)."""
        if out.request_id not in self._prompts_seen:
            self._prompts_seen.add(out.request_id)
            self.prompt_tokens += len(out.prompt_token_ids)
            if out.metrics is not None:
                self.sla_class = out.metrics.sla_class
        num_new = sum(len(c.token_ids) for c in out.outputs)
        self.completion_tokens += num_new
        if num_new and self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.start
        for c in out.outputs:
            if c.finish_reason is not None:
                self.finish_reasons[(out.request_id, c.index)] = c.finish_reason
                if c.finish_reason == "timeout":
                    self.fail("timeout")

    def fail(self, type_: str) -> None:
        if self.error_type is None:
            self.error_type = type_

    def as_log(self) -> dict[str, Any]:
        reasons = [r for _, r in sorted(self.finish_reasons.items())]
        return {"request_id": self.request_id, "method": self.method, "path": self.path,
                "status": self.status, "tenant": self.tenant, "sla_class": self.sla_class,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "ttft_s": self.ttft_s,
                "e2e_s": self.e2e_s,
                "finish_reason": reasons[0] if len(reasons) == 1 else (reasons or None),
                "error_type": self.error_type}


def current_record() -> RequestRecord | None:
    return _current.get()


def note_error(type_: str) -> None:
    """Marks the current HTTP request failed with `type_` (if nothing was noted before)."""
    record = _current.get()
    if record is not None:
        record.fail(type_)


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id if it is printable ASCII of at most 128 characters, else a
    fresh one."""
    for name, value in scope.get("headers") or []:
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= _MAX_REQUEST_ID_LEN and text.isascii() and text.isprintable():
                return text
    return uuid.uuid4().hex


class RequestObserver:
    """ASGI middleware: the request record (see the module docstring), the X-Request-Id
    response header, and at the end the error / tenant counters and the log line."""

    def __init__(self, app: ASGIApp, metrics: EngineMetrics, api_keys: APIKeys,
                 tenant_prefixes: tuple[str, ...], log_requests: bool,
                 arrivals: Arrivals | None = None) -> None:
        self.app, self.metrics, self.api_keys = app, metrics, api_keys
        self.arrivals = arrivals
        self.tenant_prefixes = tenant_prefixes
        self.log_requests = log_requests
        if api_keys:
            metrics.add_tenants(api_keys.names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        record = RequestRecord(_request_id(scope), scope["method"], path, time.monotonic())
        if self.api_keys and path.startswith(self.tenant_prefixes):
            record.tenant = self.api_keys.tenant_of(scope)
        header = (b"x-request-id", record.request_id.encode())
        if self.arrivals is not None and scope["method"] == "POST" and path in GENERATION_PATHS:
            self.arrivals.pending += 1
            record.arrivals = self.arrivals

        async def observing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if record.status >= 400:
                    record.fail(error_type(record.status))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, observing_send)
        finally:
            _current.reset(token)
            record.leave_arrivals()  # NOTE: refused or failed before it reached the engine
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        record.e2e_s = time.monotonic() - record.start
        if record.status is None:
            record.fail("api_error")  # NOTE: the app raised before answering.
        if record.error_type is not None:
            self.metrics.observe_request_error(record.error_type)
        if record.tenant is not None:
            self.metrics.observe_tenant(record.tenant, record.prompt_tokens,
                                        record.completion_tokens)
        if self.log_requests and not record.path.startswith(_UNLOGGED_PREFIXES):
            request_logger.info("request", extra={"request": record.as_log()})


class JsonFormatter(logging.Formatter):
    """One JSON object per log record: time, level, logger, message, and a request
    record's fields when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        payload: dict[str, Any] = {"time": ts.isoformat(timespec="milliseconds"),
                                   "level": record.levelname, "logger": record.name,
                                   "message": record.getMessage()}
        payload.update(getattr(record, "request", None) or {})
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False, default=str)


def configure_logging(log_format: str) -> None:
    """Root logging at INFO, as text or as JSON lines (`--log-format`)."""
    if log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
