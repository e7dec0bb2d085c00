"""POST /v1/chat/completions: the model's chat template (or --chat-template), then one
engine request with n samples.

Streaming rules (what clients that time the first token rely on): a choice's first chunk
carries the role together with its first content, never earlier; exactly one chunk per
choice has a finish_reason; with include_usage a last chunk with `choices: []` carries
the usage; then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.engine.async_engine import EngineRequest, OutputStream
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, bad_request, usage
from pagoda.entrypoints.openai.serving import (
    ServerState,
    collect,
    new_request_id,
    sse_response,
    submit,
)
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Choice:
    index: int
    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    role_sent: bool = False
    unsent_logprobs: list[dict[str, Any]] = field(default_factory=list)


async def chat_prompt_ids(state: ServerState, messages: list[dict[str, Any]],
                          add_generation_prompt: bool) -> list[int]:
    """Token ids of the templated conversation, rendered and tokenized off the event loop;
    ValueError for a template that refuses it, a 400 (APIError) for a conversation whose
    rendered text is provably longer than max_model_len."""
    if state.chat_template is None and not getattr(state.tokenizer, "chat_template", None):
        raise ValueError("messages cannot be used: the model has no chat template")

    def render() -> str:
        try:
            return state.tokenizer.apply_chat_template(
                messages, chat_template=state.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False)
        except jinja2.TemplateError as e:
            raise ValueError(f"messages cannot be rendered by the chat template: {e}") from e

    text = await state.run_tokenizer(render)
    # NOTE: as in LLM.chat: the template writes the BOS it wants, so no special tokens.
    return await state.encode(text, "messages", add_special_tokens=False)


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, raw: Request
) -> Response:
    arrival = time.monotonic()
    model = state.check_model(body.model)
    body.check_stream_options()
    try:
        params = body.to_sampling_params(state.max_logprobs)
        params.verify_token_ids(state.vocab_size)
        sla_class = body.engine_sla_class()
        messages = [m.to_template_dict() for m in body.messages]
        prompt_ids = await chat_prompt_ids(state, messages, body.add_generation_prompt)
    except ValueError as e:
        raise bad_request(e) from e
    request_id = new_request_id("chatcmpl")
    request = EngineRequest(request_id, {"prompt_token_ids": prompt_ids}, params,
                            body.priority, body.cache_salt, sla_class)
    stream = await submit(state, [request], arrival)
    builder = _ChatBuilder(state, body, request_id, model, params.logprobs)
    if body.stream:
        return sse_response(state, stream, builder.chunks(stream))
    return JSONResponse(builder.response(await collect(raw, state, stream)))


class _ChatBuilder:
    """Turns DELTA RequestOutputs into chat choices, chunks and usage."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str,
                 model: str, top_k: int | None) -> None:
        self.state, self.body, self.top_k = state, body, top_k
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.choices: dict[int, _Choice] = {}
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def _logprob_entries(self, c: CompletionOutput) -> list[dict[str, Any]]:
        entries = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            top = sorted(entry.values(), key=lambda e: e.rank if e.rank is not None else 0)
            entries.append({**_token_logprob(entry[tid]),
                            "top_logprobs": [_token_logprob(e) for e in top[: self.top_k]]})
        return entries

    def _absorb(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any] | None:
        """Adds one sample's delta; returns its chunk choice, or None if nothing to send."""
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        ch = self.choices.setdefault(c.index, _Choice(c.index))
        ch.num_tokens += len(c.token_ids)
        ch.texts.append(c.text)
        ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        entries = self._logprob_entries(c) if self.top_k is not None else None
        if entries is not None:
            ch.logprobs = (ch.logprobs or []) + entries
            ch.unsent_logprobs += entries
        if not c.text and c.finish_reason is None and (not ch.role_sent or not entries):
            return None  # NOTE: the role waits for the first content (see the docstring).
        delta: dict[str, Any] = {"content": c.text}
        if not ch.role_sent:
            delta = {"role": "assistant", "content": c.text}
            ch.role_sent = True
        elif not c.text and c.finish_reason is not None and not entries:
            delta = {}
        logprobs = {"content": ch.unsent_logprobs} if entries is not None else None
        ch.unsent_logprobs = []
        return {"index": c.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, sum(c.num_tokens for c in self.choices.values()),
                     self.num_cached_tokens)

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        for out in outputs:
            for c in out.outputs:
                self._absorb(out, c)
        choices = [
            {"index": ch.index, "message": {"role": "assistant", "content": "".join(ch.texts)},
             "logprobs": {"content": ch.logprobs} if ch.logprobs is not None else None,
             "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            for ch in sorted(self.choices.values(), key=lambda ch: ch.index)
        ]
        return {**self.head, "object": "chat.completion", "choices": choices,
                "usage": self._usage()}

    async def chunks(self, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        opts = self.body.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = opts is not None and opts.continuous_usage_stats
        head = {**self.head, "object": "chat.completion.chunk"}
        async for out in stream:
            for c in out.outputs:
                choice = self._absorb(out, c)
                if choice is None:
                    continue
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = self._usage()
                elif include_usage:
                    chunk["usage"] = None
                yield chunk
        if include_usage:
            yield {**head, "choices": [], "usage": self._usage()}


def _token_logprob(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}
