"""The bad-input battery of issue 9 on the shared server: each case is an OpenAI error body
(never a 5xx unless asked for), leaves nothing behind in the engine, and keeps the
connection open; plus prompt-only scoring and the OpenAPI schema telling the truth.

Out-of-range seeds, lone surrogates, unsupported fields, invalid chat messages, keep-alive
after errors, `echo` + `max_tokens: 0`, /openapi.json. (The end of the shutdown grace is
in test_server_limits.py, the 8 MB prompt and schemathesis in test_server_fuzz.py.)
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.server_utils import MODEL_NAME, Server, integrity, sse_payloads, wait_idle
from tests.e2e.test_server_errors import assert_error

CHAT = [{"role": "user", "content": "hi"}]
CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"


def post_raw(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POSTs `body` as ASCII JSON: a lone surrogate travels as the escape `\\ud800`."""
    return client.post(path, content=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})


def assert_clean(client: httpx.Client) -> None:
    report = wait_idle(client)
    assert report["ok"] and report["num_orphans"] == 0, report
    assert report["kv_cache_usage"] == 0.0, report


# ---- 1. out-of-range seeds -----------------------------------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    (CMPL, {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 64}),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 63}),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "seed": -(2 ** 63) - 1}),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2 ** 64 - 1}),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2 ** 63 - 1}),
    (CMPL, {"prompt": ["a", "b"], "max_tokens": 2, "seed": 2 ** 64}),
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 2, "seed": 2 ** 64}),
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 2, "n": 3, "seed": 2 ** 63 - 2}),
])
def test_out_of_range_seed_is_400_and_leaves_nothing(client: httpx.Client, path: str,
                                                     body: dict) -> None:
    for _ in range(2):  # NOTE: a leak grew num_unfinished by one per call
        assert_error(client.post(path, json=body), 400, "seed")
    assert_clean(client)
    assert integrity(client)["num_unfinished"] == 0


def test_largest_seeds_still_work(client: httpx.Client) -> None:
    for seed, n in ((2 ** 63 - 1, 1), (2 ** 63 - 2, 2), (-(2 ** 63), 2)):
        r = client.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "n": n, "seed": seed})
        assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
    assert_clean(client)


# ---- 2. lone surrogates -------------------------------------------------------------------
SURROGATE = "\ud800"


