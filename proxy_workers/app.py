"""The data plane of one worker: OpenAI-compatible routes plus per-worker debug endpoints.

The two proxied routes (POST /v1/chat/completions and /v1/completions) are `DataPlane`'s
handlers, which the worker's server (cacheroute_proxy/http1/) calls with the request's
Cycle: no ASGI scope or messages, no Request object, no middleware stack, no route matching,
because on a proxy that forwards a small JSON body those cost as much as the forwarding itself
(measured with bench/hotpath.py). Every other route, and other
methods on the proxied paths (405), go through Starlette.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cacheroute_proxy import logs
from cacheroute_proxy.auth import TokenGuard, load_token
from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import (
    ERROR_HANDLERS,
    HTTPError,
    JSONResponse,
    from_http_error,
)
from cacheroute_proxy.routing.report import instance_loads

from . import access_log, metrics
from .exchange import ProxyExchange
from cacheroute_proxy.http1 import BadBody, BodyTooLarge, ClientGone, Cycle, Handler
from .pipeline import Pipeline
from .plain_path import PlainExchange, PlainPath
from .relay import Responder
from .request_model import Endpoint, recover
from .router import Router
from .model_list import ModelList
from .refusals import NO_ALIVE_INSTANCE, no_instance
from .sidecar_reads import SIDECAR_READS, ask_sidecar, control_plane_url, sidecar_read
from .trace import Trace
from .upstream import Upstream

log = logging.getLogger("cacheroute.worker")


@dataclass
class WorkerContext:
    settings: Settings
    index: int
    router: Router
    upstream: Upstream
    pipeline: Pipeline
    tracing: Any = None  # proxy_workers/spans.Tracing when spans are on (proxy_workers/tracing.py)
    # Computed once: it goes on every response.
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = worker_name(self.index)

    def identity(self) -> dict[str, Any]:
        return {"role": "worker", "worker_index": self.index, "pid": os.getpid(),
                "row": self.router.row.row, "name": self.name}


def worker_name(index: int) -> str:
    """How a worker is named on its answers, in traces and in spans: w<index>-pid<pid>."""
    return f"w{index}-pid{os.getpid()}"


@dataclass(frozen=True)
class WorkerApp:
    """What the worker's server serves: its own handlers for the proxied routes, by (method,
    path), and the ASGI app for everything else (and for its lifespan)."""
    routes: dict[tuple[str, bytes], Handler]
    asgi: ASGIApp


def build_app(ctx: WorkerContext, lifespan: Any = None) -> WorkerApp:
    settings = ctx.settings
    debug_guard = TokenGuard(load_token(settings.cp_token, settings.cp_token_file)
                             if settings.debug_requires_token else None)

    async def debug_instance_loads(request: Request) -> Response:
        try:
            debug_guard.check(request)
        except HTTPError as exc:
            return from_http_error(exc)
        include_dead = request.query_params.get("include_dead", "true").lower() in ("1", "true", "yes")
        try:
            affinity = ctx.router.affinity_report(request.query_params)
        except ValueError as exc:
            return JSONResponse({"error": "invalid_query", "detail": str(exc)}, status_code=400)
        return JSONResponse(instance_loads(
            ctx.router.view, ctx.router.scorer, strategy=ctx.router.policy.name,
            ttl_s=ctx.settings.instance_ttl_s, include_dead=include_dead,
            answered_by=ctx.identity(), affinity=affinity))

    async def metrics_endpoint(request: Request) -> Response:
        try:
            debug_guard.check(request)
        except HTTPError as exc:
            return from_http_error(exc)
        return Response(metrics.render(ctx.router.view), media_type=CONTENT_TYPE_LATEST)

    plane = DataPlane(ctx)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, **ctx.identity(), "outliers": ctx.router.outliers.describe(),
                             "admission": ctx.pipeline.describe_admission(),
                             "lean_path": plane.plain.describe()})

    async def health(request: Request) -> Response:  # can the proxy serve a request now?
        alive = len(ctx.router.view.directory.snapshot().alive)
        if not alive:
            return from_http_error(no_instance(NO_ALIVE_INSTANCE))
        return JSONResponse({"ok": True, "alive_instances": alive})

    sidecar = control_plane_url(settings)
    model_list = ModelList(ctx.router.view.directory.snapshot, lambda: ask_sidecar(sidecar, "/v1/models"))

    async def models(request: Request) -> Response:
        return await model_list.answer()

    async def post_only(request: Request) -> Response:  # DataPlane's handlers answer every POST
        raise AssertionError("unreachable")

    routes = [
        Route(Endpoint.CHAT.path, post_only, methods=["POST"]),
        Route(Endpoint.COMPLETIONS.path, post_only, methods=["POST"]),
        Route("/debug/instance_loads", debug_instance_loads, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        # What the sidecar alone keeps, asked of it: the same answer from every worker.
        *(Route(path, sidecar_read(settings, debug_guard), methods=["GET"]) for path in SIDECAR_READS),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=ERROR_HANDLERS)
    return WorkerApp(plane.routes(), ResponseObserver(app, ctx.name))


_DATA_PATHS = {Endpoint.CHAT.path: Endpoint.CHAT, Endpoint.COMPLETIONS.path: Endpoint.COMPLETIONS}


class DataPlane:
    """POST on a proxied path: read the body (413 past the limit), recover the request (400/422)
    and run the exchange; the worker header on every answer; the request counted by status
    (499: the client left before any answer) and instance, with its duration."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._limit = ctx.settings.max_body_bytes
        self._retries = ctx.settings.retry_attempts
        self._worker_header = (b"x-cacheroute-worker", ctx.name.encode())
        # Decided once: with text logs and no access log, nothing below runs per request.
        self._access_log = ctx.settings.log_each_request
        self._tag_requests = ctx.settings.log_each_request or ctx.settings.log_format == "json"
        self._tracing = ctx.tracing  # None: no spans, and the off path is this one check
        self.plain = PlainPath(ctx.router, ctx.pipeline, ctx.upstream, self._retries,
                               spans=ctx.tracing is not None)

    def routes(self) -> dict[tuple[str, bytes], Handler]:
        return {("POST", endpoint.path.encode()): functools.partial(self.serve, endpoint)
                for endpoint in _DATA_PATHS.values()}

    async def serve(self, endpoint: Endpoint, cycle: Cycle) -> None:
        started = time.perf_counter()
        responder = Responder(cycle, self._worker_header)
        trace = Trace(proxy_recv_ms=now_ms(), worker=self._ctx.name)
        if self._tag_requests:  # this request's own task: the id does not outlive it
            logs.REQUEST_ID.set(access_log.client_request_id(cycle.headers))
        if self._tracing is not None:  # its span covers the body's arrival too
            responder.spans = self._tracing.begin(endpoint.path, cycle.headers, trace)
        try:
            body = cycle.whole_body(self._limit)
            if body is None:  # more to come (or an error read_body says)
                body = await self._read_body(cycle, responder)
            exchange = None if body is None else self._exchange(endpoint, cycle, body, responder, trace)
            if exchange is not None:
                await exchange.run(responder)
        except Exception as exc:  # a bug: one logged line with the traceback, a JSON 500
            log.error("unhandled error on POST %s", endpoint.path, exc_info=exc)
            if responder.started:
                raise  # the server closes the connection: the client sees a cut response
            responder.json(500, {"error": "internal_error",
                                 "detail": f"{type(exc).__name__} (details in the log)"})
        finally:
            elapsed = time.perf_counter() - started
            metrics.observe_request(endpoint.route, responder.status, elapsed, responder.instance_id)
            if self._access_log:
                access_log.write(cycle.method, cycle.path, responder.status, elapsed, trace)
            if responder.spans is not None:
                self._tracing.finish(responder.spans, responder.status)

    async def _read_body(self, cycle: Cycle, responder: Responder) -> bytes | None:
        """The body, read as it arrives; None if the request was answered (or its client left)
        instead."""
        try:
            return await read_body(cycle, self._limit)
        except HTTPError as exc:
            responder.error(exc)
        except BadBody:  # answered 400 by the server itself
            responder.status = 400
        except ClientGone:  # counted as 499, nothing to answer
            pass
        return None

    def _exchange(self, endpoint: Endpoint, cycle: Cycle, body: bytes, responder: Responder,
                  trace: Trace) -> ProxyExchange | PlainExchange | None:
        """The request's exchange, its body recovered (the lean one for a plain request it
        takes, plain_path.py); None if it was answered instead. Built before the exchange runs,
        not around it: no coroutine between the request's task and the instance's answer."""
        ctx = self._ctx
        try:
            proxy_request = recover(endpoint, body)
        except HTTPError as exc:
            responder.error(exc)
            return None
        trace.request_id = proxy_request.request_id
        if self._tag_requests:
            access_log.tag_from_body(trace)
        if self.plain.takes(proxy_request):
            return PlainExchange(self.plain, proxy_request, trace, cycle.headers)
        return ProxyExchange(ctx.router, ctx.pipeline, ctx.upstream, proxy_request, trace,
                             retries=self._retries, client_headers=cycle.headers, spans=responder.spans)


async def read_body(cycle: Cycle, limit: int) -> bytes:
    """The whole body, refusing (413) from the declared length before reading, or as soon as
    what arrives passes `limit` bytes."""
    for name, value in cycle.headers:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise HTTPError(413, "payload_too_large",
                                f"body of {value.decode()} bytes exceeds the {limit}-byte limit")
            break
    try:
        return await cycle.read_body(limit)
    except BodyTooLarge:
        raise HTTPError(413, "payload_too_large", f"body exceeds the {limit}-byte limit") from None


class ResponseObserver:
    """For the Starlette routes: names the worker on every response (x-cacheroute-worker) and
    counts requests to the proxied paths (a wrong method) by status, with their duration."""

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
                metrics.observe_request(endpoint.route, status, time.perf_counter() - started)
