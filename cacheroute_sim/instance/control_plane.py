"""The Instance control plane (second listener, ``--cp-port``): what the Proxy's KV path calls.

- ``GET /healthz`` -> ``{"ok": true}``;
- ``POST /v1/kv/inject_ready`` ``{"request_id": int, "kdn_addr": "host:port", "model": str,
  "knowledge_ids": [str]}``: adds this Instance's Redis target and calls the KDN's
  ``/knowledge/inject_ready_kv`` (kdn_client.py); relays the KDN's answer verbatim, or answers
  502 ``{"ok": false, ..., "detail": <reason>}`` when the KDN call fails. A malformed request
  is a 400 ``{"ok": false, "detail": ...}`` (the original answered pydantic's 422).

The KV kept (residency.py): ids whose KV is resident here are not asked of the KDN. All of
them resident: the answer comes at once, ``{"ok": true, "injected_kids": [ids],
"resident_kids": [ids], "keys_injected": 0, "payload_bytes": 0, ..., "detail": "resident"}``.
Some: the KDN is asked for the others, and its answer gets the resident ones added to
``injected_kids`` (request order) and listed in ``resident_kids``. None: the KDN's answer as it
is. The ids the KDN injected become resident, each with its share of ``payload_bytes``.
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
from cacheroute_sim.instance.residency import tokens_per_id

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
        knobs = state.knobs.current
        residency = state.engine.residency
        kids = [str(k).strip().lower() for k in req.knowledge_ids]  # as the KDN keys them
        resident = set(residency.resident(kids, knobs))
        missing = [kid for kid in kids if kid not in resident]
        stats.kv_inject_resident_ids += len(resident)
        if kids and not missing:
            stats.kv_inject_fast_acks += 1
            log.info("rid=%s inject_ready: all resident %s", req.request_id, kids)
            return json_response(_resident_ack(kids))
        body = kdn.inject_body(req.request_id, req.model, missing)
        try:
            reply = await kdn.inject_ready_kv(req.kdn_addr, body)
        except KdnFailure as exc:
            stats.kv_inject_failed += 1
            log.warning("rid=%s inject_ready failed: %s", req.request_id, exc)
            return json_response(failure_ack(str(exc)), 502)
        log.info("rid=%s inject_ready via %s: HTTP %d", req.request_id, req.kdn_addr,
                 reply.status)
        ack = msgspec.json.decode(reply.body)  # a JSON object (kdn_client checked)
        if reply.status >= 300 or ack.get("ok") is not True:
            return Response(reply.body, status_code=reply.status, media_type="application/json")
        injected = [str(k) for k in ack.get("injected_kids") or []]
        share = tokens_per_id(ack, injected, state.config.kdn_kv_bytes_per_token)
        for kid in injected:
            residency.admit(kid, share, knobs)
        stats.kv_inject_pulled_ids += len(injected)
        if not resident:
            return Response(reply.body, status_code=reply.status, media_type="application/json")
        pulled = set(injected)
        ack["injected_kids"] = [kid for kid in kids if kid in resident or kid in pulled]
        ack["resident_kids"] = [kid for kid in kids if kid in resident]
        return json_response(ack, reply.status)

    app = Starlette(routes=[
        Route("/healthz", healthz, methods=["GET"]),
        Route("/v1/kv/inject_ready", inject_ready, methods=["POST"]),
    ], middleware=[Middleware(InstanceHeaderMiddleware, instance_id=state.instance_id)])
    app.state.sim = state
    return app


def _resident_ack(kids: list[str]) -> dict[str, object]:
    """Every id's KV is here already: nothing to copy, nothing asked of the KDN."""
    return {"ok": True, "injected_kids": kids, "text_only_kids": [], "miss_kids": [],
            "keys_injected": 0, "payload_bytes": 0, "payload_files": 0,
            "network_sim_enabled": False, "resident_kids": kids, "detail": "resident"}
