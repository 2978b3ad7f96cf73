"""The lean path: a plain OpenAI request (no knowledge, no Scheduler body) under a strategy
that needs nothing of the pipeline, in one coroutine from the choice to the last byte.

It does what the exchange (exchange.py) does for such a request -- lease, host-wide ready
admission, booking with the sidecar once sent, retries before the first byte, the disconnect
watch, `cacheroute_meta`, the metrics -- with the same parts (Router, Pipeline.admit_plain /
book / leave_ready, Upstream, relay.py) and the same trace and events (tests/test_trace.py
holds the two paths to it), but without the exchange's layers: no Job, no frame per stage, no meta
object built for knowledge it does not have. Each frame a request's task passes through is
paid again at each of its resumptions, each object at each request; what the layers cost is
the `exchange` variant of bench/instructions.py and bench/pipeline_cost.py (BENCHMARKS.md).

What the lean path does not take: knowledge or a Scheduler body (the pipeline prepares it),
kv_aware (it hashes the prompt and claims what the request brings), spans (OpenTelemetry:
the exchange opens one per attempt), and an instance that does not admit the request at once
(it waits for its turn in the pipeline). The first three are decided before it starts
(`PlainPath.takes`); the last hands the request over to the exchange, with the attempts made.
"""

from __future__ import annotations

import asyncio

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.http import HTTPError

from . import metrics
from .exchange import ProxyExchange
from .relay import (Responder, can_retry, first_token_seen, refused, relay_answer, select,
                    watch_disconnect)
from .headers import Header
from .pipeline import Pipeline
from .request_model import ProxyRequest
from .router import Lease, Router, Slots
from .trace import EMPTY_KNOWLEDGE, Trace
from .upstream import SEND_FAILURES, Upstream


class PlainPath:
    """A worker's lean path: which requests it takes, and what it runs them with."""

    def __init__(self, router: Router, pipeline: Pipeline, upstream: Upstream, retries: int,
                 spans: bool) -> None:
        """`retries`: PROXY_RETRY_ATTEMPTS; `spans`: spans are on (they need the exchange)."""
        self.router, self.pipeline, self.upstream = router, pipeline, upstream
        self.retries = retries
        # Decided once: a policy that weighs the request's prompt, or spans, need the exchange.
        self.open = not router.weighs_prompts and not spans
        self.served = 0  # requests the lean path started (/healthz)

    def takes(self, request: ProxyRequest) -> bool:
        return self.open and request.knowledge is None

    def describe(self) -> dict[str, object]:
        """For /healthz: whether plain requests take the lean path, and how many did."""
        return {"open": self.open, "requests": self.served}


class PlainExchange:
    """One plain request on the lean path. `run` is the whole of it; the rest are callbacks
    (booking once sent, the first token) and what is rare (errors, the hand-over)."""

    __slots__ = ("_path", "_request", "_trace", "_client_headers", "_lease", "_key",
                 "_booked", "_predicted", "_attempt", "_tried")

    def __init__(self, path: PlainPath, request: ProxyRequest, trace: Trace,
                 client_headers: list[Header]) -> None:
        path.served += 1
        self._path = path
        self._request = request
        self._trace = trace
        self._client_headers = client_headers
        self._lease: Lease | None = None
        self._key = 0  # the event key of the current attempt
        self._booked = False
        self._predicted: float | None = None  # when its first token is predicted (wall ms)
        self._attempt = 0  # of this request, from 0
        self._tried: Slots = frozenset()  # the instances of its attempts: (slot, generation)

    async def run(self, out: Responder) -> None:
        path, request, trace = self._path, self._request, self._trace
        upstream, router = path.upstream, path.router
        try:
            forwarded = upstream.forwarded(self._client_headers)
        except HTTPError as exc:  # a header no instance may see: refused before any selection
            out.error(exc)
            return
        body = request.upstream_body
        for attempt in range(1 + path.retries):
            self._attempt = attempt
            lease = select(router, self._tried, request, trace, out)
            if lease is None:
                return
            watch = watch_disconnect(out.cycle)
            if watch is None:  # gone before anything was sent
                lease.release()
                return
            admitted = path.pipeline.admit_plain(lease, trace)
            if admitted is None:  # the instance makes requests wait: the pipeline's work
                watch.disarm()
                await self._hand_over(out, lease)
                return
            stages, self._key = admitted
            self._lease, self._booked = lease, False
            instance = lease.instance
            self._tried |= {(instance.slot, instance.generation)}
            failed, retry = True, False
            try:
                trace.forward_start_ms = start = now_ms()
                trace.actual_ready_queue_ms = start - trace.ready_enqueue_ms  # type: ignore[operator]
                try:
                    response = await upstream.send(instance.host, instance.port, request.endpoint.path,
                                                   body, forwarded, self._book)
                except SEND_FAILURES as exc:
                    retry = refused(upstream, router, lease, exc, request.endpoint.path, out, self._may_retry)
                else:
                    retry = await relay_answer(upstream, router, response, out, lease, trace, EMPTY_KNOWLEDGE,
                                               request.stream, self._first_token, self._may_retry)
                failed = False
            except asyncio.CancelledError:
                if not watch.absorbed():
                    raise
            finally:
                watch.disarm()
                path.pipeline.leave_ready(lease, stages, trace.ready_worker_idx, self._key, failed,
                                          self._booked)
                lease.release()
            if not retry:
                return
            metrics.retried(request.endpoint.route, instance.instance_id)
            trace.retries = attempt + 1

    def _book(self) -> None:
        """Once the request has left for the instance: booked with the sidecar."""
        assert self._lease is not None
        self._booked = True
        self._predicted = self._path.pipeline.book(self._lease, self._request, self._trace, self._key)

    def _first_token(self) -> None:
        first_token_seen(self._trace, self._request.endpoint.route, self._predicted)
        self._path.pipeline.first_token(self._key)

    def _may_retry(self) -> bool:
        return can_retry(self._path.router, self._attempt, self._path.retries, self._tried)

    async def _hand_over(self, out: Responder, lease: Lease) -> None:
        """The exchange goes on with the request from this attempt, on `lease`'s instance."""
        path = self._path
        await ProxyExchange(path.router, path.pipeline, path.upstream, self._request, self._trace,
                            retries=path.retries, client_headers=self._client_headers,
                            tried=self._tried, attempts_made=self._attempt, lease=lease).run(out)
