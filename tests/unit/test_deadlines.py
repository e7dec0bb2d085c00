"""deadlines.py: which requests expire when, and at which stage; policy validation."""

from __future__ import annotations

import pytest

from pagoda.engine.deadlines import DeadlineTracker, Expiry, TimeoutPolicy


def stages(**known: str):
    return lambda rid: known.get(rid)


def test_policy_validation() -> None:
    assert not TimeoutPolicy().enabled
    assert TimeoutPolicy(max_queue_time_s={"batch": 1.0}).enabled
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request timeout"):
            TimeoutPolicy(request_timeout_s=bad)
    with pytest.raises(ValueError, match="unknown SLA class 'gold'"):
        TimeoutPolicy(max_queue_time_s={"gold": 1.0})
    with pytest.raises(ValueError, match="batch"):
        TimeoutPolicy(max_queue_time_s={"batch": 0.0})


def test_request_timeout_stage_is_queue_or_running() -> None:
    t = DeadlineTracker(TimeoutPolicy(request_timeout_s=5.0))
    t.add("a", "interactive", 0.0)
    t.add("b", "batch", 1.0)
    t.add("c", "async", 2.0)
    known = stages(a="running", b="queue", c="running")
    assert t.expired(4.9, known) == []
    assert t.expired(6.0, known) == [Expiry("a", "interactive", "running"),
                                     Expiry("b", "batch", "queue")]
    assert t.expired(6.5, known) == [] and len(t) == 1
    t.discard("c")
    assert t.expired(100.0, known) == [] and len(t) == 0


def test_max_queue_time_only_until_scheduled() -> None:
    t = DeadlineTracker(TimeoutPolicy(request_timeout_s=10.0,
                                      max_queue_time_s={"batch": 1.0}))
    t.add("waits", "batch", 0.0)
    t.add("started", "batch", 0.0)
    t.add("other", "interactive", 0.0)  # NOTE: no queue limit for its class
    known = {"waits": "queue", "started": "running", "other": "queue"}
    assert t.expired(1.0, known.get) == [Expiry("waits", "batch", "queue")]
    # The started one outlived its queue deadline; its request timeout still holds.
    assert t.expired(10.0, known.get) == [Expiry("started", "batch", "running"),
                                          Expiry("other", "interactive", "queue")]


def test_requests_the_engine_no_longer_has_are_skipped() -> None:
    t = DeadlineTracker(TimeoutPolicy(request_timeout_s=1.0))
    t.add("gone", "interactive", 0.0)
    assert t.expired(2.0, stages()) == [] and len(t) == 0