@pytest.mark.parametrize(("path", "body", "param"), [
    (CMPL, {"prompt": SURROGATE}, "prompt"),
    (CMPL, {"prompt": "a" + SURROGATE + "b", "max_tokens": 2}, "prompt"),
    (CMPL, {"prompt": ["fine", SURROGATE]}, "prompt"),
    (CMPL, {"prompt": SURROGATE, "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt"),
    (CMPL, {"prompt": SURROGATE, "stream": True}, "prompt"),
    (CMPL, {"prompt": "hi", "stop": [SURROGATE]}, "stop"),
    (CMPL, {"prompt": "hi", "cache_salt": SURROGATE}, "cache_salt"),
    (CMPL, {"prompt": "hi", "user": "\udfff"}, "user"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": SURROGATE}], "stream": True},
     "messages"),
    (CHAT_PATH, {"messages": [{"role": "user",
                               "content": [{"type": "text", "text": SURROGATE}]}]}, "messages"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
     "messages"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    (CMPL, {"prompt": "hi", SURROGATE: 1}, "body"),
])
def test_lone_surrogate_is_400_naming_the_field(client: httpx.Client, path: str, body: dict,
                                                param: str) -> None:
    err = assert_error(post_raw(client, path, body), 400, param)
    assert "surrogate" in err["message"]
    assert_clean(client)


# ---- 3. keep-alive after an error ----------------------------------------------------------
def _http(method: str, path: str, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length framed); raises if the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"server closed the connection; got {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection mid-body")
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


@pytest.mark.parametrize(("request_bytes", "status"), [
    (_http("GET", "/debug/raise"), 500),
    (_http("POST", CMPL, json.dumps({"prompt": SURROGATE}).encode()), 400),
    (_http("POST", CMPL, b'{"prompt": "hi",'), 400),
    (_http("POST", CMPL, json.dumps({"prompt": "hi", "seed": 2 ** 64}).encode()), 400),
    (_http("POST", CMPL, json.dumps({"model": "nope", "prompt": "hi"}).encode()), 404),
    (_http("GET", "/no-such-route"), 404),
])
def test_error_keeps_the_connection_open(server: Server, request_bytes: bytes,
                                         status: int) -> None:
    url = urlsplit(server.base_url)
    ok = _http("POST", CMPL, json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request_bytes)
        got, headers, body = _read_response(sock)
        assert got == status and json.loads(body)["error"]["code"] == status, body
        assert headers.get("connection", "").lower() != "close", headers
        sock.sendall(ok)  # NOTE: the same socket: a torn-down connection fails here
        got, _, body = _read_response(sock)
        assert got == 200, body


# ---- 4. prompt-only scoring (echo + max_tokens 0) --------------------------------------------
@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over", [1, 200, 3000, 42]])
@pytest.mark.parametrize("logprobs", [None, 0, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_zero_max_tokens_scores_the_prompt(client: httpx.Client, prompt,
                                                     logprobs: int | None,
                                                     stream: bool) -> None:
    ids = prompt if isinstance(prompt, list) else (
        client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    body = {"model": MODEL_NAME, "prompt": prompt, "echo": True, "max_tokens": 0,
            "logprobs": logprobs, "temperature": 0}
    if stream:
        with client.stream("POST", CMPL, json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, r.read()
            payloads = sse_payloads(r.iter_lines())
        assert payloads[-1] == "[DONE]"
        chunks = [c for p in payloads[:-2] for c in p["choices"]]
        text = "".join(c["text"] for c in chunks)
        finish = [c["finish_reason"] for c in chunks if c["finish_reason"]]
        lps = chunks[0]["logprobs"]
        usage = payloads[-2]["usage"]
    else:
        r = client.post(CMPL, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, finish, lps = choice["text"], [choice["finish_reason"]], choice["logprobs"]
        usage = r.json()["usage"]
    expected_text = prompt if isinstance(prompt, str) else (
        client.post("/detokenize", json={"tokens": prompt}).json()["prompt"])
    assert text == expected_text and finish == ["length"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    if logprobs is None:
        assert lps is None
        return
    assert len(lps["tokens"]) == len(ids) and lps["token_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lps["token_logprobs"][1:])
    # NOTE: the same prompt logprobs as a request that does generate one token.
    ref = client.post(CMPL, json={**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert ref["token_logprobs"][:len(ids)] == lps["token_logprobs"]


def test_zero_max_tokens_without_echo_is_still_400(client: httpx.Client) -> None:
    assert_error(client.post(CMPL, json={"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
    assert_error(client.post(CHAT_PATH, json={"messages": CHAT, "max_tokens": 0}), 400,
                 "max_tokens")


# ---- 7. unsupported fields, 8. messages ---------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": "yes"}, "response_format"),
    ({"tools": [TOOL]}, "tools"),
    ({"tools": "yes"}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 3, "n": 2}, "best_of"),
])
@pytest.mark.parametrize("path", [CMPL, CHAT_PATH])
def test_unsupported_field_is_400_naming_it(client: httpx.Client, path: str, extra: dict,
                                            param: str) -> None:
    base = {"prompt": "hi"} if path == CMPL else {"messages": CHAT}
    assert_error(client.post(path, json={**base, "max_tokens": 2, **extra}), 400, param)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
    {"best_of": 1}, {"best_of": 2, "n": 2}, {"response_format": None},
])
@pytest.mark.parametrize("path", [CMPL, CHAT_PATH])
def test_neutral_values_of_those_fields_are_accepted(client: httpx.Client, path: str,
                                                     extra: dict) -> None:
    base = {"prompt": "hi"} if path == CMPL else {"messages": CHAT}
    r = client.post(path, json={**base, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "system", "content": "be brief"}, {"role": "user"}],
    [{"role": "system"}, {"role": "user", "content": "hi"}],
    [{"role": "wizard", "content": "hi"}],
    [{"content": "hi"}],
    [{"role": "", "content": "hi"}],
])
@pytest.mark.parametrize("path", [CHAT_PATH, "/tokenize"])
def test_invalid_message_is_400(client: httpx.Client, path: str, messages: list) -> None:
    assert_error(client.post(path, json={"messages": messages}), 400, "messages")


def test_assistant_message_without_content_is_accepted(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    r = client.post(CHAT_PATH, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- 9. the OpenAPI schema ----------------------------------------------------------------
def test_openapi_documents_the_400_error_body(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    assert "422" not in json.dumps(schema)
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    posts = {p: ops["post"] for p, ops in schema["paths"].items() if "post" in ops}
    assert {CMPL, CHAT_PATH, "/tokenize", "/detokenize"} <= set(posts)
    for path, op in posts.items():
        content = op["responses"]["400"]["content"]["application/json"]
        assert content["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}, path
    # NOTE: what the schema documents is what a 400 carries.
    err = assert_error(client.post(CMPL, json={"prompt": 5}), 400)
    assert set(err) == set(error["properties"]["error"]["properties"])


# ---- 10. memory: the KV pool's resident size -----------------------------------------------
def test_kv_pool_is_resident_from_the_start(client: httpx.Client) -> None:
    """The pool is zero-filled by writing (torch.zeros), so it is all resident before any
    request: RSS growth over a soak is not the pool being touched for the first time."""
    mem = client.get("/debug/memory").json()
    assert mem["kv_pool_bytes"] > 0 and mem["rss_bytes"] > mem["kv_pool_bytes"], mem
    assert mem["kv_pool_resident_bytes"] >= mem["kv_pool_bytes"], mem
    trimmed = client.get("/debug/memory", params={"trim": "true"}).json()
    assert 0 < trimmed["rss_after_trim_bytes"] <= trimmed["rss_bytes"] + (64 << 20), trimmed
    assert trimmed["num_py_objects"] > 0, trimmed
