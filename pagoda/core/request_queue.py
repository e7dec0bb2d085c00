"""The waiting queue, behind one interface so scheduling policies are swappable."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagoda.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
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

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


_POLICIES = {"fcfs": FCFSQueue}


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in _POLICIES:
        raise ValueError(f"scheduling_policy must be one of {sorted(_POLICIES)}, got {policy!r}")
    return _POLICIES[policy]()
