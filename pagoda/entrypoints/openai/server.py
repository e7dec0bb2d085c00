"""The OpenAI-compatible HTTP server: app, routes, error bodies, start-up and shutdown.

Every error is an OpenAI body `{"error": {"message", "type", "param", "code"}}`: 400 for
invalid input (malformed JSON and wrong types included), 401 without the API key, 404 for
an unknown model or route, 408 when a deadline (--request-timeout, --sla-max-queue-time)
aborted a non-streamed request, 413 for an oversized body, 429 (with Retry-After) when the
waiting queue is full, 500 only for an engine fault (in a stream: an error event, then
`[DONE]`), 503 when the engine thread is gone. /openapi.json documents these, not
FastAPI's 422. Unexpected exceptions answer 500 and keep the connection open; the server
stays up. SIGTERM: stop accepting, let in-flight requests finish within
--shutdown-timeout, then answer each one left with a 503 of type "service_unavailable"
(in a stream: an error event, then `[DONE]`), abort them, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagoda
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.core_client import EngineCoreClient
from pagoda.engine.deadlines import DeadlineTracker, TimeoutPolicy
from pagoda.engine.llm_engine import MAX_LOGPROBS
from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.openai.dashboard import add_dashboard_routes
from pagoda.entrypoints.openai.debug import add_debug_routes
from pagoda.entrypoints.openai.openapi import ERROR_REF, openapi_schema
from pagoda.entrypoints.openai.prompt_limits import default_body_bytes
from pagoda.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    error_body,
)
from pagoda.entrypoints.openai.request_log import RequestObserver, configure_logging
from pagoda.entrypoints.openai.serving import ServerState
from pagoda.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.tenants import APIKeys, parse_api_keys

logger = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/debug")
_TENANT_PREFIXES = ("/v1", "/tokenize", "/detokenize")  # what tenants' counts cover
# Seconds past --shutdown-timeout before uvicorn cancels what has still not answered.
_SHUTDOWN_BACKSTOP_S = 5.0


def create_app(state: ServerState, api_key: str | None = None,
               max_body_bytes: int | None = None, enable_dashboard: bool = True,
               log_requests: bool = False) -> FastAPI:
    """The ASGI app over `state`; starts the engine thread on start-up, stops it on exit.

    `api_key`: one key or `NAME=KEY,...` (tenants.py); `max_body_bytes` None: proportionate
    to max_model_len (prompt_limits.py); `log_requests`: one log record per request
    (request_log.py)."""
    if max_body_bytes is None:
        max_body_bytes = default_body_bytes(state.max_prompt_chars, state.max_model_len)
    api_keys = APIKeys(parse_api_keys(api_key))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()

    app = FastAPI(title="pagoda", version=pagoda.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.pagoda = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    if enable_dashboard:
        add_dashboard_routes(app, state.metrics)
    # NOTE: added first, so innermost: HTTPGuard counts the 500s it sends.
    app.add_middleware(InternalErrorGuard)
    app.add_middleware(HTTPGuard, state=state, api_keys=api_keys, max_body_bytes=max_body_bytes)
    # NOTE: added last, so outermost: it sees the guard's 401 / 413 answers too.
    app.add_middleware(RequestObserver, metrics=state.metrics, api_keys=api_keys,
                       tenant_prefixes=_TENANT_PREFIXES, log_requests=log_requests,
                       arrivals=state.arrivals)
    return app


def _error(status: int, message: str, param: str | None = None,
           headers: dict[str, str] | None = None, error_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, error_type), status_code=status,
                        headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.headers, exc.error_type)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg', '')}")
        if first.get("type") == "lone_surrogate":
            return _error(400, first["msg"], first["ctx"]["param"])
        where = ".".join(loc) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}",
                      loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)


class InternalErrorGuard:
    """ASGI middleware: an unexpected exception answers 500 with the OpenAI body, and the
    connection stays open for the client's next request.

    NOTE: Starlette's own catch-all (ServerErrorMiddleware) answers and then re-raises,
    and uvicorn closes a connection whose app raised: a keep-alive client's next request
    on it failed with a connection reset. Here the exception ends with the answer. One
    raised after the response started cannot be answered; it propagates (the body is
    incomplete, so closing the connection is then the only honest end).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error")
            await _send_error(send, 500, f"internal error: {type(exc).__name__}: {exc}")


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=Response,
             responses={200: {"description": "the engine is running (empty body)"},
                        503: {"description": "the engine is not running",
                              "content": {"application/json": {"schema": ERROR_REF}}}})
    async def health() -> Response:
        if not state.engine.is_alive:
            return _error(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagoda.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "pagoda",
                 "root": state.model_root, "parent": None, "max_model_len": state.max_model_len}
                for name in state.model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        try:
            if body.messages is not None:
                messages = [m.to_template_dict() for m in body.messages]
                ids = await chat_prompt_ids(state, messages, body.add_generation_prompt)
            else:
                ids = await state.encode(body.prompt, "prompt", body.add_special_tokens)
        except ValueError as e:
            raise bad_request(e) from e
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary "
                           f"(size {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    if state.enable_debug:
        add_debug_routes(app, state)


