"""The Starlette app: the KDN routes the Proxy and the Instance call, plus /sim for tests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_sim.common.control_routes import BadBody, control_routes
from cacheroute_sim.common.gate import ReleaseGate
from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.common.responses import json_response
from cacheroute_sim.kdn.config import KdnConfig, Knobs
from cacheroute_sim.kdn.links import Links
from cacheroute_sim.kdn.stats import Stats
from cacheroute_sim.kdn.store import KnowledgeStore, normalize_id

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
TRACE_CONTEXT = ("traceparent", "tracestate")
SEARCH_FIELDS = frozenset({"content", "length", "rel_path", "kv_ready", "kv_rel_dir",
                           "kv_dumped_keys", "kv_updated_at"})


class BadRequest(Exception):
    """-> 400 with this message as the detail."""


class KdnState:
    def __init__(self, config: KdnConfig, store: KnowledgeStore) -> None:
        self.config = config
        self.kdn_id = config.resolved_kdn_id
        self.store = store
        self.knobs: KnobStore[Knobs] = KnobStore(config.knobs)
        self.stats = Stats()
        self.links = Links(self.stats)
        self.gate = ReleaseGate(self.stats)  # counts hung requests in stats.held
        # What the last valid inject asked for (tests check what an Instance forwarded).
        self.last_inject: dict[str, Any] | None = None
        # The last search's trace context headers (traceparent, tracestate), for the tracing tests.
        self.last_search_trace_context: dict[str, str] = {}

    async def sleep_ms(self, real_ms: float) -> None:
        await asyncio.sleep(max(0.0, real_ms * self.config.time_scale) / 1000.0)

    # What the /sim control routes (cacheroute_sim.common.control_routes) call.
    def release_held(self) -> int:
        return self.gate.release()

    def stats_snapshot(self) -> dict[str, Any]:
        return {"kdn_id": self.kdn_id, **self.stats.snapshot(), "links": self.links.snapshot(),
                "last_inject": self.last_inject, "store": self.store.summary(),
                "last_search_trace_context": self.last_search_trace_context}

    def reset_stats(self) -> None:
        self.stats.reset()
        self.links.reset()
        self.last_search_trace_context = {}


def create_app(config: KdnConfig, store: KnowledgeStore) -> Starlette:
    state = KdnState(config, store)
    routes = [
        Route("/knowledge/search/text", _search_route(state), methods=["POST"]),
        Route("/knowledge/inject_ready_kv", _inject_route(state), methods=["POST"]),
        Route("/v1/topology/hello", _hello_route(state), methods=["POST"]),
        Route("/v1/topology/ping", _ping_route(state), methods=["GET"]),
        Route("/healthz", _healthz_route(state), methods=["GET"]),
        *control_routes(state, _read_patch),
    ]
    app = Starlette(routes=routes)
    app.state.kdn = state
    return app


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        raise BadRequest("invalid_json") from None
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    return payload


async def _fault(state: KdnState, route: Literal["search", "inject"]) -> int | None:
    """Apply the hang/fail knobs; returns the status to fail with, if any."""
    knobs = state.knobs.current
    if not knobs.faults(route):
        return None
    if knobs.hang:
        await state.gate.hold()
    if knobs.fail_status is not None:
        state.stats.failed += 1
        return knobs.fail_status
    return None


# --------------------------------------------------------------------------------- search

def _search_route(state: KdnState) -> Handler:
    async def handle(request: Request) -> Response:
        state.last_search_trace_context = {name: request.headers[name] for name in TRACE_CONTEXT
                                           if name in request.headers}
        try:
            kids, need = _parse_search(await _json_object(request))
        except BadRequest as exc:
            state.stats.invalid += 1
            return json_response({"error": str(exc)}, 400)
        status = await _fault(state, "search")
        if status is not None:
            return json_response({"error": "simulated failure", "status": status}, status)
        items, miss = state.store.lookup(kids)
        body = msgspec.json.encode({"items": [it.fields(need) for it in items], "miss": miss})
        stats = state.stats
        stats.searches += 1
        stats.search_items += len(items)
        stats.search_misses += len(miss)
        stats.search_bytes += len(body)
        knobs = state.knobs.current
        # One round trip, then the reply body over the link (searches share no link queue:
        # the original Proxy's text fetch reserves nothing either).
        await state.sleep_ms(knobs.rtt_ms + knobs.transfer_ms(len(body)))
        return Response(body, media_type="application/json")

    return handle


def _parse_search(payload: dict[str, Any]) -> tuple[list[str], frozenset[str] | None]:
    ids = payload.get("knowledge_ids") or []
    if not isinstance(ids, list):
        raise BadRequest("knowledge_ids must be a list")
    if not all(isinstance(x, str) for x in ids):
        raise BadRequest("knowledge_ids elements must be strings (kid)")
    need = payload.get("need_fields") or []
    if not isinstance(need, list) or not all(isinstance(x, str) for x in need):
        raise BadRequest("need_fields must be a list of strings")
    # No need_fields: every field, like the original.
    return [normalize_id(x) for x in ids], frozenset(need) if need else None


# --------------------------------------------------------------------------------- inject

class InjectTarget(msgspec.Struct, frozen=True):
    host: str
    port: int
    db: int


def _inject_route(state: KdnState) -> Handler:
    async def handle(request: Request) -> Response:
        try:
            payload = await _json_object(request)
            kids = _parse_inject_ids(payload)
            target = _parse_target(payload)
        except BadRequest as exc:
            state.stats.invalid += 1
            return json_response({"ok": False, "detail": str(exc)}, 400)
        state.stats.injects += 1
        state.last_inject = {
            "request_id": payload.get("request_id"), "model": payload.get("model"),
            "knowledge_ids": kids, "redis_host": target.host, "redis_port": target.port,
            "redis_db": target.db, "redis_password_set": payload.get("redis_password") is not None}
        status = await _fault(state, "inject")
        if status is not None:
            return json_response(_ack(detail=f"simulated failure (HTTP {status})", ok=False),
                                 status)
        ack = await _inject(state, payload.get("request_id"), kids, target)
        return json_response(ack)

    return handle


def _parse_inject_ids(payload: dict[str, Any]) -> list[str]:
    ids = payload.get("knowledge_ids") or []
    if not isinstance(ids, list):
        raise BadRequest("knowledge_ids must be a list")
    kids = [normalize_id(str(x)) for x in ids]  # the original coerces with str()
    if not kids:
        raise BadRequest("knowledge_ids is empty")
    return kids


def _parse_target(payload: dict[str, Any]) -> InjectTarget:
    host = payload.get("redis_host", "127.0.0.1")
    port = payload.get("redis_port", 6379)
    db = payload.get("redis_db", 0)
    if not isinstance(host, str) or not host:
        raise BadRequest("redis_host must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise BadRequest("redis_port must be a TCP port")
    if isinstance(db, bool) or not isinstance(db, int) or db < 0:
        raise BadRequest("redis_db must be an integer >= 0")
    return InjectTarget(host, port, db)


async def _inject(state: KdnState, request_id: Any, kids: list[str],
                  target: InjectTarget) -> dict[str, Any]:
    knobs = state.knobs.current
    injected: list[str] = []
    text_only: list[str] = []
    miss: list[str] = []
    keys = nbytes = 0
    # Request order, duplicates kept, as the original iterates its request list.
    for kid in kids:
        item = state.store.get(kid)
        if item is None:
            miss.append(kid)
        elif not item.kv_ready:
            text_only.append(kid)
        else:
            injected.append(kid)
            keys += item.kv_dumped_keys or 0
            nbytes += item.tokens * knobs.kv_bytes_per_token
    stats = state.stats
    stats.injected_kids += len(injected)
    stats.text_only_kids += len(text_only)
    stats.miss_kids += len(miss)
    t0 = time.monotonic()
    await state.sleep_ms(knobs.rtt_ms)
    if nbytes:
        link = state.links.key(target.host, target.port)
        async with state.links.transfer(link, nbytes):
            await state.sleep_ms(knobs.transfer_ms(nbytes))
        stats.payload_bytes += nbytes
    stats.keys_injected += keys
    log.info("inject rid=%s -> %s:%d/%d injected=%s text_only=%s miss=%s bytes=%d in %.0f ms",
             request_id, target.host, target.port, target.db, injected, text_only, miss, nbytes,
             (time.monotonic() - t0) * 1000)
    return _ack(injected=injected, text_only=text_only, miss=miss, keys=keys, nbytes=nbytes)


def _ack(*, ok: bool = True, injected: list[str] | None = None,
         text_only: list[str] | None = None, miss: list[str] | None = None, keys: int = 0,
         nbytes: int = 0, detail: str = "") -> dict[str, Any]:
    return {"ok": ok, "injected_kids": injected or [], "text_only_kids": text_only or [],
            "miss_kids": miss or [], "keys_injected": keys, "payload_bytes": nbytes,
            "payload_files": keys, "network_sim_enabled": True, "detail": detail}


# ------------------------------------------------------------------------------ topology

def _hello_route(state: KdnState) -> Handler:
    async def handle(request: Request) -> Response:
        await state.sleep_ms(state.knobs.current.rtt_ms)
        return json_response({"ok": True, "kdn_id": state.kdn_id, "host": state.config.host,
                              "port": state.config.port, "version": "sim_kdn_v1",
                              "ts_ms": int(time.time() * 1000)})

    return handle


def _ping_route(state: KdnState) -> Handler:
    async def handle(request: Request) -> Response:
        # The Instance's topology probe averages ping round trips into latency_ms.
        await state.sleep_ms(state.knobs.current.rtt_ms)
        return json_response({"ok": True})

    return handle


def _healthz_route(state: KdnState) -> Handler:
    async def handle(request: Request) -> Response:
        return json_response({"ok": True, "kdn_id": state.kdn_id, "items": len(state.store)})

    return handle


# ----------------------------------------------------------------------------------- /sim

async def _read_patch(request: Request) -> dict[str, Any]:
    """The body of POST /sim/config; a bad one is an invalid_request like a bad knob."""
    try:
        return await _json_object(request)
    except BadRequest as exc:
        raise BadBody({"error": "invalid_request", "detail": str(exc)}) from None
