"""`pagoda bench kv-quant` on a tiny model: exact byte counts per format, perplexities that
exist and agree where the format is lossless; timings only checked to exist."""

from __future__ import annotations

import argparse
import math

import pytest

from pagoda.benchmarks.kv_quant import run_kv_quant


def test_bench_kv_quant_counts_bytes_and_scores_every_format(tiny_model, tmp_path) -> None:
    path = tiny_model("LlamaForCausalLM", hidden_size=128, head_dim=64)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = argparse.Namespace(
        model=str(path), kv_cache_dtypes="auto,int8,fp8", batch=2, context=40, repeats=1,
        threads=None, text=str(text), ppl_tokens=96, ppl_window=48, conversation_tokens=100,
        host_compressions="none,int8,int4", output_json=str(tmp_path / "r.json"),
        micro=False, micro_threads="1")
    report = run_kv_quant(args)
    rows, host = report["results"], report["host_compression"]
    # 2 layers x (K, V) x 2 kv heads x 64 dims: bf16 2 bytes; codes 1 byte + a 4-byte scale.
    assert rows["auto"]["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2
    assert rows["int8"]["kv_bytes_per_token"] == rows["fp8"]["kv_bytes_per_token"] == (
        2 * 2 * 2 * (64 + 4))
    assert host["int4"]["host_bytes_per_token"] == 2 * 2 * 2 * (32 + 4)
    assert host["int8"]["conversations_per_host_gib"] == pytest.approx(
        (1 << 30) / (2 * 2 * 2 * 68 * 100))
    for r in [*rows.values(), *host.values()]:
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
    for r in rows.values():
        assert r["attention_ms"] > 0 and r["attention_cpu_ms"] >= 0
    # The uncompressed round trip is no round trip: the baseline's perplexity.
    assert host["none"]["perplexity"] == pytest.approx(rows["auto"]["perplexity"], rel=1e-6)
    assert host["int8"]["zlib1_ratio"] > 0 and (tmp_path / "r.json").exists()


def test_bench_kv_quant_micro_times_one_layer_per_dtype_and_thread_count(tiny_model) -> None:
    path = tiny_model("LlamaForCausalLM", hidden_size=128, head_dim=64)
    args = argparse.Namespace(model=str(path), kv_cache_dtypes="auto,int8", batch=2,
                              context=40, repeats=1, threads=None, micro=True,
                              micro_threads="1,2")
    micro = run_kv_quant(args)["micro"]
    assert set(micro) == {"1", "2"} and set(micro["1"]) == {"auto", "int8"}
    for rows in micro.values():
        assert rows["auto"]["speedup"] == 1.0
        # GB/s is the bytes read over the time: bf16 2 bytes per value, codes 1 + scales.
        ratio = (rows["int8"]["gb_s"] * rows["int8"]["ms"]) / (rows["auto"]["gb_s"]
                                                               * rows["auto"]["ms"])
        assert ratio == pytest.approx((64 + 4) / (2 * 64))
