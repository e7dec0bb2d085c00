"""Test-only endpoints (--enable-debug-endpoints): engine integrity (orphan requests
included), memory (RSS and the KV pool's resident bytes, of the process the engine runs
in), fault injection in an engine step and in a handler. The engine answers named RPCs
(engine/core_rpcs.py), in its thread or its own process alike."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pagoda.entrypoints.openai.protocol import FaultRequest
from pagoda.entrypoints.openai.serving import ServerState


def add_debug_routes(app: FastAPI, state: ServerState) -> None:
    """Adds the routes of the module docstring to `app`."""

    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        report = await state.engine.rpc("integrity")
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
        return await state.engine.rpc("memory", trim=trim)
