"""The KV waste meter's averages, by hand."""

from __future__ import annotations

import pytest

from pagoda.benchmarks.kv_waste import KVWasteMeter
from pagoda.core.kv_cache_manager import KVOccupancy


def test_time_averaged_and_by_step_waste() -> None:
    meter = KVWasteMeter()
    assert meter.waste_pct == 0.0 and meter.waste_pct_by_step == 0.0
    meter.add(KVOccupancy(num_blocks=4, num_slots=64, num_tokens=48), 1.0)  # 16 wasted
    meter.add(KVOccupancy(num_blocks=8, num_slots=128, num_tokens=120), 3.0)  # 8 wasted
    meter.add(KVOccupancy(num_blocks=0, num_slots=0, num_tokens=0), 5.0)  # idle: no weight
    # time-averaged: (1 * 16 + 3 * 8) / (1 * 64 + 3 * 128) = 40 / 448
    assert meter.waste_pct == pytest.approx(100 * 40 / 448)
    # by step: (16 + 8) / (64 + 128) = 12.5%
    assert meter.waste_pct_by_step == 12.5
    assert meter.summary() == {"waste_pct": pytest.approx(100 * 40 / 448),
                               "waste_pct_by_step": 12.5, "num_samples": 3, "peak_blocks": 8}
