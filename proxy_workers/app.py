"""The data plane of one worker: OpenAI-compatible routes plus per-worker debug endpoints."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cacheroute.auth import TokenGuard, load_token
from cacheroute.clock import now_ms
from cacheroute.config import Settings
from cacheroute.http import (
    ERROR_HANDLERS,
    HTTPError,
    JSONResponse,
    from_http_error,
    read_body,
)
from cacheroute.routing.report import instance_loads

from . import metrics
from .exchange import ProxyExchange
from .pipeline import Pipeline
from .request_model import Endpoint, recover
from .router import Router
from .upstream import Upstream

log = logging.getLogger("cacheroute.worker")


@dataclass
class WorkerContext:
    settings: Settings
    index: int
    router: Router
    upstream: Upstream
    pipeline: Pipeline

    @property
    def name(self) -> str:
        return f"w{self.index}-pid{os.getpid()}"

    def identity(self) -> dict[str, Any]:
        return {"role": "worker", "worker_index": self.index, "pid": os.getpid(),
                "row": self.router.row.row, "name": self.name}


def build_app(ctx: WorkerContext, lifespan: Any = None) -> ASGIApp:
    limit = ctx.settings.max_body_bytes
    settings = ctx.settings
    debug_guard = TokenGuard(load_token(settings.cp_token, settings.cp_token_file)
                             if settings.debug_requires_token else None)

    def proxy_route(endpoint: Endpoint):  # type: ignore[no-untyped-def]
        async def handle(request: Request) -> Any:
            trace: dict[str, Any] = {"proxy_recv_ms": now_ms(), "worker": ctx.name}
            try:
                proxy_request = recover(endpoint, await read_body(request, limit))
            except HTTPError as exc:
                return from_http_error(exc)
            trace["request_id"] = proxy_request.request_id
            return ProxyExchange(ctx.router, ctx.pipeline, ctx.upstream, proxy_request, trace,
                                 retries=settings.retry_attempts)
        return handle

    async def debug_instance_loads(request: Request) -> Response:
        try:
            debug_guard.check(request)
        except HTTPError as exc:
            return from_http_error(exc)
        include_dead = request.query_params.get("include_dead", "true").lower() in ("1", "true", "yes")
        return JSONResponse(instance_loads(
            ctx.router.view, ctx.router.scorer, strategy=ctx.router.strategy.name,
            ttl_s=ctx.settings.instance_ttl_s, include_dead=include_dead,
            answered_by=ctx.identity()))

    async def metrics_endpoint(request: Request) -> Response:
        try:
            debug_guard.check(request)
        except HTTPError as exc:
            return from_http_error(exc)
        return Response(metrics.render(ctx.router.view), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, **ctx.identity(), "outliers": ctx.router.outliers.describe()})

    routes = [
        Route(Endpoint.CHAT.path, proxy_route(Endpoint.CHAT), methods=["POST"]),
        Route(Endpoint.COMPLETIONS.path, proxy_route(Endpoint.COMPLETIONS), methods=["POST"]),
        Route("/debug/instance_loads", debug_instance_loads, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=ERROR_HANDLERS)
    return ResponseObserver(app, ctx.name)


_DATA_PATHS = {Endpoint.CHAT.path: Endpoint.CHAT.value, Endpoint.COMPLETIONS.path: Endpoint.COMPLETIONS.value}


class ResponseObserver:
    """Names the worker on every response (x-cacheroute-worker) and counts data-plane
    requests by status, with their duration (499: the client left before any answer)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self._app = app
        self._header = (b"x-cacheroute-worker", name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        header = self._header
        started = time.perf_counter()
        status = 499

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self._app(scope, receive, send_observed)
        finally:
            endpoint = _DATA_PATHS.get(scope["path"])
            if endpoint is not None:
                metrics.REQUESTS.labels(endpoint, str(status)).inc()
                metrics.DURATION.labels(endpoint).observe(time.perf_counter() - started)
