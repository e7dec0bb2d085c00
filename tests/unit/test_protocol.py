"""OpenAI request bodies -> prompts and SamplingParams; the error body."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagoda.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    bad_request,
    error_body,
    usage,
)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes(prompt, expected) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""]])
def test_empty_prompts_raise(prompt) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        CompletionRequest(prompt=prompt).prompts()


@pytest.mark.parametrize("prompt", [5, ["a", 1], [[1], "a"], {"x": 1}, [1.5]])
def test_prompt_of_wrong_type_fails_validation(prompt) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_completion_sampling_params() -> None:
    req = CompletionRequest(prompt="x", max_tokens=7, temperature=0, top_k=5, n=2, seed=1,
                            stop="END", logprobs=3, echo=True, ignore_eos=True, min_tokens=2,
                            logit_bias={"5": 1.5}, stop_token_ids=[9], extra_field="ignored")
    p = req.to_sampling_params(max_logprobs=5)
    assert (p.max_tokens, p.n, p.seed, p.stop, p.logprobs, p.prompt_logprobs) == (
        7, 2, 1, ["END"], 3, 3)
    assert p.ignore_eos and p.min_tokens == 2 and p.logit_bias == {5: 1.5}
    assert p.stop_token_ids == [9] and p.temperature == 0 and p.top_k == 0  # greedy
    defaults = CompletionRequest(prompt="x").to_sampling_params(5)
    assert defaults.max_tokens == 16 and defaults.temperature == 1.0
    assert defaults.prompt_logprobs is None


def test_completion_limits() -> None:
    with pytest.raises(ValueError, match="logprobs must be at most 5"):
        CompletionRequest(prompt="x", logprobs=6).to_sampling_params(5)
    with pytest.raises(ValueError, match="suffix"):
        CompletionRequest(prompt="x", suffix="y").to_sampling_params(5)
    with pytest.raises(ValueError, match="temperature"):
        CompletionRequest(prompt="x", temperature=-0.5).to_sampling_params(5)
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).check_stream_options()
    assert e.value.status == 400 and e.value.param == "stream_options"


def test_chat_sampling_params() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(messages=msgs, max_tokens=9, max_completion_tokens=4,
                                logprobs=True, top_logprobs=2)
    p = req.to_sampling_params(5)
    assert p.max_tokens == 4 and p.logprobs == 2
    assert ChatCompletionRequest(messages=msgs, logprobs=True).to_sampling_params(5).logprobs == 0
    p = ChatCompletionRequest(messages=msgs).to_sampling_params(5)
    assert p.max_tokens is None and p.logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=msgs, top_logprobs=2).to_sampling_params(5)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


def test_chat_message_parts() -> None:
    m = ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}])
    assert m.to_template_dict() == {"role": "user", "content": "a\nb"}
    assert ChatMessage(role="assistant").to_template_dict() == {"role": "assistant",
                                                                "content": ""}
    with pytest.raises(ValueError, match="must be text"):
        ChatMessage(role="user", content=[{"type": "image_url"}]).to_template_dict()


def test_error_body_and_param_extraction() -> None:
    assert error_body(429, "slow down") == {"error": {
        "message": "slow down", "type": "RateLimitError", "param": None, "code": 429}}
    assert bad_request(ValueError("top_p must be in (0, 1], got 0")).param == "top_p"
    assert bad_request(ValueError("something else broke")).param is None
    assert usage(3, 4, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 2}}


def test_sla_class_and_priority_fields() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert CompletionRequest(prompt="x").engine_sla_class() == "interactive"
    assert CompletionRequest(prompt="x", sla_class=None).engine_sla_class() == "interactive"
    req = ChatCompletionRequest(messages=msgs, sla_class="batch", priority=3)
    assert req.engine_sla_class() == "batch" and req.priority == 3
    with pytest.raises(ValueError) as e:
        CompletionRequest(prompt="x", sla_class="gold").engine_sla_class()
    err = bad_request(e.value)
    assert err.status == 400 and err.param == "sla_class"
    assert err.message == "sla_class must be one of ['interactive', 'async', 'batch'], got 'gold'"
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", sla_class=["batch"])
