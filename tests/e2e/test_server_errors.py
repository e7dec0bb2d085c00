"""Every error class of the shared server answers with the OpenAI error body, and none of
them takes the server down: 400, 404, 405, 413, and 500 for an (injected) engine fault."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.server_utils import (
    MAX_BODY_BYTES,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    sse_payloads,
    wait_idle,
)

CHAT = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "prompt"),
    ({"prompt": [1] * (MAX_MODEL_LEN - 10), "max_tokens": 20}, "prompt"),
    ({"prompt": [49152]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
])
def test_invalid_completion_is_400(client: httpx.Client, body: dict, param: str | None) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": CHAT, "top_logprobs": 2},
    {"messages": CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
    {"messages": CHAT, "max_completion_tokens": 0},
    {"messages": CHAT, "stream": True, "presence_penalty": 3},
])
def test_invalid_chat_is_400(client: httpx.Client, body: dict) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400)


def test_malformed_json_and_unknown_things(client: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    assert_error(client.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers),
                 400)
    assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                 "model")
    assert_error(client.post("/v1/chat/completions", json={"model": "x", "messages": CHAT}),
                 404)
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.post("/detokenize", json={"tokens": [10 ** 7]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400)


def test_oversized_body_is_413(client: httpx.Client) -> None:
    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    assert_error(client.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit must hold for a chunked body too
        for _ in range(MAX_BODY_BYTES // 10_000 + 2):
            yield b" " * 10_000

    assert_error(client.post("/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"}), 413)


def test_engine_fault_is_500_and_server_survives(client: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "fault", "max_tokens": 8}
    client.post("/debug/fault", json={"num_steps": 1}).raise_for_status()
    err = assert_error(client.post("/v1/completions", json=body), 500)
    assert "injected" in err["message"]
    client.post("/debug/fault", json={"num_steps": 1}).raise_for_status()
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": CHAT, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == 500
    report = wait_idle(client)
    assert report["ok"] and report["kv_cache_usage"] == 0.0
    ok = client.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
