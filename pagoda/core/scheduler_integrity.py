"""`Scheduler.check_integrity`: the scheduler's invariants, checked between steps (tests,
`/debug/integrity`).

Device blocks (core/kv_cache_manager.py's checks: every registered block computed), swap
host pool and host tier; running requests RUNNING, waiting ones in a waiting state holding
no device blocks and, unless SWAPPED, no computed tokens; per-class preemptions adding up;
queues and the request map agreeing; each request's in-flight tokens its share of the
uncommitted steps (async scheduling), a waiting request awaiting no token.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagoda.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagoda.core.scheduler import Scheduler

_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.SWAPPED, RequestStatus.PREEMPTED)


def check_scheduler_integrity(s: Scheduler) -> None:
    """Asserts the invariants above; AssertionError with a message."""
    s.kv.check_integrity(s.running)
    for req in s.running:
        assert req.status == RequestStatus.RUNNING, f"{req.req_id} in running as {req.status}"
    waiting = list(s.waiting)
    for req in waiting:
        assert req.status in _WAITING_STATES, f"{req.req_id} waiting as {req.status}"
        assert not s.kv.get_block_ids(req.req_id), f"waiting {req.req_id} holds blocks"
        assert req.status == RequestStatus.SWAPPED or req.num_computed_tokens == 0, (
            f"waiting {req.req_id} has computed tokens without holding KV"
        )
    s.preemptor.check_integrity(waiting)
    assert sum(s.sla_preemptions.values()) == s.num_preemptions, (
        "per-class preemptions do not add up"
    )
    assert len(s.running) + len(waiting) == len(s.requests), "request map drift"
    assert {r.req_id for r in [*s.running, *waiting]} == s.requests.keys(), "request map drift"
    _check_in_flight(s, waiting)


def _check_in_flight(s: Scheduler, waiting: list[Request]) -> None:
    """Each request's in-flight tokens are its share of the uncommitted steps; a
    waiting request has none and no placeholders (its last step was committed)."""
    in_flight: Counter[int] = Counter()
    for out, step_reqs in s._uncommitted.values():
        for req_id, n in out.num_scheduled_tokens.items():
            in_flight[id(step_reqs[req_id])] += n
    for req in [*s.running, *waiting]:
        assert req.num_tokens_in_flight == in_flight[id(req)], (
            f"{req.req_id}: {req.num_tokens_in_flight} tokens in flight, "
            f"steps say {in_flight[id(req)]}")
        assert 0 <= req.num_output_placeholders <= len(s._uncommitted), (
            f"{req.req_id}: {req.num_output_placeholders} placeholders")
    for req in waiting:
        assert not req.num_output_placeholders, f"waiting {req.req_id} awaits a token"
