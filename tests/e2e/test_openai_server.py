"""The OpenAI-compatible server through the official `openai` client and raw HTTP: texts,
usage, SSE rules, logprobs/echo, batching, tokenize, and the informational endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.server_utils import MAX_MODEL_LEN, MODEL_NAME, Server, sse_payloads, wait_idle

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=60.0,
                         max_retries=0)


def counts(usage: dict) -> dict:
    """The token counts of a usage body (cached_tokens depends on what ran before)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def stream_text(client: httpx.Client, path: str, body: dict) -> tuple[list, dict[int, str]]:
    """(payloads, text per choice index) of one streamed request."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        payloads = sse_payloads(r.iter_lines())
    texts: dict[int, str] = {}
    for p in payloads[:-1]:
        for c in p["choices"]:
            piece = c.get("text") if "text" in c else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return payloads, texts


def test_models_health_version(client: httpx.Client, tiny_llama) -> None:
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME]
    m = models[0]
    assert m["object"] == "model" and m["owned_by"] == "pagoda"
    assert m["root"] == str(tiny_llama) and m["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]


def test_completion_stream_equals_non_stream(client: httpx.Client, oai: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()
    payloads, texts = stream_text(client, "/v1/completions",
                                  {**body, "stream_options": {"include_usage": True}})
    assert texts[0] == full["choices"][0]["text"] and len(texts[0]) > 0
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["choices"] == [] and counts(payloads[-2]["usage"]) == counts(full["usage"])
    finishes = [c["finish_reason"] for p in payloads[:-2] for c in p["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    n_prompt = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert counts(full["usage"]) == {"prompt_tokens": n_prompt, "completion_tokens": 24,
                             "total_tokens": n_prompt + 24}
    via_sdk = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert via_sdk.choices[0].text == texts[0]


def test_chat_stream_rules(client: httpx.Client, oai: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_completion_tokens": 20,
            "temperature": 0, "n": 2, "seed": 3}
    full = client.post("/v1/chat/completions", json=body).json()
    payloads, texts = stream_text(client, "/v1/chat/completions",
                                  {**body, "stream_options": {"include_usage": True}})
    assert texts == {c["index"]: c["message"]["content"] for c in full["choices"]}
    chunks = payloads[:-2]
    for index in (0, 1):
        mine = [c for p in chunks for c in p["choices"] if c["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[0]["delta"]["content"]
        assert all("role" not in c["delta"] for c in mine[1:])
        assert sum(c["finish_reason"] is not None for c in mine) == 1
        assert mine[-1]["finish_reason"] is not None
    assert all(p["object"] == "chat.completion.chunk" for p in chunks)
    assert payloads[-2]["choices"] == [] and counts(payloads[-2]["usage"]) == counts(full["usage"])
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts[0]


def test_chat_template_has_one_bos_and_generation_prompt(client: httpx.Client) -> None:
    tok = client.post("/tokenize", json={"messages": MESSAGES}).json()
    ids = tok["tokens"]
    assert ids.count(1) == 3  # NOTE: SmolLM2's <|im_start|> (id 1) opens each turn.
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and not text.startswith("<|im_start|><|im")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                          {"type": "text", "text": "colours."}]}]
    joined = client.post("/tokenize", json={"messages": parts,
                                            "add_generation_prompt": False}).json()
    assert "Name three\ncolours." in client.post(
        "/detokenize", json={"tokens": joined["tokens"]}).json()["prompt"]
    full = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                     "temperature": 0}).json()
    assert full["usage"]["prompt_tokens"] == tok["count"]


def test_stop_string_streamed_and_not(client: httpx.Client) -> None:
    base = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    body = {**base, "stop": [stop]}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    assert full["text"] == text[: text.index(stop)]
    assert full["finish_reason"] == "stop" and full["stop_reason"] == stop
    assert stream_text(client, "/v1/completions", body)[1][0] == full["text"]


def test_batched_prompts_token_ids_and_n(client: httpx.Client) -> None:
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": [PROMPT, PROMPT], "max_tokens": 6, "temperature": 0, "n": 2,
            "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()
    choices = full["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({c["text"] for c in choices}) == 1  # greedy: same prompt, same text
    assert counts(full["usage"]) == {"prompt_tokens": 2 * len(ids), "completion_tokens": 24,
                             "total_tokens": 2 * len(ids) + 24}
    _, texts = stream_text(client, "/v1/completions", body)
    assert texts == {c["index"]: c["text"] for c in choices}
    nested = client.post("/v1/completions", json={**body, "prompt": [ids, ids], "n": 1})
    assert [c["text"] for c in nested.json()["choices"]] == [choices[0]["text"]] * 2


def test_echo_with_prompt_logprobs(client: httpx.Client) -> None:
    """lm-eval's multiple-choice scoring: echo + logprobs + max_tokens=1."""
    n_prompt = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_prompt + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(c["text"]) - len(
        lp["tokens"][-1])
    greedy = lp["token_logprobs"][-1]
    assert greedy == pytest.approx(max(lp["top_logprobs"][-1].values()))
    _, texts = stream_text(client, "/v1/completions", body)
    assert texts[0] == c["text"]
    two = client.post("/v1/completions", json={**body, "n": 2, "temperature": 1, "seed": 0})
    for choice in two.json()["choices"]:  # every choice echoes the prompt's logprobs
        got = choice["logprobs"]["token_logprobs"][:n_prompt]
        assert got[0] is None and got[1:] == pytest.approx(lp["token_logprobs"][1:n_prompt])


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_continuous_usage_stats(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    payloads, _ = stream_text(client, "/v1/completions", body)
    completions = [p["usage"]["completion_tokens"] for p in payloads[:-1]]
    assert completions == sorted(completions) and completions[-1] == 5


def test_priority_and_cache_salt_accepted(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "priority": 2, "cache_salt": "tenant-a"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert wait_idle(client)["ok"]


def test_usage_reports_prefix_cache_hits(client: httpx.Client) -> None:
    """The second request with the same 70-token prompt is served 64 tokens (4 full blocks)
    from the prefix cache, and usage says so."""
    ids = list(range(1000, 1070))
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == 70
    assert second["prompt_tokens_details"]["cached_tokens"] == 64
