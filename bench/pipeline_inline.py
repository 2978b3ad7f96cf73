"""The `parts inline` variant of bench/pipeline_cost.py: the parts the worker's full request
path runs for a plain request, called from one coroutine with none of the layers between them.

The parts: the body read and decoded, `Router.acquire` and its lease, the predictions, the
event channel's reservation and completion, ready admission, the forward and the answer read, the
outlier count, the trace and its meta spliced in, the relayed headers, the request's metrics.
Left out are the layers: the app's handler and Responder, the exchange and its retries, the
pipeline's stages and release order, the disconnect watch, the error answers. So it costs what
the same work costs in Python at least, and only the common case is here: a plain OpenAI body,
admitted at once, answered 200 (bench/tests/test_pipeline_cost.py holds it to the full path's
answer, events and lanes).
"""

from __future__ import annotations

import time
from typing import Any

from cacheroute_proxy.clock import now_ms
from proxy_workers import metrics
from proxy_workers.app import read_body
from proxy_workers.exchange import meta_spliced
from proxy_workers.headers import relayed, with_defaults
from proxy_workers.predictors.model import Predictors
from proxy_workers.request_model import Endpoint, recover
from proxy_workers.server import WorkerParts
from proxy_workers.trace import Knowledge, Trace, encode_meta
from shm_schema import layout

_JSON = (b"content-type", b"application/json")


class InlinePlainRequest:
    def __init__(self, parts: WorkerParts, predictors: Predictors) -> None:
        self._ctx, self._events, self._predictors = parts.ctx, parts.events, predictors
        self._worker_header = (b"x-cacheroute-worker", parts.ctx.name.encode())

    async def __call__(self, cycle: Any) -> None:
        ctx, events, predictors = self._ctx, self._events, self._predictors
        upstream = ctx.upstream
        started = time.perf_counter()
        trace = Trace(proxy_recv_ms=now_ms(), worker=ctx.name)
        request = recover(Endpoint.CHAT, await read_body(cycle, ctx.settings.max_body_bytes))
        trace.request_id = request.request_id
        forwarded = upstream.forwarded(cycle.headers)
        trace.route_select_start_ms = now_ms()
        lease = ctx.router.acquire(frozenset(), request)
        instance = lease.instance
        key = events.new_key()
        try:
            trace.route_select_end_ms = trace.proxy_enqueue_ms = trace.ready_enqueue_ms = now_ms()
            trace.instance_id = instance.instance_id
            service = predictors.text_service_ms(request.prompt_tokens, 0)
            decode = predictors.decode_ms(request.prompt_tokens, request.decode_tokens, 1)
            trace.predict_service_ms, trace.predict_decode_ms = round(service, 1), round(decode, 1)
            events.reserve(key, instance.slot, instance.generation, service, decode,
                           request.decode_tokens, request.prompt_tokens)
            lease.try_admit(layout.LANE_READY_ACTIVE, ctx.settings.ready_concurrency)
            trace.ready_dequeue_ms = trace.forward_start_ms = now_ms()
            response = await upstream.open(instance.host, instance.port, request.endpoint.path,
                                           request.encoded_body(), forwarded)
            answer = await upstream.read_all(response)
            lease.leave(layout.LANE_READY_ACTIVE)
            events.complete(key, False)
            ctx.router.outliers.succeeded((instance.slot, instance.generation))
            trace.forward_end_ms = now_ms()
            answer = meta_spliced(answer, encode_meta(trace, None, Knowledge()))[0]
            headers = with_defaults(relayed(response.headers), _JSON)
            headers += [(b"x-cacheroute-instance", instance.instance_id.encode()), self._worker_header]
        finally:
            lease.release()
        cycle.send_whole(200, headers, answer)
        response.release()
        metrics.observe_request(request.endpoint.value, 200, time.perf_counter() - started,
                                instance.instance_id)
