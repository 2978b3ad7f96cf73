"""The control plane on 127.0.0.1:8002, wire-compatible with the original
(docs/protocol.md, "Instance control plane" and "Observation routes")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_proxy.auth import TokenGuard, load_token
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import ERROR_HANDLERS, HTTPError, JSONResponse, from_http_error
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.report import instance_loads
from cacheroute_proxy.routing.least_load import LeastLoadPolicy
from shm_schema import DirectoryFull, Segment, header

from cacheroute_proxy import instance_wire as wire

from . import pool_resource
from .scheduler_wire import PoolResource
from .control_body import json_body
from .dashboard_routes import dashboard_routes
from .pressure import PressurePublisher
from .reaper import WorkerReaper
from .registry import InstanceRegistry
from .served_models import model_list
from .resource_snapshot import RAW_RESOURCE_LIMIT
from .scheduler_link import DisabledLink, Identity, SchedulerLink
from .kv_events import KvEventFeeds
from .static_prober import StaticProber
from .topology import Topology

Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class SidecarState:
    settings: Settings
    seg: Segment
    registry: InstanceRegistry
    reaper: WorkerReaper
    pressure: PressurePublisher
    view: LoadView
    scorer: LeastLoadPolicy
    epoch: int
    topology: Topology
    # Registration with the Scheduler (sidecar/scheduler_link.py); set by build_state.
    scheduler: SchedulerLink | DisabledLink | None = None
    # PROXY_STATIC_INSTANCES (sidecar/static_prober.py); None when there are none.
    static: StaticProber | None = None
    # Engines' KV cache events (sidecar/kv_events.py); set by build_state.
    kv_events: KvEventFeeds | None = None

    def kdn_links(self) -> dict[str, Any]:
        """What the Scheduler is told: PROXY_KDN_LINKS_JSON overlaid by the measured topology."""
        return {**self.settings.kdn_links, **self.topology.merged()}

    def pool_resource(self) -> PoolResource:
        # What the next Scheduler heartbeat would carry, even with it off.
        proxy_id = (self.scheduler.status.proxy_id if self.scheduler and self.scheduler.status.proxy_id
                    else Identity.from_settings(self.settings).proxy_id)
        return pool_resource.snapshot_of(self.registry, self.view, self.settings, proxy_id)


def build_app(state: SidecarState) -> Starlette:
    registry = state.registry
    settings = state.settings
    guard = TokenGuard(load_token(settings.cp_token, settings.cp_token_file))
    guarded = _guard(guard)

    # The writing routes: the token if set; each reads its body with json_body, whose
    # content-type rule also keeps web pages out (sidecar/control_body.py).
    writes = guarded
    reads = _guard(guard if settings.debug_requires_token else TokenGuard(None))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "ttl_s": state.settings.instance_ttl_s})

    async def register(request: Request) -> Response:
        req = await json_body(request, wire.RegisterRequest)
        try:
            record = registry.register(req)
        except ValueError as exc:
            raise HTTPError(422, "invalid_payload", str(exc)) from None
        except DirectoryFull as exc:
            raise HTTPError(507, "instance_table_full", str(exc)) from None
        return JSONResponse(wire.RegisterReply(
            instance_id=record.instance_id, heartbeat_interval_s=state.settings.heartbeat_interval_s,
            ttl_s=state.settings.instance_ttl_s, capability_fingerprint=record.capability_fingerprint))

    async def heartbeat(request: Request) -> Response:
        req = await json_body(request, wire.HeartbeatRequest)
        return JSONResponse(registry.heartbeat(req))

    async def resource_snapshot(request: Request) -> Response:
        req = await json_body(request, wire.ResourceSnapshotRequest)
        size = len(msgspec.json.encode(req.snapshot))
        if size > RAW_RESOURCE_LIMIT:
            raise HTTPError(413, "payload_too_large",
                            f"snapshot: {size} bytes of JSON, the proxy keeps at most {RAW_RESOURCE_LIMIT}")
        if not registry.report_resource(req):
            return JSONResponse({"ok": False, "error": "unknown_instance"})
        return JSONResponse({"ok": True})

    async def topology_report(request: Request) -> Response:
        req = await json_body(request, wire.TopologyReportRequest)
        if registry.get(req.instance_id) is None:  # links only for registered instances
            return JSONResponse({"ok": False, "error": "unknown_instance"})
        return JSONResponse({"ok": True, "merged_links": state.topology.report(req.instance_id, req.links)})

    async def kdn_links(request: Request) -> Response:
        body: dict[str, Any] = {"kdn_links": state.topology.merged()}
        if _flag(request, "per_instance", False):
            body["per_instance"] = state.topology.per_instance()
        return JSONResponse(body)

    async def instance_resources(request: Request) -> Response:
        records = registry.records(_flag(request, "include_dead", True))
        return JSONResponse({"instances": [registry.resource_row(r) for r in records]})

    async def unregister(request: Request) -> Response:
        req = await json_body(request, wire.UnregisterRequest)
        return JSONResponse({"ok": registry.unregister(req.instance_id)})

    async def list_instances(request: Request) -> Response:
        include_dead = _flag(request, "include_dead", False)
        records = registry.records(include_dead)
        inflight = state.view.inflight(records) if records else []
        return JSONResponse([registry.row(r, n) for r, n in zip(records, inflight)])

    def status_body() -> dict[str, Any]:
        records = registry.records(include_dead=True)
        alive = [r for r in records if r.alive]
        return {
            "ok": True, "ttl_s": state.settings.instance_ttl_s,
            "alive_instances": len(alive), "total_instances": len(records),
            "expired_instances": len(records) - len(alive),
            "sample_ids": [r.instance_id for r in alive[:10]],
            "topology_kdn_links": len(state.topology.merged()),
            "sidecar": {"pid": os.getpid(), "epoch": state.epoch},
            "segment": header.describe(state.seg),
            "workers": state.reaper.workers(),
            "event_channel": state.pressure.describe(),
            "reaper": {"reaped": state.reaper.stats.reaped, "subtracted": state.reaper.stats.subtracted,
                       "corrections": state.reaper.stats.corrections, "watched": state.reaper.watched,
                       "last_reaped": state.reaper.stats.last_reaped},
            "scheduler": state.scheduler.status.describe() if state.scheduler else {"enabled": False},
            "static_instances": state.static.describe() if state.static else None,
            "kv_event_feeds": state.kv_events.describe() if state.kv_events else None,
            "settings": running_with(state.settings),
        }

    async def status(request: Request) -> Response:
        return JSONResponse(status_body())

    async def models(request: Request) -> Response:  # every worker's /v1/models asks this
        return JSONResponse(model_list(registry.records(include_dead=False)))

    async def debug_pool_resource(request: Request) -> Response:
        return JSONResponse({"ok": True, "pool_resource": state.pool_resource()})

    async def debug_pool_resource_sources(request: Request) -> Response:
        pool = state.pool_resource()
        return JSONResponse({"ok": True, "metric_source": pool.metric_source,
                             "metric_quality": pool.metric_quality,
                             "null_semantics": pool_resource.NULL_SEMANTICS})

    def loads_body(include_dead: bool) -> dict[str, Any]:
        return instance_loads(
            state.view, state.scorer, strategy=state.settings.strategy_name,
            ttl_s=state.settings.instance_ttl_s, include_dead=include_dead,
            answered_by={"role": "sidecar", "pid": os.getpid()})

    async def debug_instance_loads(request: Request) -> Response:
        return JSONResponse(loads_body(_flag(request, "include_dead", True)))

    def dashboard_document() -> dict[str, Any]:
        """/debug/dashboard: what the page shows, each part as its own route answers it."""
        status = status_body()
        return {"status": status, "loads": loads_body(True),
                "resources": [registry.resource_row(r) for r in registry.records(include_dead=True)],
                "pool_resource": state.pool_resource(),
                "topology": {"kdn_links": state.topology.merged(),
                             "per_instance": state.topology.per_instance(),
                             "configured": settings.kdn_links},
                # The affinity index's per-instance account, null while it holds nothing: the
                # page shows its panel only when it is not.
                "affinity": _holding_something(status["event_channel"]["affinity"])}

    routes = [
        Route("/healthz", _guard(TokenGuard(None))(healthz), methods=["GET"]),
        Route("/debug/status", reads(status), methods=["GET"]),
        Route("/debug/instance_loads", reads(debug_instance_loads), methods=["GET"]),
        Route("/debug/pool_resource", reads(debug_pool_resource), methods=["GET"]),
        Route("/debug/pool_resource_sources", reads(debug_pool_resource_sources), methods=["GET"]),
        Route("/debug/instance_resources", reads(instance_resources), methods=["GET"]),
        Route("/v1/instance/register", writes(register), methods=["POST"]),
        Route("/v1/instance/heartbeat", writes(heartbeat), methods=["POST"]),
        Route("/v1/instance/resource_snapshot", writes(resource_snapshot), methods=["POST"]),
        Route("/v1/instance/unregister", writes(unregister), methods=["POST"]),
        Route("/v1/instance/list", reads(list_instances), methods=["GET"]),
        Route("/v1/topology/report", writes(topology_report), methods=["POST"]),
        Route("/v1/topology/kdn_links", reads(kdn_links), methods=["GET"]),
        Route("/v1/models", _guard(TokenGuard(None))(models), methods=["GET"]),
    ]
    dashboard = dashboard_routes(state.seg, reads, dashboard_document)  # sidecar/dashboard/
    app = Starlette(routes=[*routes, *dashboard], exception_handlers=ERROR_HANDLERS)
    app.state.dashboard_routes = dashboard  # what the UI listener serves (sidecar/ui_listener.py)
    return app


def running_with(settings: Settings) -> dict[str, Any]:
    """The settings an operator asks about first (what a flag or the environment chose), never
    a secret: the whole proxy runs with the sidecar's, which the launcher passes to every role."""
    return {"dp": f"{settings.dp_host}:{settings.dp_port}", "workers": settings.workers,
            "strategy": settings.strategy_name, "load_view": settings.load_view,
            "injection_strategy": settings.injection_strategy,
            "ready_release_policy": settings.ready_release_policy,
            "static_kdn_links": sorted(settings.kdn_links)}


def _holding_something(affinity: dict[str, Any] | None) -> dict[str, Any] | None:
    if affinity and any(row["knowledge"] or row["prefix_blocks"] for row in affinity["instances"].values()):
        return affinity
    return None


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _guard(tokens: TokenGuard) -> Callable[[Handler], Handler]:
    """Wrap a handler: token check first, then HTTPError -> its JSON error response."""
    def wrap(handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            try:
                tokens.check(request)
                return await handler(request)
            except HTTPError as exc:
                return from_http_error(exc)
        return guarded
    return wrap
