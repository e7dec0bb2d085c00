"""Test-only endpoints (--enable-debug-endpoints): engine integrity (orphan requests
included), memory (RSS and the KV pool's resident bytes), fault injection in an engine
step and in a handler."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from pagoda.entrypoints.openai.protocol import FaultRequest
from pagoda.entrypoints.openai.serving import ServerState


def add_debug_routes(app: FastAPI, state: ServerState) -> None:
    """Adds the routes of the module docstring to `app`."""

    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        def check(engine: Any) -> dict[str, Any]:
            try:
                engine.check_integrity()
                error = None
            except AssertionError as e:
                error = str(e) or "integrity check failed"
            s = engine.get_stats()
            return {"ok": error is None, "error": error, "num_running": s.num_running,
                    "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                    "num_unfinished": engine.get_num_unfinished_requests(),
                    "num_blocks": engine.num_blocks}

        report = await state.engine.call(check)
        # NOTE: a request the engine holds for no client is a leak the block accounting
        # cannot see (its blocks are all correctly counted as used).
        orphans = await state.engine.orphan_request_ids()
        report["num_orphans"] = len(orphans)
        if orphans and report["ok"]:
            report["ok"] = False
            report["error"] = f"{len(orphans)} requests held with no client: {orphans[:5]}"
        return report

    @app.post("/debug/fault")
    async def fault(body: FaultRequest) -> dict[str, int]:
        state.engine.inject_fault(body.num_steps)
        return {"num_steps": body.num_steps}

    @app.get("/debug/raise")
    async def raise_unexpected() -> None:
        raise RuntimeError("injected handler fault (test hook)")

    @app.get("/debug/memory")
    async def memory(trim: bool = False) -> dict[str, int]:
        """RSS and the pools' resident bytes; `trim`: first hand the C heap's free memory
        back to the system (malloc_trim), which tells a leak from allocator slack."""
        # NOTE: the in-process executor's KV tensors, read on the engine thread.
        pools = await state.engine.call(lambda e: e.executor.kv_pools())
        out = {"rss_bytes": _rss_bytes(), "num_py_objects": len(gc.get_objects())}
        if trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            out["rss_after_trim_bytes"] = _rss_bytes()
        for name, pairs in pools.items():
            spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                     for pair in pairs or [] for t in pair]
            out[f"{name}_bytes"] = sum(b - a for a, b in spans)
            out[f"{name}_resident_bytes"] = resident_bytes(spans)
        return out


def _rss_bytes() -> int:
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
