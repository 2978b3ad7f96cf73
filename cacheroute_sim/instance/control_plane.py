"""The Instance control plane (second listener, ``--cp-port``): what the Proxy's KV path calls.

- ``GET /healthz`` -> ``{"ok": true}``;
- ``POST /v1/kv/inject_ready`` ``{"request_id": int, "kdn_addr": "host:port", "model": str,
  "knowledge_ids": [str]}``: adds this Instance's Redis target and calls the KDN's
  ``/knowledge/inject_ready_kv`` (kdn_client.py); relays the KDN's answer verbatim, or answers
  502 ``{"ok": false, ..., "detail": <reason>}`` when the KDN call fails. A malformed request
  is a 400 ``{"ok": false, "detail": ...}`` (the original answered pydantic's 422).
"""

from __future__ import annotations

import logging

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cacheroute_sim.common.responses import json_response
from cacheroute_sim.instance.app import InstanceHeaderMiddleware, SimState
from cacheroute_sim.instance.kdn_client import KdnClient, KdnFailure, failure_ack

log = logging.getLogger(__name__)


class InjectReadyRequest(msgspec.Struct, frozen=True):
    # Unknown keys are ignored, as pydantic did in the original.
    request_id: int
    kdn_addr: str
    model: str
    knowledge_ids: list[str] = []


def create_cp_app(state: SimState, kdn: KdnClient) -> Starlette:
    async def healthz(request: Request) -> Response:
        return json_response({"ok": True})

    async def inject_ready(request: Request) -> Response:
        state.last_inject_trace_context = {name: request.headers[name]
                                           for name in ("traceparent", "tracestate")
                                           if name in request.headers}
        try:
            req = msgspec.json.decode(await request.body(), type=InjectReadyRequest)
        except msgspec.ValidationError as exc:
            return json_response({"ok": False, "detail": f"invalid_request: {exc}"}, 400)
        except msgspec.DecodeError:
            return json_response({"ok": False, "detail": "invalid_json"}, 400)
        if not req.kdn_addr.strip():
            return json_response({"ok": False, "detail": "kdn_addr is empty"}, 400)
        stats = state.engine.stats
        stats.kv_injects += 1
        body = kdn.inject_body(req.request_id, req.model, req.knowledge_ids)
        try:
            reply = await kdn.inject_ready_kv(req.kdn_addr, body)
        except KdnFailure as exc:
            stats.kv_inject_failed += 1
            log.warning("rid=%s inject_ready failed: %s", req.request_id, exc)
            return json_response(failure_ack(str(exc)), 502)
        log.info("rid=%s inject_ready via %s: HTTP %d", req.request_id, req.kdn_addr,
                 reply.status)
        return Response(reply.body, status_code=reply.status, media_type="application/json")

    app = Starlette(routes=[
        Route("/healthz", healthz, methods=["GET"]),
        Route("/v1/kv/inject_ready", inject_ready, methods=["POST"]),
    ], middleware=[Middleware(InstanceHeaderMiddleware, instance_id=state.instance_id)])
    app.state.sim = state
    return app
