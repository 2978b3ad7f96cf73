"""The Starlette app: OpenAI data-plane routes plus the /sim control routes for tests.

Registration is not part of the app (server.py runs it), so the app can also be mounted
in-process by a test without any control-plane traffic.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sim_instance.config import ConfigError, KnobStore, SimConfig
from sim_instance.engine import Engine
from sim_instance.generation import GenerationResponse
from sim_instance.request_model import (
    KV_PREFIX_HEADER,
    InvalidJSON,
    InvalidRequest,
    Kind,
    parse_generation_request,
)

INSTANCE_HEADER = b"x-sim-instance"

# Starlette only calls ``response(scope, receive, send)``, so a handler may return any ASGI
# callable; GenerationResponse is one without being a Response subclass.
Handler = Callable[[Request], Awaitable[Response | GenerationResponse]]


class SimState:
    """Everything the routes share: config, knobs, engine, the fail_rate RNG."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.instance_id = config.resolved_instance_id
        self.knobs = KnobStore(config.knobs)
        self.engine = Engine(time_scale=config.time_scale,
                             max_concurrency=config.max_concurrency, knobs=self.knobs)
        self.rng = random.Random(config.seed)


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


def create_app(config: SimConfig, state: SimState | None = None) -> Starlette:
    """The data-plane app; pass ``state`` to share it with the control plane (server.py)."""
    state = state or SimState(config)
    routes = [
        Route("/v1/chat/completions", _generation_route(state, "chat"), methods=["POST"]),
        Route("/v1/completions", _generation_route(state, "text"), methods=["POST"]),
        Route("/v1/models", _models_route(state), methods=["GET"]),
        Route("/healthz", _healthz, methods=["GET"]),
        *_sim_routes(state),
    ]
    app = Starlette(routes=routes, middleware=[
        Middleware(InstanceHeaderMiddleware, instance_id=state.instance_id)])
    app.state.sim = state
    return app


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status,
                    media_type="application/json")


def _generation_route(state: SimState, kind: Kind) -> Handler:
    async def handle(request: Request) -> Response | GenerationResponse:
        body = await request.body()
        try:
            parsed = parse_generation_request(
                body, kind, default_max_tokens=state.knobs.current.default_max_tokens,
                default_model=state.config.model,
                kv_prefix_header=request.headers.get(KV_PREFIX_HEADER))
        except InvalidJSON:
            state.engine.stats.invalid += 1
            return json_response({"error": "invalid_json"}, 400)
        except InvalidRequest as exc:
            state.engine.stats.invalid += 1
            return json_response({"error": "invalid_request", "detail": str(exc)}, 400)
        return GenerationResponse(parsed, state.engine, state.rng)

    return handle


def _models_route(state: SimState) -> Handler:
    async def handle(request: Request) -> Response:
        # OpenAI clients probe this before the first call; one model, like a vLLM server.
        model = {"id": state.config.model, "object": "model", "owned_by": "sim_instance"}
        return json_response({"object": "list", "data": [model]})

    return handle


async def _healthz(request: Request) -> Response:
    return json_response({"ok": True})


def _sim_routes(state: SimState) -> list[Route]:
    async def get_config(request: Request) -> Response:
        return json_response(state.knobs.current.to_dict())

    async def update_config(request: Request) -> Response:
        try:
            patch = msgspec.json.decode(await request.body())
        except msgspec.DecodeError:
            return json_response({"error": "invalid_json"}, 400)
        if not isinstance(patch, dict):
            return json_response({"error": "invalid_request", "detail": "body must be an object"},
                                 400)
        try:
            knobs = state.knobs.update(patch)
        except ConfigError as exc:
            return json_response({"error": "invalid_request", "detail": str(exc)}, 400)
        return json_response(knobs.to_dict())

    async def reset_config(request: Request) -> Response:
        return json_response(state.knobs.reset().to_dict())

    async def release(request: Request) -> Response:
        return json_response({"released": state.engine.release_held()})

    async def get_stats(request: Request) -> Response:
        return json_response(state.engine.stats.snapshot(state.instance_id))

    async def reset_stats(request: Request) -> Response:
        state.engine.stats.reset()
        return json_response(state.engine.stats.snapshot(state.instance_id))

    return [
        Route("/sim/config", get_config, methods=["GET"]),
        Route("/sim/config", update_config, methods=["POST"]),
        Route("/sim/config/reset", reset_config, methods=["POST"]),
        Route("/sim/release", release, methods=["POST"]),
        Route("/sim/stats", get_stats, methods=["GET"]),
        Route("/sim/stats/reset", reset_stats, methods=["POST"]),
    ]
