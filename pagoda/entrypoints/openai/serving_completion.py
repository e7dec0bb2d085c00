"""POST /v1/completions: one engine request per prompt, choices numbered
`prompt_index * n + sample_index`, legacy logprobs (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), and `echo` (the prompt, with its logprobs when asked for;
the first prompt token has none, which is how lm-eval scores multiple choice). `echo` with
`max_tokens: 0` scores the prompt only: its logprobs, no completion (lm-eval's
loglikelihood), as vLLM and the legacy OpenAI API answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.engine.async_engine import EngineRequest, OutputStream
from pagoda.engine.llm_engine import PromptType
from pagoda.entrypoints.openai.protocol import CompletionRequest, bad_request, usage
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
    logprobs: dict[str, list] | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(body.model)
    body.check_stream_options()
    try:
        prompts = body.prompts()
        params = body.to_sampling_params(state.max_logprobs)
        params.verify_token_ids(state.vocab_size)
        sla_class = body.engine_sla_class()
    except ValueError as e:
        raise bad_request(e) from e
    prompts = await _tokenized(state, prompts)
    request_id = new_request_id("cmpl")
    requests = [EngineRequest(f"{request_id}-{i}", p, params, body.priority, body.cache_salt,
                              sla_class)
                for i, p in enumerate(prompts)]
    stream = await submit(state, requests, arrival)
    builder = _CompletionBuilder(state, body, request_id, model, params.n)
    if body.stream:
        return sse_response(state, stream, builder.chunks(stream))
    return JSONResponse(builder.response(await collect(raw, state, stream)))


async def _tokenized(state: ServerState, prompts: list[str | list[int]]) -> list[PromptType]:
    """The prompts for the engine: texts tokenized here, off the event loop (token-id
    prompts as they are), after every text has passed the character-count check."""
    for p in prompts:
        if isinstance(p, str):
            state.check_prompt_chars(len(p), "prompt")
    out: list[PromptType] = []
    for p in prompts:
        if isinstance(p, str):
            out.append({"prompt": p, "prompt_token_ids": await state.encode(p, "prompt")})
        else:
            out.append(p)
    return out


def _without_generation(c: CompletionOutput) -> CompletionOutput:
    """A prompt-only request's sample: its one sampled token (see to_sampling_params)
    dropped; it ends at once, for length, as max_tokens 0 asked."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=None,
                               cumulative_logprob=None, stop_reason=None,
                               finish_reason="length" if c.finish_reason else None)


class _CompletionBuilder:
    """Turns DELTA RequestOutputs into choices, chunks and usage for one HTTP request."""

    def __init__(self, state: ServerState, body: CompletionRequest, request_id: str,
                 model: str, n: int) -> None:
        self.state, self.body, self.n = state, body, n
        self.head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                     "model": model}
        self.choices: dict[int, _Choice] = {}
        self.num_prompt_tokens: dict[int, int] = {}
        self.num_cached_tokens: dict[int, int] = {}
        # NOTE: a DELTA stream carries prompt logprobs once; every choice echoes them.
        self.prompt_logprobs: dict[int, list] = {}

    def _absorb(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any] | None:
        """Adds one sample's delta; returns its chunk choice, or None if nothing is new."""
        if self.body.prompt_only:
            c = _without_generation(c)
        p = int(out.request_id.rsplit("-", 1)[1])
        self.num_prompt_tokens[p] = len(out.prompt_token_ids)
        self.num_cached_tokens[p] = max(self.num_cached_tokens.get(p, 0), out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[p] = out.prompt_logprobs
        index = p * self.n + c.index
        ch = self.choices.setdefault(index, _Choice(index))
        text, lp = c.text, None
        want_lp = self.body.logprobs is not None
        if want_lp:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if not ch.started:
            ch.started = True
            if self.body.echo:
                text = self._echo(out, self.prompt_logprobs.get(p), lp, ch) + text
        ch.num_tokens += len(c.token_ids)
        if lp is not None and c.logprobs:
            for tid, entry in zip(c.token_ids, c.logprobs):
                self._add_lp(lp, ch, entry[tid].decoded_token or "", entry[tid].logprob, entry)
        ch.texts.append(text)
        ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        if lp is not None:
            if ch.logprobs is None:
                ch.logprobs = {k: [] for k in lp}
            for k, v in lp.items():
                ch.logprobs[k].extend(v)
        if not text and not (lp and lp["tokens"]) and c.finish_reason is None:
            return None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def _echo(self, out: RequestOutput, prompt_logprobs: list | None,
              lp: dict[str, list] | None, ch: _Choice) -> str:
        ids = out.prompt_token_ids
        if lp is not None and prompt_logprobs is not None:
            for pos, (tid, entry) in enumerate(zip(ids, prompt_logprobs)):
                token = self.state.token_text(tid)
                if pos == 0 or entry is None:
                    lp["tokens"].append(token)
                    lp["token_logprobs"].append(None)
                    lp["top_logprobs"].append(None)
                    lp["text_offset"].append(ch.text_offset)
                    ch.text_offset += len(token)
                else:
                    self._add_lp(lp, ch, token, entry[tid].logprob, entry)
        if out.prompt is not None:
            return out.prompt
        return self.state.tokenizer.decode(ids)

    @staticmethod
    def _add_lp(lp: dict[str, list], ch: _Choice, token: str, logprob: float,
                entry: dict[int, Logprob]) -> None:
        lp["tokens"].append(token)
        lp["token_logprobs"].append(logprob)
        lp["top_logprobs"].append({(e.decoded_token or ""): e.logprob for e in entry.values()})
        lp["text_offset"].append(ch.text_offset)
        ch.text_offset += len(token)

    def _usage(self) -> dict[str, int]:
        return usage(sum(self.num_prompt_tokens.values()),
                     sum(c.num_tokens for c in self.choices.values()),
                     sum(self.num_cached_tokens.values()))

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        for out in outputs:
            for c in out.outputs:
                self._absorb(out, c)
        choices = [{"index": ch.index, "text": "".join(ch.texts), "logprobs": ch.logprobs,
                    "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                   for ch in sorted(self.choices.values(), key=lambda ch: ch.index)]
        return {**self.head, "choices": choices, "usage": self._usage()}

    async def chunks(self, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        opts = self.body.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = opts is not None and opts.continuous_usage_stats
        async for out in stream:
            for c in out.outputs:
                choice = self._absorb(out, c)
                if choice is None:
                    continue
                chunk = {**self.head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = self._usage()
                elif include_usage:
                    chunk["usage"] = None
                yield chunk
        if include_usage:
            yield {**self.head, "choices": [], "usage": self._usage()}
