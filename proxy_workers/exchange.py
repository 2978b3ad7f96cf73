"""One proxied request through the pipeline, from lease to last byte: the path of a request
with knowledge or a Scheduler body, of kv_aware's and of one with spans, and of a plain request
the lean path (plain_path.py) hands over because its instance makes it wait.

The lease is taken and released here and nowhere else, in one try/finally that covers every
way out: success, upstream error, timeout, client disconnect (watched while the upstream is
read, so a silent stall is noticed too) and cancellation. A client that goes away also closes
the upstream connection, so the instance stops generating for nobody. What it shares with the
lean path -- the response, the selection, the relay of the answer -- is relay.py.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.http import HTTPError

from . import metrics
from .headers import KV_KNOWLEDGE_IDS, KV_PREFIX_TOKENS, Header
from .pipeline import Job, Pipeline
from .refusals import InstanceLeft
from .relay import (Responder, can_retry, first_token_seen, refused, relay_answer, select,
                    watch_disconnect)
from .request_model import ProxyRequest
from .router import Lease, Router, Slots
from .trace import Trace
from .upstream import SEND_FAILURES, Upstream


class ProxyExchange:
    def __init__(self, router: Router, pipeline: Pipeline, upstream: Upstream,
                 request: ProxyRequest, trace: Trace, retries: int = 0,
                 client_headers: list[Header] | None = None, spans: Any = None,
                 tried: Slots = frozenset(), attempts_made: int = 0, lease: Lease | None = None) -> None:
        """`tried`, `attempts_made` and `lease`: what the lean path (plain_path.py) did before
        handing the request over, and the lease its last choice took, for the next attempt."""
        self._router = router
        self._pipeline = pipeline
        self._upstream = upstream
        self._job = Job(request, trace, spans=spans, client_headers=client_headers or ())
        self._retries = retries
        self._client_headers = client_headers or []
        self._forwarded = b""  # the client's headers for the instance, as lines
        self._attempt = attempts_made
        self._tried = tried
        self._chosen = lease

    async def run(self, out: Responder) -> None:
        trace = self._job.trace
        try:
            self._forwarded = self._upstream.forwarded(self._client_headers)
        except HTTPError as exc:  # a header no instance may see: refused before any selection
            out.error(exc, self._chosen)
            return
        for attempt in range(self._attempt, 1 + self._retries):
            self._attempt = attempt
            lease, self._chosen = self._chosen, None
            if lease is None:
                lease = select(self._router, self._tried, self._job.request, trace, out)
                if lease is None:
                    return
            self._tried |= {(lease.instance.slot, lease.instance.generation)}
            try:
                retry = await self._attempt_on(lease, out)
            finally:
                lease.release()
            if not retry:
                return
            metrics.retried(self._job.request.endpoint.route, lease.instance.instance_id)
            self._job.knowledge.prefix_tokens = 0  # KV was pushed to the failed instance only
            trace.retries = attempt + 1
            if self._job.spans is not None:
                self._job.spans.attempt_failed("retried on another instance")

    def _can_retry(self) -> bool:
        """Asked only once an attempt failed: another is allowed, and there is an instance to
        make it on."""
        return can_retry(self._router, self._attempt, self._retries, self._tried)

    async def _attempt_on(self, lease: Lease, out: Responder) -> bool:
        """One attempt on `lease`'s instance, watched for the client leaving (then nothing more
        is done, and False). True if it failed before sending anything and another should be
        made. The lean path (Pipeline.admit_at_once) forwards from this frame: no coroutine
        between it and the forward (each is paid at every resumption of a request's task)."""
        watch = watch_disconnect(out.cycle)
        if watch is None:  # gone before we started watching
            return False
        pipeline, job = self._pipeline, self._job
        try:
            if not pipeline.admit_at_once(lease, job):
                return await pipeline.run_admitted(lease, job, lambda: self._forward(lease, out))
            failed = True
            try:
                retry = await self._forward(lease, out)
                failed = False
                return retry
            finally:
                pipeline.forwarded(lease, job, failed)
        except HTTPError as exc:  # refused before anything was sent: queue full, timeout, gone
            if isinstance(exc, InstanceLeft) and self._can_retry():  # nothing reached it
                return True
            out.error(exc, lease)
            return False
        except asyncio.CancelledError:
            if not watch.absorbed():
                raise
            return False
        finally:
            watch.disarm()

    async def _forward(self, lease: Lease, out: Responder) -> bool:
        job = self._job
        request, trace = job.request, job.trace
        trace.forward_start_ms = start = now_ms()
        if trace.ready_enqueue_ms is not None:
            trace.actual_ready_queue_ms = start - trace.ready_enqueue_ms
        headers = self._forwarded
        spans = job.spans
        if spans is not None:  # the instance's parent is this attempt's forward span
            headers += spans.forward_headers(lease.instance)
        if job.knowledge.prefix_tokens:  # the simulated instance shortens its prefill by this
            headers += b"%s: %d\r\n%s: %s\r\n" % (
                KV_PREFIX_TOKENS, job.knowledge.prefix_tokens, KV_KNOWLEDGE_IDS,
                ",".join(job.knowledge.kv_ready_kids).encode("latin-1", "replace"))
        # A local, not kept on the job: the job holding a callable that holds the job would
        # be a reference cycle a request, left to the cyclic GC and its pauses.
        sent = functools.partial(self._pipeline.book_sent, lease, job) if job.book_when_sent else None
        instance, path = lease.instance, request.endpoint.path
        try:
            response = await self._upstream.send(instance.host, instance.port, path,
                                                 request.encoded_body(), headers, sent)
        except SEND_FAILURES as exc:
            return refused(self._upstream, self._router, lease, exc, path, out, self._can_retry)
        return await relay_answer(self._upstream, self._router, response, out, lease, trace,
                                  job.knowledge, request.stream, lambda: self._first_token(job),
                                  self._can_retry, spans)

    def _first_token(self, job: Job) -> None:
        first_token_seen(job.trace, job.request.endpoint.route, job.predicted_first_token_ms)
        self._pipeline.first_token(job.key)
