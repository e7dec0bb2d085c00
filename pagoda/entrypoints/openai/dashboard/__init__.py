"""GET /dashboard: a live page served by the server itself, drawn with the vendored uPlot
(static/uPlot.*, MIT, see static/uPlot.LICENSE; no CDN). The page polls
GET /dashboard/data (data.py: the same registry as /metrics) every second.

Like /metrics, these routes are not behind `--api-key` (a browser cannot add the bearer
header to a page load, and the numbers are the ones /metrics already shows);
`--disable-dashboard` leaves them out.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, HTMLResponse

from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.openai.dashboard.data import DashboardData

STATIC_DIR = Path(__file__).parent / "static"
_STATIC_TYPES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
                 "dashboard.js": "text/javascript", "uPlot.LICENSE": "text/plain"}


def add_dashboard_routes(app: FastAPI, metrics: EngineMetrics) -> None:
    data = DashboardData(metrics.registry)
    page = (STATIC_DIR / "index.html").read_text().replace("{{model}}",
                                                          html.escape(metrics.model_name))

    # NOTE: the page and its files are for browsers, not API clients: left out of
    # /openapi.json (only the JSON feed is documented there).
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        return {"model": metrics.model_name, **data.snapshot()}

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> FileResponse:
        media_type = _STATIC_TYPES.get(name)
        if media_type is None:
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=media_type)
