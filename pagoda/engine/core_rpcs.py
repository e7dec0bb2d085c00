"""The named queries the engine core answers between two steps (`RpcCommand`), in the engine
thread or the engine-core process alike: each takes the LLMEngine and keyword arguments
and returns plain, picklable data.

| name        | answer                                                                   |
|-------------|--------------------------------------------------------------------------|
| integrity   | `check_integrity()`'s verdict, queue counts, KV usage, the core's pid    |
| memory      | the core process's RSS, Python object count and its KV pools' bytes      |
| request_ids | the ids of every request the engine holds (parents, not n > 1 children)  |
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def all_request_ids(engine: Any) -> list[str]:
    return list(engine.output_processor.requests)


def integrity_report(engine: Any) -> dict[str, Any]:
    """The scheduler's integrity check and counts; `pid`: the process the engine runs in."""
    try:
        engine.check_integrity()
        error = None
    except AssertionError as e:
        error = str(e) or "integrity check failed"
    s = engine.get_stats()
    return {"ok": error is None, "error": error, "num_running": s.num_running,
            "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
            "num_unfinished": engine.get_num_unfinished_requests(),
            "num_blocks": engine.num_blocks, "pid": os.getpid()}


def memory_report(engine: Any, trim: bool = False) -> dict[str, int]:
    """RSS and the pools' resident bytes of the engine's process; `trim`: first hand the
    C heap's free memory back to the system (malloc_trim), which tells a leak from
    allocator slack."""
    pools = engine.executor.kv_pools()
    out = {"rss_bytes": rss_bytes(), "num_py_objects": len(gc.get_objects())}
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["rss_after_trim_bytes"] = rss_bytes()
    for name, pairs in pools.items():
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                 for pair in pairs or [] for t in pair]
        out[f"{name}_bytes"] = sum(b - a for a, b in spans)
        out[f"{name}_resident_bytes"] = resident_bytes(spans)
    return out


RPCS: dict[str, Callable[..., Any]] = {
    "integrity": integrity_report,
    "memory": memory_report,
    "request_ids": all_request_ids,
}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """Resident bytes (Linux smaps) of the mappings overlapping the address `spans`.

    NOTE: a zero-filled pool is allocated by mmap and counts towards RSS only as its pages
    are first written: the KV pool's growth is not a leak, this tells the two apart.
    Mappings are counted whole (a large tensor has its own), each at most once.
    """
    total, counted = 0, set()
    start = end = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            start, end = lo, hi
        elif head == "Rss:" and (start, end) not in counted and any(
                a < end and start < b for a, b in spans):
            counted.add((start, end))
            total += int(line.split()[1]) * 1024
    return total
