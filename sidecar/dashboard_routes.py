"""The browser dashboard on the control plane: `/dashboard` and its static files (uPlot
vendored under dashboard/vendor/), `/debug/workers` (what each worker holds right now, from
its row in the segment) and `/debug/dashboard`, everything the page shows in one read-only
document, so one poll is one request.

The page itself carries no data, so it is served without the token; every data endpoint it
fetches sits behind the same guard as `/debug/*` (PROXY_DEBUG_REQUIRES_TOKEN). The same routes,
and nothing else of the control plane, are what the dashboard's own listener serves
(PROXY_UI_LISTEN, sidecar/ui_listener.py).
"""

from __future__ import annotations

import logging
import time
from importlib import resources
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.http import JSONResponse, error_response
from shm_schema import Segment, layout, process_identity, read_all, read_rows, row_contributions

log = logging.getLogger("cacheroute.sidecar.dashboard")

Handler = Callable[[Request], Awaitable[Response]]
Guard = Callable[[Handler], Handler]

# The only files served: a fixed map, so no request path ever reaches the file system.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
# Scripts and styles only from this origin, data only from this origin: an instance id that
# slipped past escaping still could not load or send anything anywhere.
HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _load_assets() -> dict[str, bytes]:
    """Read once at start through importlib.resources, so an installed wheel serves the same
    files as the source tree (they are package data, see pyproject.toml). A missing file costs
    the dashboard, never the control plane: it is logged and left out."""
    folder = resources.files("sidecar") / "dashboard"
    assets = {}
    for name in ASSETS:
        try:
            assets[name] = (folder / name).read_bytes()
        except OSError as exc:
            log.error("dashboard file %s missing (%s): /dashboard will answer 503", name, exc.strerror)
    return assets


def worker_shares(seg: Segment) -> list[dict[str, Any]]:
    """Every claimed worker row: identity, heartbeat, event ring, and the inflight it holds
    per instance (shares tagged with a generation the slot no longer has are stale: skipped)."""
    current = {s.slot: s for s in read_all(seg)}
    now_ns = time.time_ns()
    capacity = seg.geometry.ring_capacity
    workers = []
    for row in read_rows(seg):
        held = {current[slot].instance_id: count
                for slot, (generation, count) in row_contributions(seg, row.row, layout.LANE_INFLIGHT).items()
                if slot in current and current[slot].generation == generation}
        pending = row.ring_tail - row.ring_head
        workers.append({
            "row": row.row, "pid": row.pid, "worker_index": row.worker_index,
            "alive": process_identity.is_alive(row.identity),
            "heartbeat_age_ms": (now_ns - row.heartbeat_ns) // 1_000_000,
            "inflight_held": sum(held.values()), "inflight_by_instance": held,
            "events_pending": pending, "ring_capacity": capacity,
            # A full ring means the worker is keeping events in its local spill right now.
            "ring_full": pending >= capacity, "events_dropped": row.events_dropped,
        })
    return sorted(workers, key=lambda w: (w["worker_index"], w["row"]))


def dashboard_routes(seg: Segment, reads: Guard, document: Callable[[], dict[str, Any]]) -> list[Route]:
    """`document()` builds the body of /debug/dashboard (sidecar/app.py: status, loads,
    resources, topology, pool_resource; the worker rows are added here)."""
    assets = _load_assets()

    def asset(name: str) -> Response:
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    async def page(request: Request) -> Response:
        if len(assets) != len(ASSETS):
            return error_response(503, "dashboard_unavailable",
                                  "dashboard files are missing from this installation")
        return asset("index.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return error_response(404, "not_found", "no such dashboard file")
        return asset(name)

    async def workers(request: Request) -> Response:
        return JSONResponse({"ok": True, "generated_at_ms": now_ms(),
                             "workers": worker_shares(seg)})

    async def everything(request: Request) -> Response:
        return JSONResponse({"ok": True, "generated_at_ms": now_ms(), **document(),
                             "workers": worker_shares(seg)})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/{name:path}", static, methods=["GET"]),
        Route("/debug/workers", reads(workers), methods=["GET"]),
        Route("/debug/dashboard", reads(everything), methods=["GET"]),
    ]
