"""The Starlette app: OpenAI data-plane routes plus the /sim control routes for tests.

Registration is not part of the app (server.py runs it), so the app can also be mounted
in-process by a test without any control-plane traffic.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cacheroute_sim.common.control_routes import control_routes, read_json_object
from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.common.responses import json_response
from cacheroute_sim.instance.config import Knobs, SimConfig
from cacheroute_sim.instance.engine import Engine
from cacheroute_sim.instance.generation import GenerationResponse
from cacheroute_sim.instance.request_model import (
    KV_KNOWLEDGE_IDS_HEADER,
    KV_PREFIX_HEADER,
    InvalidJSON,
    InvalidRequest,
    Kind,
    parse_generation_request,
)

INSTANCE_HEADER = b"x-sim-instance"
REQUEST_ID_HEADER = b"x-request-id"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SIM_VERSION = "sim-0.1"

# Starlette only calls ``response(scope, receive, send)``, so a handler may return any ASGI
# callable; GenerationResponse is one without being a Response subclass.
Handler = Callable[[Request], Awaitable[Response | GenerationResponse]]


class SimState:
    """Everything the routes share: config, knobs, engine, the fail_rate RNG."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.instance_id = config.resolved_instance_id
        self.knobs: KnobStore[Knobs] = KnobStore(config.knobs)
        self.engine = Engine(time_scale=config.time_scale,
                             max_concurrency=config.max_concurrency, knobs=self.knobs,
                             kv_mem_gb=config.kv_mem_gb)
        self.rng = random.Random(config.seed)
        # The last generation request's headers as received (the raw ASGI list), for tests.
        self.last_request_headers: list[tuple[bytes, bytes]] = []
        # The last KV pull's (POST /v1/kv/inject_ready) traceparent and tracestate, for tests.
        self.last_inject_trace_context: dict[str, str] = {}

    # What the /sim control routes (cacheroute_sim.common.control_routes) call.
    def release_held(self) -> int:
        return self.engine.release_held()

    def stats_snapshot(self) -> dict[str, Any]:
        headers = [[name.decode("latin-1"), value.decode("latin-1")]
                   for name, value in self.last_request_headers]
        residency = self.engine.residency.snapshot(self.knobs.current)  # first: it may evict
        return {**self.engine.stats.snapshot(self.instance_id), "last_request_headers": headers,
                "last_inject_trace_context": self.last_inject_trace_context,
                "residency": residency}

    def reset_stats(self) -> None:
        self.engine.stats.reset()
        self.last_request_headers = []
        self.last_inject_trace_context = {}


class InstanceHeaderMiddleware:
    """Adds ``x-sim-instance`` to every response, so tests see which instance answered.

    Pure ASGI (not BaseHTTPMiddleware) so it never buffers or delays a stream.
    """

    def __init__(self, app: ASGIApp, instance_id: str) -> None:
        self.app = app
        self.header = (INSTANCE_HEADER, instance_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class GenerationHeadersMiddleware:
    """On the generation routes: remembers each request's headers (``GET /sim/stats``
    ``last_request_headers``) and adds the knobs' headers to its answer, whatever it is
    (stream, JSON, error): ``response_headers`` and, with ``request_id_headers``,
    ``x-request-id``. The knobs are read once, at arrival, like GenerationResponse's."""

    def __init__(self, app: ASGIApp, state: SimState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.last_request_headers = scope["headers"]
        extra = self._extra_headers(scope, self.state.knobs.current)
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    @staticmethod
    def _extra_headers(scope: Scope, knobs: Knobs) -> list[tuple[bytes, bytes]]:
        extra = [(name.lower().encode("latin-1"), value.encode("latin-1"))
                 for name, value in knobs.response_headers.items()]
        if knobs.request_id_headers:
            given = next((v for n, v in scope["headers"] if n == REQUEST_ID_HEADER), None)
            extra.append((REQUEST_ID_HEADER, given or uuid.uuid4().hex.encode()))
        return extra


def create_app(config: SimConfig, state: SimState | None = None) -> Starlette:
    """The data-plane app; pass ``state`` to share it with the control plane (server.py)."""
    state = state or SimState(config)
    routes = [
        Route("/v1/chat/completions", _generation_route(state, "chat"), methods=["POST"]),
        Route("/v1/completions", _generation_route(state, "text"), methods=["POST"]),
        Route("/v1/models", _models_route(state), methods=["GET"]),
        Route("/version", _version, methods=["GET"]),
        Route("/healthz", _healthz, methods=["GET"]),
        # vLLM's own probe path; LLM routers (vllm-router) wait for it before routing.
        Route("/health", _healthz, methods=["GET"]),
        *control_routes(state, read_json_object),
        Route("/sim/kv/clear", _kv_clear_route(state), methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=[
        Middleware(InstanceHeaderMiddleware, instance_id=state.instance_id),
        Middleware(GenerationHeadersMiddleware, state=state)])
    app.state.sim = state
    return app


def _generation_route(state: SimState, kind: Kind) -> Handler:
    async def handle(request: Request) -> Response | GenerationResponse:
        body = await request.body()
        knobs = state.knobs.current
        try:
            parsed = parse_generation_request(
                body, kind, default_max_tokens=knobs.default_max_tokens,
                default_model=state.config.model,
                kv_prefix_header=request.headers.get(KV_PREFIX_HEADER),
                knowledge_ids_header=request.headers.get(KV_KNOWLEDGE_IDS_HEADER),
                render_prompt=knobs.prefix_caching)
        except InvalidJSON:
            state.engine.stats.invalid += 1
            return json_response({"error": "invalid_json"}, 400)
        except InvalidRequest as exc:
            state.engine.stats.invalid += 1
            return json_response({"error": "invalid_request", "detail": str(exc)}, 400)
        return GenerationResponse(parsed, state.engine, state.rng)

    return handle


def _kv_clear_route(state: SimState) -> Handler:
    async def handle(request: Request) -> Response:
        # Forget every KV kept (knowledge and prefix blocks), e.g. between tests sharing one
        # instance; not an eviction, so not counted as one.
        state.engine.residency.clear()
        return json_response(state.engine.residency.snapshot(state.knobs.current))

    return handle


def _models_route(state: SimState) -> Handler:
    async def handle(request: Request) -> Response:
        # OpenAI clients probe this before the first call; one model, like a vLLM server.
        model = {"id": state.config.model, "object": "model", "owned_by": "sim_instance",
                 "max_model_len": state.config.max_model_len}
        return json_response({"object": "list", "data": [model]})

    return handle


async def _version(request: Request) -> Response:
    # vLLM's GET /version; the proxy reads it into runtime.vllm_version.
    return json_response({"version": SIM_VERSION})


async def _healthz(request: Request) -> Response:
    return json_response({"ok": True})
