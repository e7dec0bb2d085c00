"""`pagoda bench long-context` on small sizes: the peak KV blocks it reports are exact for
each mode (dense holds the prompt; the window and the sinks hold their cache); timings are
only checked to exist."""

from __future__ import annotations

import argparse

from pagoda.benchmarks.long_context import add_long_context_args, run_long_context


def test_long_context_bench_counts_each_modes_blocks() -> None:
    p = argparse.ArgumentParser()
    add_long_context_args(p)
    args = p.parse_args(["--prompt-lens", "600", "--decode-tokens", "4", "--window", "64",
                         "--attention-sinks", "4", "--hidden-size", "64", "--num-layers", "1",
                         "--max-num-batched-tokens", "128", "--dtype", "float32"])
    report = run_long_context(args)
    peak = {r["mode"]: r["peak_kv_blocks"] for r in report["runs"]}
    # Dense: ceil(605 / 16) = 38 blocks (the last decode step's table; block size 16).
    # Window 64 with chunks of 128: a chunk from c holds [(c - 63) // 16, ceil((c + 128)
    # / 16)) = 12 entries at most. Sinks (S 4, W 60): one sink block and 12 more at most.
    assert peak == {"dense": 38, "window": 12, "sinks": 13}
    for row in report["runs"]:
        assert row["prefill_s"] > 0 and row["decode_ms_per_token"] > 0
        assert row["kv_bytes"] == row["peak_kv_blocks"] * 16 * 2 * 1 * 64 * 4  # K+V, 1 head
