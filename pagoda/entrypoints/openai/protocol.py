"""OpenAI-compatible request bodies, the error body, and their mapping to SamplingParams.

Requests are pydantic models (wrong types fail as 400s); unknown fields are accepted and
ignored, as OpenAI clients send fields this server has no use for, except the OpenAI
fields whose meaning pagoda does not honour (`UNSUPPORTED_FIELDS`: structured output,
tools, best_of other than n), which are 400s naming the field, not silently free text.
Text containing a lone UTF-16 surrogate (`"\\ud800"`, which JSON allows and no tokenizer
or UTF-8 encoder accepts) is a 400 naming the top-level field it is in. Responses are
plain dicts built by the serving modules (cheaper per streamed chunk than models).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagoda.core.request import DEFAULT_SLA_CLASS, SLA_CLASS_RANKS
from pagoda.sampling_params import SamplingParams

# NOTE: every sample is a sequence in the engine; a bound keeps one request from flooding it.
MAX_N = 128
# Seeds are int64, as OpenAI's and vLLM's; sample i of n uses seed + i, which must fit too.
MIN_SEED, MAX_SEED = -(2 ** 63), 2 ** 63 - 1

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# Values of the unsupported fields that ask for nothing beyond free text (accepted).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
UNSUPPORTED_FIELDS = tuple(_NEUTRAL_VALUES)


class APIError(Exception):
    """An error answered with an OpenAI error body and `status` (`error_type` overrides
    the type named after the status)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.error_type = error_type


def error_body(status: int, message: str, param: str | None = None,
               error_type: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM answer."""
    return {"error": {"message": message,
                      "type": error_type or _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string inside `value` (dict keys included) has a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class _Body(BaseModel):
    """A request body: unknown fields allowed; no text with a lone surrogate anywhere.

    The surrogate error carries the top-level field in its context (`ctx.param`), which
    the server's validation handler answers as the error's `param`.
    """

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if _has_lone_surrogate(key) or _has_lone_surrogate(value):
                    field = "body" if _has_lone_surrogate(key) else key
                    raise PydanticCustomError(
                        "lone_surrogate",
                        "{param} contains a lone UTF-16 surrogate, which is not valid text",
                        {"param": field})
        return data


def bad_request(exc: ValueError) -> APIError:
    """A 400 from a validation ValueError; `param` is the field its message starts with."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first.isidentifier() and first in _PARAM_NAMES else None
    return APIError(400, message, param)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: lower is served first under --scheduling-policy priority.
    priority: int = 0
    cache_salt: str | None = None
    # pagoda extension: interactive (the default), async or batch; ranks before priority
    # under the priority policy, and labels the per-class metrics.
    sla_class: str | None = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")

    def check_supported(self) -> None:
        """Raises ValueError naming the first field whose request pagoda cannot honour."""
        extra = self.model_extra or {}
        for name, neutral in _NEUTRAL_VALUES.items():
            value = extra.get(name)
            if value not in neutral:
                raise ValueError(f"{name} is not supported by this server (got {value!r}); "
                                 f"only free text is generated")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (got {self.best_of}); it is accepted "
                             f"only equal to n ({self.n})")

    def engine_sla_class(self) -> str:
        """The SLA class to schedule under; raises ValueError naming sla_class if unknown."""
        if self.sla_class is None:
            return DEFAULT_SLA_CLASS
        if self.sla_class not in SLA_CLASS_RANKS:
            raise ValueError(f"sla_class must be one of {list(SLA_CLASS_RANKS)}, "
                             f"got {self.sla_class!r}")
        return self.sla_class

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams for this body; raises ValueError naming a bad field."""
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        if self.seed is not None and self.n > 1 and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED} - (n - 1): sample i uses "
                             f"seed + i, got seed {self.seed} with n {self.n}")
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=self.logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **{k: v for k, v in optional.items() if v is not None},
        )


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists; raises ValueError if empty."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and isinstance(p[0], int):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise ValueError("prompt is empty: it must contain at least one token")
        return out

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: score the prompt (its logprobs), generate nothing."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        """SamplingParams for the engine; raises ValueError naming a bad field.

        NOTE: a prompt-only request runs with max_tokens 1, the one forward pass that
        yields the prompt's logprobs; the builder drops the sampled token.
        """
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        self.check_supported()
        _check_logprobs("logprobs", self.logprobs, max_logprobs)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling(max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines.

        Raises ValueError (naming `messages`) for a message other than the assistant's
        without content, as OpenAI does (an unknown role fails validation already).
        """
        if self.content is None and self.role != "assistant":
            raise ValueError(f"messages of role {self.role!r} must have content")
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"messages content parts must be text, got type {part.type!r}"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        out = self.model_dump(exclude_none=True)
        out["content"] = content if content is not None else ""
        return out


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        _check_logprobs("top_logprobs", self.top_logprobs, max_logprobs)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        return self._sampling(max_tokens, logprobs, None)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class FaultRequest(BaseModel):
    num_steps: int = Field(default=1, ge=1, le=100)


def _check_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    if value is not None and value > max_logprobs:
        raise ValueError(f"{name} must be at most {max_logprobs} (--max-logprobs), got {value}")


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict[str, Any]:
    """OpenAI usage; cached_tokens = prompt tokens served from the prefix cache."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


_PARAM_NAMES = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {
    "prompt_logprobs", *UNSUPPORTED_FIELDS
}
