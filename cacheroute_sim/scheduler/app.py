"""The Starlette app: the Scheduler control-plane routes a proxy calls,
debug routes listing what the proxies reported, and /sim for tests."""

from __future__ import annotations

import logging
from functools import partial
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_sim.common.control_routes import control_routes, read_json_object
from cacheroute_sim.common.gate import ReleaseGate
from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.common.responses import json_response
from cacheroute_sim.scheduler.config import Knobs, SchedulerConfig
from cacheroute_sim.scheduler.registry import ProxyRegistry
from cacheroute_sim.scheduler.stats import Stats
from cacheroute_sim.scheduler.wire import HeartbeatRequest, RegisterReply, RegisterRequest, UnregisterRequest

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
S = TypeVar("S", bound=msgspec.Struct)
BODY_LIMIT = 1024 * 1024


class Invalid(Exception):
    """-> 422 with this detail (the original's FastAPI answers schema errors with 422)."""


class SchedulerState:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.knobs: KnobStore[Knobs] = KnobStore(config.knobs)
        self.stats = Stats()
        self.registry = ProxyRegistry()
        self.gate = ReleaseGate(self.stats)

    def expire(self) -> None:
        self.registry.expire(self.knobs.current.ttl_s)

    # What the /sim control routes (cacheroute_sim.common.control_routes) call.
    def release_held(self) -> int:
        return self.gate.release()

    def stats_snapshot(self) -> dict[str, Any]:
        return {"scheduler_id": self.config.resolved_id, **self.stats.snapshot(),
                "expired": self.registry.expired}

    def reset_stats(self) -> None:
        self.stats.reset()


def create_app(config: SchedulerConfig) -> Starlette:
    state = SchedulerState(config)
    routes = [
        Route("/v1/proxy/register", _proxy_route(state, "register", RegisterRequest,
                                                 partial(_register, state)), methods=["POST"]),
        Route("/v1/proxy/heartbeat", _proxy_route(state, "heartbeat", HeartbeatRequest,
                                                  partial(_heartbeat, state)), methods=["POST"]),
        Route("/v1/proxy/unregister", _proxy_route(state, "unregister", UnregisterRequest,
                                                   partial(_unregister, state)), methods=["POST"]),
        Route("/v1/proxy/list", _list_route(state), methods=["GET"]),
        Route("/debug/proxies", _debug_route(state), methods=["GET"]),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/sim/restart", _restart_route(state), methods=["POST"]),
        *control_routes(state, read_json_object),
    ]
    app = Starlette(routes=routes)
    app.state.scheduler = state
    return app


# --- the proxy-facing routes ------------------------------------------------------------------------
def _proxy_route(state: SchedulerState, route: str, kind: type[S], act: Callable[[S], Response]) -> Handler:
    """POST /v1/proxy/<route>: counted, subject to the fault knobs, body validated, then `act`."""
    calls = f"{route}_calls"

    async def handle(request: Request) -> Response:
        setattr(state.stats, calls, getattr(state.stats, calls) + 1)
        failure = await _fault(state, route)
        if failure is not None:
            return failure
        req = _decode(state, await request.body(), kind)
        return req if isinstance(req, Response) else act(req)
    return handle


def _register(state: SchedulerState, req: RegisterRequest) -> Response:
    record = state.registry.register(req)
    state.stats.registered += 1
    knobs = state.knobs.current
    return json_response(RegisterReply(record.proxy_id, knobs.heartbeat_interval_s, knobs.ttl_s))


def _heartbeat(state: SchedulerState, req: HeartbeatRequest) -> Response:
    state.expire()
    if not state.registry.heartbeat(req):
        state.stats.heartbeats_unknown += 1
        return json_response({"detail": "proxy_id not registered"}, 404)
    state.stats.heartbeats_ok += 1
    return json_response({"ok": True})


def _unregister(state: SchedulerState, req: UnregisterRequest) -> Response:
    existed = state.registry.unregister(req.proxy_id)
    state.stats.unregistered += int(existed)
    return json_response({"ok": True})  # the original answers ok either way


async def _fault(state: SchedulerState, route: str) -> Response | None:
    """Apply the hang/fail knobs: hold until /sim/release, then maybe fail with a status."""
    knobs = state.knobs.current
    if not knobs.faults(route):
        return None
    if knobs.hang:
        await state.gate.hold()
        knobs = state.knobs.current
    if knobs.fail_status is not None and knobs.faults(route):
        state.stats.failed += 1
        return json_response({"detail": "simulated failure"}, knobs.fail_status)
    return None


def _decode(state: SchedulerState, body: bytes, kind: type[S]) -> S | Response:
    """The body as ``kind``, or the 422 answer naming what is wrong."""
    try:
        if len(body) > BODY_LIMIT:
            raise Invalid(f"body over {BODY_LIMIT} bytes")
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            raise Invalid(str(exc)) from None
        except msgspec.DecodeError as exc:
            raise Invalid(f"invalid JSON: {exc}") from None
    except Invalid as exc:
        state.stats.invalid += 1
        log.warning("rejected a %s body: %s", kind.__name__, exc)
        return json_response({"error": "invalid_payload", "detail": str(exc)}, 422)


# --- reads ------------------------------------------------------------------------------------------
def _list_route(state: SchedulerState) -> Handler:
    async def handle(request: Request) -> Response:
        include_dead = request.query_params.get("include_dead", "false").lower() in ("1", "true", "yes")
        state.expire()
        rows = state.registry.rows(state.knobs.current.ttl_s)
        return json_response([_list_row(r) for r in rows if include_dead or r["is_alive"]])
    return handle


def _list_row(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("proxy_id", "host", "port", "endpoints", "tags", "weight", "meta", "registered_at",
            "last_seen_at", "is_alive")
    return {k: row[k] for k in keys}


def _debug_route(state: SchedulerState) -> Handler:
    async def handle(request: Request) -> Response:
        state.expire()
        return json_response({"proxies": state.registry.rows(state.knobs.current.ttl_s),
                              "calls": state.stats_snapshot(), "knobs": state.knobs.current.to_dict()})
    return handle


async def _healthz(request: Request) -> Response:
    return json_response({"ok": True})


def _restart_route(state: SchedulerState) -> Handler:
    async def handle(request: Request) -> Response:
        forgotten = state.registry.forget_all()
        state.stats.restarts += 1
        log.info("simulated restart: forgot %d proxies", forgotten)
        return json_response({"forgotten": forgotten})
    return handle
