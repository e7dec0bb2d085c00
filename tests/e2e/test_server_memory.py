"""Server memory under ever-new step shapes (issue 9 item 10, docs/memory.md).

A bf16 server (the oneDNN-packed GEMM path) serves prompts of distinct lengths, so every
step is a GEMM shape not seen before: without the caps on oneDNN's and ideep's primitive
caches and the fixed glibc mmap threshold (pagoda/memory_env.py), RSS keeps rising with
every new shape (each cache fills to 1,024 entries of ~0.4 MB, and the heaps fragment).
With them the caches fill within the first round and the second round adds nothing
beyond noise. Python objects must not grow with the number of requests either."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import MODEL_NAME, Server, start_server, wait_idle

ROUND = 150  # distinct prompt lengths per round: 4 GEMM shapes each, > the 128-entry caps
MAX_RSS_GROWTH = 64 << 20
MAX_PY_OBJECT_GROWTH = 2_000


@pytest.fixture(scope="module")
def bf16_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("memory") / "server.log"
    # NOTE: the later --dtype wins over start_server's float32 (which stays on F.linear).
    srv = start_server(tiny_llama, log, "--dtype", "bfloat16", "--max-num-seqs", "4")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _serve_lengths(client: httpx.Client, lengths: range) -> dict:
    """One request per length (distinct first tokens: no prefix-cache hit shortens a
    step), then the engine's memory report."""
    for n in lengths:
        ids = [(n * 7919 + j) % 40_000 + 10 for j in range(n)]
        r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids,
                                                 "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert wait_idle(client)["ok"]
    mem = client.get("/debug/memory")
    assert mem.status_code == 200, mem.text
    return mem.json()


def test_rss_stops_growing_once_the_gemm_caches_are_full(bf16_server: Server) -> None:
    with httpx.Client(base_url=bf16_server.base_url, timeout=120.0) as client:
        first = _serve_lengths(client, range(1, ROUND + 1))
        second = _serve_lengths(client, range(ROUND + 1, 2 * ROUND + 1))
    growth = second["rss_bytes"] - first["rss_bytes"]
    print(f"RSS {first['rss_bytes'] / 2**20:.0f} -> {second['rss_bytes'] / 2**20:.0f} MiB")
    assert growth < MAX_RSS_GROWTH, (
        f"RSS grew {growth / 2**20:.0f} MiB over {ROUND} new step shapes: {first} -> {second}")
    py_growth = second["num_py_objects"] - first["num_py_objects"]
    assert py_growth < MAX_PY_OBJECT_GROWTH, (first, second)
