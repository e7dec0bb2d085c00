"""What the completion and chat endpoints share: server state, submitting to the engine,
collecting a whole answer, and server-sent events that abort on client disconnect.

A request is aborted (and its KV blocks freed before the engine's next step) whenever
its handler stops early: the client disconnects, the server cancels it on shutdown, or
the handler fails. Prompts are tokenized on one tokenizer thread, never on the event loop,
after a character count check that refuses, untokenized, a prompt provably longer than
max_model_len (prompt_limits.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.async_engine import (
    EngineClient,
    EngineDeadError,
    EngineFaultError,
    EngineRequest,
    EngineShutdownError,
    OutputStream,
    QueueFullError,
)
from pagoda.engine.detokenizer import decode_token
from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.openai.prompt_limits import max_prompt_chars
from pagoda.entrypoints.openai.protocol import APIError, bad_request, error_body
from pagoda.entrypoints.openai.request_log import Arrivals, current_record, note_error
from pagoda.outputs import RequestOutput

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
SHUTDOWN_ERROR_TYPE = "service_unavailable"


@dataclass
class ServerState:
    """Everything a handler needs; built once at start-up, read-only afterwards."""

    engine: EngineClient  # AsyncLLMEngine, or core_client.EngineCoreClient
    tokenizer: Any
    model_names: list[str]
    model_root: str
    max_model_len: int
    vocab_size: int
    metrics: EngineMetrics
    chat_template: str | None = None
    max_logprobs: int = 20
    enable_debug: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Derived from the tokenizer (prompt_limits.py); None: no provable bound.
    max_prompt_chars: int | None = field(init=False)
    # NOTE: one thread: tokenizers are not promised to be safe under concurrent encodes,
    # and the engine thread competes for the same two cores anyway.
    tokenizer_pool: ThreadPoolExecutor = field(
        init=False, default_factory=lambda: ThreadPoolExecutor(1, "pagoda-tokenize"))
    # Generation requests received and not yet handed to the engine (request_log.py).
    arrivals: Arrivals = field(init=False, default_factory=Arrivals)

    def __post_init__(self) -> None:
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; 404 for a name this server does not serve."""
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{self.model_names}", "model")

    def token_text(self, token_id: int) -> str:
        return decode_token(self.tokenizer, token_id)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Raises a 400 naming `param` if `num_chars` alone proves the prompt too long."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {num_chars} characters, more than any prompt "
                           f"that fits max_model_len {self.max_model_len} tokens can have "
                           f"with this tokenizer ({self.max_prompt_chars})", param)

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread (off the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, after the character-count check (400 naming `param`)."""
        self.check_prompt_chars(len(text), param)
        return await self.run_tokenizer(self.tokenizer.encode, text,
                                        add_special_tokens=add_special_tokens)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def submit(
    state: ServerState, requests: list[EngineRequest], arrival_time: float
) -> OutputStream:
    """Hands `requests` to the engine; maps its refusals to APIErrors (400, 429, 503)."""
    record = current_record()
    more_coming = record.leave_arrivals() if record is not None else 0
    try:
        stream = await state.engine.generate(requests, arrival_time, more_coming)
    except ValueError as e:
        raise bad_request(e) from e
    except QueueFullError as e:
        raise APIError(429, str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
    except EngineShutdownError as e:
        raise shutdown_error(e) from e
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e
    if record is not None:
        stream.observer = record.observe
    return stream


def shutdown_error(exc: EngineShutdownError) -> APIError:
    return APIError(503, str(exc), error_type=SHUTDOWN_ERROR_TYPE)


async def collect(raw: Request, state: ServerState, stream: OutputStream) -> list[RequestOutput]:
    """Every output of `stream`; aborts it if the client disconnects first (answered 499);
    408 if a deadline aborted it (nothing has been sent yet)."""
    async def consume() -> list[RequestOutput]:
        return [out async for out in stream]

    task = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise APIError(499, "the client closed the request")
        try:
            outputs = task.result()
        except EngineShutdownError as e:
            raise shutdown_error(e) from e
        except (EngineFaultError, EngineDeadError) as e:
            raise APIError(500, str(e)) from e
        if any(c.finish_reason == "timeout" for out in outputs for c in out.outputs):
            raise APIError(408, "the request timed out (--request-timeout or "
                           "--sla-max-queue-time) and was aborted")
        return outputs
    finally:
        task.cancel()
        watch.cancel()
        abort_unfinished(state, stream)


async def _wait_for_disconnect(raw: Request) -> None:
    # NOTE: the body has been read already, so the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def sse_response(
    state: ServerState, stream: OutputStream, payloads: AsyncIterator[dict[str, Any]]
) -> SSEResponse:
    """The streamed answer to one HTTP request: `payloads` as events, aborted on leaving
    (a stream that closes with engine requests unfinished lost its client)."""
    def close() -> None:
        if not stream.finished:
            note_error("client_disconnect")
        abort_unfinished(state, stream)

    return SSEResponse(sse_events(state, stream, payloads), close)


def abort_unfinished(state: ServerState, stream: OutputStream) -> None:
    if not stream.finished:
        state.engine.abort(stream.unfinished_ids)


async def sse_events(
    state: ServerState, stream: OutputStream, payloads: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[bytes]:
    """`payloads` as server-sent events, then `[DONE]`; an engine fault becomes an error
    event (status 500, or 503 when the shutdown grace ran out) before `[DONE]`; leaving
    early aborts what is still running."""
    try:
        try:
            async for payload in payloads:
                yield sse(payload)
        except EngineShutdownError as e:
            state.metrics.observe_http_error(503)
            yield sse(error_body(503, str(e), error_type=SHUTDOWN_ERROR_TYPE))
        except (EngineFaultError, EngineDeadError) as e:
            state.metrics.observe_http_error(500)
            note_error("engine_error")
            yield sse(error_body(500, str(e)))
        yield SSE_DONE
    finally:
        abort_unfinished(state, stream)


class SSEResponse(StreamingResponse):
    """A streaming response that stops (and so aborts its request) as soon as the client
    disconnects, even while no token is ready to be written.

    NOTE: Starlette only notices a disconnect when a write fails under ASGI spec 2.4, which
    can be a long prefill later; here a watcher cancels the stream at once, and the body
    generator's `finally` aborts the engine requests.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        # NOTE: closing a generator that never started skips its `finally`; a client that
        # leaves before the first byte is aborted by this instead.
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # NOTE: the client went away during a write.
                    finally:
                        tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()
