"""The engine-driven benchmarks on a tiny model: what they count is exact (KV waste by
step, peak blocks, TTFT in steps); their timings are only checked to exist."""

from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.benchmarks.throughput import _generate_measuring_kv


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("LlamaForCausalLM")


def test_throughput_kv_waste_by_step(tiny) -> None:
    """One 20-token prompt, 4 outputs, block size 16: after steps 1-3 it holds 2 blocks
    (32 slots) with 20, 21, 22 tokens stored; after step 4 it has finished (nothing held).
    By step: (12 + 11 + 10) / 96."""
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory_bytes=1 << 20)
    counts, elapsed, meter = _generate_measuring_kv(llm, [(list(range(100, 120)), 4)])
    assert counts == [4] and elapsed > 0
    assert meter.num_samples == 4 and meter.peak_blocks == 2
    assert (meter.num_slots, meter.num_wasted_slots) == (96, 33)
    assert meter.waste_pct_by_step == pytest.approx(100 * 33 / 96)
    assert 100 * 10 / 32 <= meter.waste_pct <= 100 * 12 / 32
