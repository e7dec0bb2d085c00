"""Request deadlines: a server-wide timeout and a maximum queue time per SLA class.

The engine's step loop (engine_core.py) asks `expired()` before every step and aborts what it
returns through `LLMEngine.abort_request(..., reason="timeout")`, which frees the
requests' KV blocks at once and ends their samples with finish_reason "timeout".

- request timeout: `arrival + request_timeout_s`; its stage is "queue" if no sample of
  the request was ever scheduled, "running" otherwise.
- max queue time of a class: `arrival + max_queue_time_s[class]`, only while no sample has
  been scheduled (a request that started in time never times out on this one).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pagoda.core.request import SLA_CLASS_RANKS

_QUEUE, _E2E = "queue", "e2e"


@dataclass(slots=True)
class TimeoutPolicy:
    """`request_timeout_s` (None: none) and per-class maximum queue times, in seconds."""

    request_timeout_s: float | None = None
    max_queue_time_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.request_timeout_s
        if t is not None and not (t > 0 and math.isfinite(t)):
            raise ValueError(f"request timeout must be a positive number of seconds, got {t}")
        for sla_class, s in self.max_queue_time_s.items():
            if sla_class not in SLA_CLASS_RANKS:
                raise ValueError(f"max queue time: unknown SLA class {sla_class!r}; the "
                                 f"classes are {list(SLA_CLASS_RANKS)}")
            if not (s > 0 and math.isfinite(s)):
                raise ValueError(f"max queue time of {sla_class} must be a positive number "
                                 f"of seconds, got {s}")

    @property
    def enabled(self) -> bool:
        return self.request_timeout_s is not None or bool(self.max_queue_time_s)


@dataclass(slots=True, frozen=True)
class Expiry:
    request_id: str
    sla_class: str
    stage: str  # "queue" or "running"


class DeadlineTracker:
    """The deadlines of in-flight requests in one heap (engine thread only)."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[float, int, str, str]] = []
        self._classes: dict[str, str] = {}  # tracked request id -> SLA class
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._classes)

    def add(self, request_id: str, sla_class: str, arrival_time: float) -> None:
        deadlines = []
        if self.policy.request_timeout_s is not None:
            deadlines.append((arrival_time + self.policy.request_timeout_s, _E2E))
        queue_s = self.policy.max_queue_time_s.get(sla_class)
        if queue_s is not None:
            deadlines.append((arrival_time + queue_s, _QUEUE))
        if not deadlines:
            return
        self._classes[request_id] = sla_class
        for deadline, kind in deadlines:
            heapq.heappush(self._heap, (deadline, next(self._seq), request_id, kind))

    def discard(self, request_id: str) -> None:
        """Forgets a request (finished or aborted); its heap entries are skipped later."""
        self._classes.pop(request_id, None)

    def expired(self, now: float, stage_of: Callable[[str], str | None]) -> list[Expiry]:
        """The tracked requests past a deadline at `now`, each once (then forgotten).

        `stage_of(request_id)` is "queue" (never scheduled), "running", or None for a
        request the engine no longer has (ended some other way: skipped).
        """
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, request_id, kind = heapq.heappop(self._heap)
            sla_class = self._classes.get(request_id)
            if sla_class is None:
                continue
            stage = stage_of(request_id)
            if stage is None:
                del self._classes[request_id]
                continue
            if kind == _QUEUE and stage != "queue":
                continue
            del self._classes[request_id]
            out.append(Expiry(request_id, sla_class, stage))
        if not self._classes:
            self._heap.clear()
        return out


def request_stage(engine, request_id: str) -> str | None:
    """"running" if any sample of the engine's request `request_id` was ever scheduled,
    "queue" if none was, None if the engine does not have the request.

    NOTE: reads engine internals (output_processor.requests, scheduler.requests), as
    engine_core's `_running_request_ids` does; engine thread only.
    """
    state = engine.output_processor.requests.get(request_id)
    if state is None:
        return None
    for sample in state.samples:
        if sample.finish_reason is not None:
            return "running"  # NOTE: a sample that already finished was scheduled.
        req = engine.scheduler.requests.get(sample.req_id)
        if req is not None and req.first_scheduled_time is not None:
            return "running"
    return "queue"
