"""KV memory waste over a run: slots allocated to running requests minus the tokens stored
in them, over the slots allocated (vLLM's paged attention claims under 4%).

Sampled after every engine step, when each running request's blocks cover exactly its
computed tokens, so what is wasted is the unfilled tail of each request's last block (and
blocks allocated ahead of the tokens that will fill them). Shared blocks (prefix hits,
n > 1 samples) count once (`KVCacheManager.occupancy`).

| reported           | meaning                                                          |
|--------------------|------------------------------------------------------------------|
| waste_pct          | time-averaged: sum(dt * wasted slots) / sum(dt * allocated slots),|
|                    | dt = the wall time of the step after which the sample was taken  |
| waste_pct_by_step  | every step weighted alike: sum(wasted) / sum(allocated)          |
| peak_blocks        | most distinct blocks held at a sample                            |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.core.kv_cache_manager import KVOccupancy


@dataclass
class KVWasteMeter:
    slot_seconds: float = 0.0
    wasted_slot_seconds: float = 0.0
    num_slots: int = 0
    num_wasted_slots: int = 0
    num_samples: int = 0
    peak_blocks: int = 0

    def add(self, occupancy: KVOccupancy, duration_s: float) -> None:
        """One sample, held for `duration_s` seconds."""
        self.num_samples += 1
        self.slot_seconds += duration_s * occupancy.num_slots
        self.wasted_slot_seconds += duration_s * occupancy.num_wasted_slots
        self.num_slots += occupancy.num_slots
        self.num_wasted_slots += occupancy.num_wasted_slots
        self.peak_blocks = max(self.peak_blocks, occupancy.num_blocks)

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.wasted_slot_seconds / self.slot_seconds if self.slot_seconds else 0.0

    @property
    def waste_pct_by_step(self) -> float:
        return 100.0 * self.num_wasted_slots / self.num_slots if self.num_slots else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "waste_pct": self.waste_pct,
            "waste_pct_by_step": self.waste_pct_by_step,
            "num_samples": self.num_samples,
            "peak_blocks": self.peak_blocks,
        }


def sample(engine: Any) -> KVOccupancy:
    """The occupancy of an LLMEngine's running requests, between two steps."""
    return engine.kv_cache_manager.occupancy(engine.scheduler.running)
