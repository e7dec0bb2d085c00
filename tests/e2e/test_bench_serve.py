"""`pagoda bench serve` against a live server on loopback: every request completes with the
lengths it asked for, the latencies it reports are consistent, and --save-detailed keeps
each request's record (concurrency 1: one request at a time)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pagoda.benchmarks import serve, serve_report
from pagoda.entrypoints.cli import build_parser
from tests.e2e.server_utils import Server

NUM_PROMPTS = 6


def _intervals_in_flight(reqs: list[dict]) -> int:
    """The most requests whose [start, start + e2e] spans overlap at one instant."""
    events = sorted([(r["start_s"], 1) for r in reqs] +
                    [(r["start_s"] + r["e2e_ms"] / 1000, -1) for r in reqs],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_bench_serve_measures_a_live_server(server: Server, tiny_llama: Path,
                                            tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_llama),
        "--num-prompts", str(NUM_PROMPTS), "--input-len", "8,24", "--output-len", "3,9",
        "--concurrency", "1,3", "--num-warmup", "1", "--save-detailed",
        "--output-json", str(out)])
    report = serve.run_serve_bench(args)
    saved = json.loads(out.read_text())
    assert [run["concurrency"] for run in saved["runs"]] == [1, 3]
    assert saved["runs"][0]["summary"]["elapsed_s"] == report["runs"][0]["summary"]["elapsed_s"]
    for run in saved["runs"]:
        summary, reqs = run["summary"], run["requests"]
        assert summary["num_ok"] == NUM_PROMPTS and summary["num_failed"] == 0
        assert summary["num_short"] == 0  # NOTE: ignore_eos: every output at its length
        assert len(reqs) == NUM_PROMPTS and all(r["ok"] and r["error"] is None for r in reqs)
        assert [r["output_len"] for r in reqs] == [r["expected_output_len"] for r in reqs]
        assert summary["num_output_tokens"] == sum(r["output_len"] for r in reqs)
        assert summary["num_prompt_tokens"] == sum(r["prompt_len"] for r in reqs)
        for r in reqs:
            assert 8 <= r["prompt_len"] <= 24 and 3 <= r["output_len"] <= 9
            assert 0 < r["ttft_ms"] <= r["e2e_ms"] and r["start_s"] >= 0
            assert len(r["itl_ms"]) <= r["output_len"] - 1 and min(r["itl_ms"]) >= 0
        ttfts = sorted(r["ttft_ms"] for r in reqs)
        assert ttfts[NUM_PROMPTS // 2 - 1] <= summary["ttft_ms"]["p50"] <= ttfts[NUM_PROMPTS // 2]
        assert _intervals_in_flight(reqs) <= run["concurrency"]
    first = saved["runs"][0]["requests"]
    # NOTE: one at a time: each request is sent after the one before it ended.
    for before, after in itertools.pairwise(first):
        assert after["start_s"] >= before["start_s"] + before["e2e_ms"] / 1000 - 1e-3


def test_save_detailed_needs_an_output_file() -> None:
    args = build_parser().parse_args(["bench", "serve", "--save-detailed"])
    with pytest.raises(ValueError, match="--output-json"):
        serve.run_serve_bench(args)


def test_temperature_goes_into_every_request() -> None:
    """--temperature (default 0, greedy) and --top-p (default 1) are every request's;
    values outside their ranges are refused."""
    parse = build_parser().parse_args
    _, body = serve._payload(parse(["bench", "serve", "--temperature", "1"]), "m", [1, 2],
                             None, 5)
    assert body["temperature"] == 1.0 and body["max_tokens"] == 5
    assert serve._payload(parse(["bench", "serve"]), "m", [1], None, 5)[1]["temperature"] == 0.0
    with pytest.raises(SystemExit):
        parse(["bench", "serve", "--temperature", "3"])
    # The printed setup names it (older saved reports have none: greedy).
    assert serve_report._sampling({"temperature": 1.0}) == "temperature 1"
    assert serve_report._sampling({}) == "greedy"
    # --top-p likewise (default 1: not sent).
    assert "top_p" not in body
    _, body = serve._payload(parse(["bench", "serve", "--temperature", "0.7", "--top-p",
                                    "0.95"]), "m", [1], None, 5)
    assert body["top_p"] == 0.95 and body["temperature"] == 0.7
    assert serve_report._sampling({"temperature": 0.7, "top_p": 0.95}) == (
        "temperature 0.7, top_p 0.95")
    with pytest.raises(SystemExit):
        parse(["bench", "serve", "--top-p", "0"])
