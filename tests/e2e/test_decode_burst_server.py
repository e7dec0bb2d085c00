"""Decode bursts over HTTP: a bf16 server with bursts (the default) answers greedy and
seeded sampled completions and chats, streamed and not, exactly as one with
`--decode-burst 1`; a stream's
chunks then carry several tokens; a client that disconnects during a burst leaves no block
behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagoda.ops import cpu_kernels
from tests.e2e.server_utils import Server, integrity, sse_payloads, start_server, wait_idle
from tests.helpers import bf16_packs

REQUESTS = [
    {"prompt": "The lighthouse keeper", "max_tokens": 60, "ignore_eos": True},
    {"prompt": "Once upon a time", "max_tokens": 21, "ignore_eos": True},
    {"prompt": "Once upon a time", "max_tokens": 40, "stop": ["e"]},
    {"prompt": [5, 17, 300, 4000], "max_tokens": 33, "ignore_eos": True},
    # A seeded request at the OpenAI API's default temperature: sampled bursts.
    {"prompt": "The lighthouse keeper", "max_tokens": 50, "ignore_eos": True,
     "temperature": 1.0, "seed": 42},
]


def _start(tiny_llama: Path, tmp_path_factory, burst: int) -> Server:
    if cpu_kernels.kernels_disabled() or cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the fused-op kernels do not run here: no decode stack, so no bursts")
    if not bf16_packs():
        pytest.skip("oneDNN packs no bf16 weight on this CPU: a dense model has no stack")
    log = tmp_path_factory.mktemp(f"burst{burst}") / "server.log"
    return start_server(tiny_llama, log, "--dtype", "bfloat16", "--decode-burst", str(burst))


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    on = _start(tiny_llama, tmp_path_factory, 8)
    off = _start(tiny_llama, tmp_path_factory, 1)
    yield on, off
    assert on.stop() == 0, on.log_tail()
    assert off.stop() == 0, off.log_tail()


def _answers(server: Server) -> list:
    """Each request alone, plain then streamed: (text, finish_reason, completion tokens)
    and the streamed text with its number of content chunks."""
    got = []
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        for body in REQUESTS:
            body = {"model": "tiny", "temperature": 0, **body}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            plain = (choice["text"], choice["finish_reason"],
                     r.json()["usage"]["completion_tokens"])
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                chunks = [p for p in sse_payloads(s.iter_lines()) if p != "[DONE]"]
            texts = [p["choices"][0]["text"] for p in chunks if p["choices"][0]["text"]]
            got.append((plain, "".join(texts), len(texts)))
        chat = c.post("/v1/chat/completions", json={
            "model": "tiny", "temperature": 0, "max_tokens": 30,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]})
        assert chat.status_code == 200, chat.text
        got.append(chat.json()["choices"][0]["message"]["content"])
        assert wait_idle(c)["kv_cache_usage"] == 0.0
    return got


def test_bursts_answer_as_one_step_at_a_time(servers) -> None:
    on, off = servers
    with_bursts, without = _answers(on), _answers(off)
    assert with_bursts[-1] == without[-1]  # the chat
    for (plain, streamed, num_chunks), (plain_off, streamed_off, _) in zip(
            with_bursts[:-1], without[:-1], strict=True):
        assert plain == plain_off
        assert streamed == plain[0] and streamed_off == plain_off[0]
    # NOTE: 60 tokens alone: after the first, bursts of up to 8 tokens a chunk.
    (_, _, tokens), _, num_chunks = with_bursts[0]
    assert tokens == 60 and num_chunks < tokens / 2
    (_, _, tokens), _, num_chunks = with_bursts[4]  # the sampled one
    assert tokens == 50 and num_chunks < tokens / 2


def test_disconnect_during_bursts_frees_the_blocks(servers) -> None:
    on, _ = servers
    body = {"model": "tiny", "prompt": "walk away", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=on.base_url, timeout=30.0) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # NOTE: kept referenced: closing it would disconnect early
            while not next(lines).startswith("data: "):
                pass
            assert integrity(c)["num_running"] == 1
        report = wait_idle(c, timeout_s=5.0)
        assert report["ok"] and report["kv_cache_usage"] == 0.0
