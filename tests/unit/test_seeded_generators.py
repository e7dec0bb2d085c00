"""The runner's seeded streams: a request that comes back continues from its tokens."""

from __future__ import annotations

import torch

from pagoda.engine.step_pipeline import MAX_STEPS_IN_FLIGHT
from pagoda.worker.seeded_generators import NUM_CHECKPOINTS, SeededGenerators


def draws(gens: SeededGenerators, req_id: str, first_position: int, n: int) -> list[float]:
    """Sample positions first_position.. one draw each, as the runner does."""
    out = []
    for pos in range(first_position, first_position + n):
        gens.checkpoint(req_id, pos)
        out.append(torch.rand(1, generator=gens.get(req_id)).item())
    return out


def test_unseeded_requests_have_no_stream() -> None:
    gens = SeededGenerators()
    gens.add("u", None, 5)
    gens.checkpoint("u", 5)
    assert gens.get("u") is None and set(gens) == set()


def test_a_request_back_at_a_sampled_position_is_rewound_there() -> None:
    want = draws(_fresh("r"), "r", 10, 4)
    gens = _fresh("r")
    assert draws(gens, "r", 10, 3) == want[:3]
    gens.add("r", 3, 12)  # positions 12 (and 11's draw) were rolled back: 12 again
    assert draws(gens, "r", 12, 2) == want[2:]


def test_a_request_back_past_its_samples_keeps_its_stream() -> None:
    """Preempted after its commit: nothing to rewind (re-seeding would repeat the start)."""
    want = draws(_fresh("r"), "r", 10, 4)
    gens = _fresh("r")
    assert draws(gens, "r", 10, 2) == want[:2]
    gens.add("r", 3, 12)
    assert draws(gens, "r", 12, 2) == want[2:]
    gens.remove("r")
    gens.add("r", 3, 12)  # a new request under the same id: a new stream
    assert draws(gens, "r", 12, 1) == want[:1]


def test_every_step_in_flight_can_be_undone() -> None:
    assert NUM_CHECKPOINTS >= MAX_STEPS_IN_FLIGHT
    want = draws(_fresh("r"), "r", 0, 5)
    gens = _fresh("r")
    draws(gens, "r", 0, 3 + MAX_STEPS_IN_FLIGHT)
    gens.add("r", 3, 3)
    assert draws(gens, "r", 3, 2) == want[3:]


def _fresh(req_id: str) -> SeededGenerators:
    gens = SeededGenerators()
    gens.add(req_id, 3, 10)
    return gens
