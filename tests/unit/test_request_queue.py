"""Scheduling policies as queues: FCFS order and front insertion of preempted requests; the
priority policy's (effective class, priority, arrival) order, aging, victims and ranks."""

from __future__ import annotations

import math

import pytest

from pagoda.core.request import Request
from pagoda.core.request_queue import FCFSQueue, PriorityQueue, create_request_queue
from pagoda.sampling_params import SamplingParams


def make_request(req_id: str, arrival: float, sla_class: str = "interactive",
                 priority: int = 0) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams(), arrival_time=arrival,
                   priority=priority, sla_class=sla_class)


def drain(queue) -> list[str]:
    order = []
    while len(queue):
        assert queue.peek() is next(iter(queue))
        order.append(queue.pop().req_id)
    return order


def test_fcfs_order_and_preempted_request_goes_first() -> None:
    queue = create_request_queue("fcfs")
    assert isinstance(queue, FCFSQueue)
    a, b, c = (make_request(r, arrival=t) for r, t in (("a", 0), ("b", 1), ("c", 2)))
    for r in (a, b, c):
        queue.add(r)
    queue.remove(b)
    queue.prepend(make_request("p", arrival=9, sla_class="batch"))
    assert [r.req_id for r in queue] == ["p", "a", "c"]
    assert drain(queue) == ["p", "a", "c"]
    # FCFS never preempts by rank; its victim is the newest running request.
    assert not queue.outranks(a, c) and not queue.outranks(c, a)
    assert queue.pick_victim([a, b, c]) is c
    running = [c, a, b]
    queue.order_running(running)
    assert running == [c, a, b]


def test_priority_orders_by_class_then_priority_then_arrival() -> None:
    queue = create_request_queue("priority", aging_interval_s=math.inf)
    assert isinstance(queue, PriorityQueue)
    reqs = [
        make_request("batch", 0.0, "batch"),
        make_request("async-p1", 1.0, "async", priority=1),
        make_request("async-p0-late", 3.0, "async"),
        make_request("async-p0", 2.0, "async"),
        make_request("inter-late", 5.0),
        make_request("inter-neg", 6.0, priority=-1),
        make_request("inter", 4.0),
    ]
    for r in reqs:
        queue.add(r)
    assert [r.req_id for r in queue] == [
        "inter-neg", "inter", "inter-late", "async-p0", "async-p0-late", "async-p1", "batch"
    ]
    assert drain(queue) == [
        "inter-neg", "inter", "inter-late", "async-p0", "async-p0-late", "async-p1", "batch"
    ]


def test_aging_promotes_one_class_per_interval() -> None:
    queue = PriorityQueue(aging_interval_s=10.0)
    batch = make_request("batch", 0.0, "batch")  # rank (2, 0)
    assert queue.rank(batch) == (2, 0)
    one_tick = make_request("inter@15", 15.0)  # (1, 0): still ahead of the batch request
    two_ticks = make_request("inter@25", 25.0)  # (2, 0): ties, the batch one arrived first
    two_ticks_urgent = make_request("inter@26-p-1", 26.0, priority=-1)  # (2, -1): ahead
    three_ticks = make_request("inter@31", 31.0)  # (3, 0): behind
    for r in (three_ticks, two_ticks, batch, two_ticks_urgent, one_tick):
        queue.add(r)
    assert [queue.rank(r) for r in queue] == [(1, 0), (2, -1), (2, 0), (2, 0), (3, 0)]
    assert drain(queue) == ["inter@15", "inter@26-p-1", "batch", "inter@25", "inter@31"]


def test_preempted_request_keeps_its_rank_and_remove_keeps_the_heap() -> None:
    queue = PriorityQueue(aging_interval_s=math.inf)
    reqs = {name: make_request(name, t, cls) for name, t, cls in (
        ("i0", 0.0, "interactive"), ("i1", 1.0, "interactive"), ("a0", 2.0, "async"),
        ("a1", 3.0, "async"), ("b0", 4.0, "batch"))}
    for name in ("b0", "a1", "i1", "a0"):
        queue.add(reqs[name])
    # A preempted batch request does not jump the queue as it does under FCFS.
    queue.prepend(reqs["i0"])
    queue.remove(reqs["a0"])
    with pytest.raises(ValueError, match="not in the queue"):
        queue.remove(reqs["a0"])
    assert drain(queue) == ["i0", "i1", "a1", "b0"]


def test_priority_victim_is_lowest_rank_then_newest() -> None:
    queue = PriorityQueue(aging_interval_s=math.inf)
    old_batch = make_request("old-batch", 0.0, "batch")
    inter = make_request("inter", 1.0)
    new_batch = make_request("new-batch", 2.0, "batch")
    low = make_request("inter-p5", 3.0, priority=5)
    # Candidates are in start order: among equal ranks the later one is the victim.
    assert queue.pick_victim([old_batch, inter, new_batch]) is new_batch
    assert queue.pick_victim([new_batch, inter, old_batch]) is old_batch
    # Class before priority: a priority-5 interactive request outranks any batch one.
    assert queue.pick_victim([low, old_batch, inter]) is old_batch
    assert queue.pick_victim([low, inter]) is low
    assert queue.outranks(inter, low) and not queue.outranks(low, inter)
    # Equal rank never preempts (no thrash between equals).
    assert not queue.outranks(old_batch, new_batch) and not queue.outranks(new_batch, old_batch)
    running = [new_batch, low, old_batch, inter]
    queue.order_running(running)
    assert [r.req_id for r in running] == ["inter", "inter-p5", "new-batch", "old-batch"]


def test_bad_policy_and_bad_class_are_rejected() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")
    with pytest.raises(ValueError, match="aging_interval_s"):
        PriorityQueue(aging_interval_s=0.0)
    with pytest.raises(ValueError, match="sla_class"):
        make_request("x", 0.0, "realtime")