class HTTPGuard:
    """ASGI middleware: API key, body size limit (413), and the HTTP error counter.

    NOTE: the body is read here, up to the limit, and replayed to the app; a chunked body
    that turns out too large is refused before the app sees any of it.
    """

    def __init__(self, app: ASGIApp, state: ServerState, api_keys: APIKeys,
                 max_body_bytes: int) -> None:
        self.app = app
        self.metrics = state.metrics
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.observe_http_error(message["status"])
            await send(message)

        protected = scope["path"].startswith(_PROTECTED_PREFIXES)
        if self.api_keys and protected and self.api_keys.tenant_of(scope) is None:
            await _send_error(counting_send, 401, "missing or wrong API key "
                              "(send 'Authorization: Bearer <key>')")
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(counting_send, 413, self._too_large())
            return
        body, message = await self._read_body(receive)
        if body is None:
            await _send_error(counting_send, 413, self._too_large())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, counting_send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes"

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, Message]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", message  # NOTE: a disconnect: let the app see it.
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, message
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                return body, {"type": "http.request", "body": body, "more_body": False}


async def _send_error(send: Send, status: int, message: str) -> None:
    response = _error(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


# ---- start-up ------------------------------------------------------------------------------
def _load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def build_state(args: argparse.Namespace) -> ServerState:
    """Loads the model and wires engine, metrics and settings together (no server yet)."""
    from dataclasses import replace

    from pagoda.config import EngineArgs

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    chat_template = _load_chat_template(args.chat_template)
    config = replace(EngineArgs.from_cli_args(args), model=model).create_engine_config()
    policy = TimeoutPolicy(args.request_timeout, dict(args.sla_max_queue_time))
    async_engine = _start_engine(args, config, policy)
    engine = async_engine.engine
    path = Path(engine.model_path)
    names = args.served_model_name or [model or (path.stem if path.suffix == ".gguf" else
                                                 path.name)]
    device = str(engine.device)
    metrics = async_engine.metrics = EngineMetrics(names[0], device=device)
    if args.engine_process:
        metrics.resources.watch_process(async_engine.process.pid)
    return ServerState(
        engine=async_engine,
        tokenizer=engine.tokenizer, model_names=names, model_root=engine.model_path,
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, metrics=metrics,
        chat_template=chat_template, max_logprobs=args.max_logprobs,
        enable_debug=args.enable_debug_endpoints,
    )


def _start_engine(args: argparse.Namespace, config: Any, policy: TimeoutPolicy) -> Any:
    """The engine's front end, its model loaded: in a child process with --engine-process,
    the default (this process keeps HTTP and tokenization), else on an engine thread of
    this one."""
    from pagoda.engine.llm_engine import LLMEngine

    if args.engine_process:
        return EngineCoreClient.spawn(
            partial(LLMEngine, config), policy, max_queued_requests=args.max_queued_requests,
            setup=partial(configure_logging, args.log_format))
    # NOTE: the model loads on the engine thread (see AsyncLLMEngine.build); the metrics,
    # which need the served name, are attached before the thread starts stepping.
    async_engine = AsyncLLMEngine.build(
        lambda: LLMEngine(config), max_queued_requests=args.max_queued_requests
    )
    if policy.enabled:
        async_engine.deadlines = DeadlineTracker(policy)
    return async_engine


def run_server(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or Ctrl-C; returns 0 after a graceful shutdown."""
    configure_logging(args.log_format)
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY") or None
    parse_api_keys(api_key)  # NOTE: a malformed key list fails before the model loads
    state = build_state(args)
    json_logs = args.log_format == "json"
    app = create_app(state, api_key, args.max_request_body_bytes,
                     enable_dashboard=not args.disable_dashboard, log_requests=json_logs)
    # NOTE: in JSON mode uvicorn's loggers keep no handlers of their own: theirs would
    # write text; they propagate to the root's JSON handler instead.
    log_config = {"version": 1, "disable_existing_loggers": False} if json_logs else (
        uvicorn.config.LOGGING_CONFIG)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout + _SHUTDOWN_BACKSTOP_S,
        log_config=log_config,
    )
    server = _GracefulServer(config, state, args.shutdown_timeout)
    # NOTE: uvicorn re-raises the signal it shut down on, once it has restored the handlers
    # it found; with no-op handlers in place a graceful shutdown exits 0, not 128 + signum.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s on http://%s:%d", state.model_names, args.host, args.port)
    server.run()
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, ending the shutdown grace itself: once `grace_s` has passed, every
    request still unanswered is failed with a 503 (AsyncLLMEngine.end_grace) and so gets
    an OpenAI error body, or a stream its error event and `[DONE]`.

    NOTE: uvicorn's own end of grace cancels the handlers' tasks, which answered a plain
    "500 Internal Server Error" or cut a stream mid-body; its timeout is set a backstop
    later than ours, for a client that never reads its answer.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state, self.grace_s = state, grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.grace_s, self.state.engine.end_grace,
            f"the server is shutting down; the request did not finish within the "
            f"{self.grace_s:g} s grace period")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
