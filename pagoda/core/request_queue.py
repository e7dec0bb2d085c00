"""The waiting queue, behind one interface so scheduling policies are swappable.

A policy is a queue plus its notion of rank, which the scheduler also uses to order the
running requests and to pick preemption victims:

| policy   | waiting order                                | victim (KV pressure)       | preempts by rank |
|----------|----------------------------------------------|----------------------------|------------------|
| fcfs     | arrival; a preempted request goes in front   | newest running request     | never            |
| priority | (effective class, priority, arrival)         | lowest rank, newest among  | yes: a better    |
|          |                                              | equals                     | waiting request  |

Priority aging: the effective class of a request is its SLA class rank plus the number of
`aging_interval_s` ticks of a global clock before it arrived. A request that has waited k
ticks longer than another therefore ranks k classes better: a "batch" request (rank 2)
ties fresh "interactive" ones after two ticks and wins on arrival. Because the shift
depends only on arrival, ranks never change while a request waits, so the queue is a
plain heap and the order is a pure function of the requests (no clock reads).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from pagoda.core.request import SLA_CLASS_RANKS, Request

DEFAULT_AGING_INTERVAL_S = 10.0


class RequestQueue(Protocol):
    def add(self, request: Request) -> None:
        """Queue a new request."""

    def prepend(self, request: Request) -> None:
        """Queue a preempted request (FCFS: at the front)."""

    def requeue(self, requests: Sequence[Request]) -> None:
        """Put back requests taken out of the queue in this step, in their order, where they
        were (FCFS: at the front)."""

    def peek(self) -> Request:
        """The request to admit next; IndexError if empty."""

    def pop(self) -> Request:
        """Remove and return `peek()`."""

    def remove(self, request: Request) -> None:
        """Remove a queued request (abort); ValueError if absent."""

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether `waiting` may preempt `running` to get its slot or blocks."""

    def order_running(self, running: list[Request]) -> None:
        """Reorder the running list in place, best first, so that budget goes to the best
        requests and the last one is the victim under KV pressure. Stable."""

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt among `candidates` (in start order)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def requeue(self, requests: Sequence[Request]) -> None:
        self._q.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return False

    def order_running(self, running: list[Request]) -> None:
        return None

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Serves the best (effective class, priority) first, then the earliest arrival.

    `aging_interval_s` = inf disables aging (pure class, then priority order).
    """

    def __init__(self, aging_interval_s: float = DEFAULT_AGING_INTERVAL_S) -> None:
        if not aging_interval_s > 0:
            raise ValueError(f"aging_interval_s must be > 0, got {aging_interval_s}")
        self.aging_interval_s = aging_interval_s
        # Entries: (rank, arrival_time, insertion seq, request); the seq keeps the heap from
        # ever comparing requests and makes equal keys first-in first-out.
        self._heap: list[tuple[tuple[int, int], float, int, Request]] = []
        self._seq = itertools.count()

    def rank(self, request: Request) -> tuple[int, int]:
        """(effective class, priority), lower is better; the effective class is the SLA
        class rank plus the aging ticks before arrival (see the module docstring)."""
        ticks = math.floor(request.arrival_time / self.aging_interval_s)
        return SLA_CLASS_RANKS[request.sla_class] + ticks, request.priority

    def add(self, request: Request) -> None:
        entry = (self.rank(request), request.arrival_time, next(self._seq), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        # NOTE: a preempted request keeps its rank (its arrival is unchanged), so it goes
        # back to where it belongs: no special case.
        self.add(request)

    def requeue(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.req_id} is not in the queue")

    def outranks(self, waiting: Request, running: Request) -> bool:
        return self.rank(waiting) < self.rank(running)

    def order_running(self, running: list[Request]) -> None:
        # NOTE: sort is stable, so equal ranks stay in start order and the newest of the
        # worst rank ends up last.
        running.sort(key=self.rank)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        worst = max(range(len(candidates)), key=lambda i: (self.rank(candidates[i]), i))
        return candidates[worst]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In serving order."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


SCHEDULING_POLICIES: dict[str, Callable[[float], RequestQueue]] = {
    "fcfs": lambda aging_interval_s: FCFSQueue(),
    "priority": PriorityQueue,
}


def create_request_queue(
    policy: str, aging_interval_s: float = DEFAULT_AGING_INTERVAL_S
) -> RequestQueue:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy must be one of {sorted(SCHEDULING_POLICIES)}, got {policy!r}"
        )
    return SCHEDULING_POLICIES[policy](aging_interval_s)
