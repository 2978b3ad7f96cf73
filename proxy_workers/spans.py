"""OpenTelemetry spans of the requests a worker serves, exported over OTLP/HTTP.

Imported only when tracing is on (proxy_workers/tracing.py), so the product runs without the
SDK installed. The spans are built from the request's `Trace` record, whose timestamps the
request writes anyway: most of them once the request has ended, with the start and end times
it recorded. Only the spans whose id must leave the worker while the request runs are started
live: `receive` (the request's own, started at arrival: its trace id goes everywhere),
`forward` (its id is the instance's parent), `prepare` and its `kdn_fetch` / `kv_inject`
(their ids are the KDN's and the instance control plane's parents).

    receive                    the whole request, SERVER, child of the client's traceparent
    ├── select                 Router.acquire (the last attempt's)
    ├── prepare                the prepare stage (knowledge), with
    │   ├── kdn_fetch          the KDN search
    │   └── kv_inject          the instance's KV pull (kvcache)
    ├── admission_wait         released to ready until admitted (READY_CONCURRENCY)
    └── forward                one per attempt, CLIENT; the traceparent the instance gets
        └── first_token        from the forward to the first byte of the answer: a stream's
                               first chunk, a JSON answer's head
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from cacheroute_proxy.clock import now_ms
from shm_schema import InstanceSlot

from .trace import Trace
from .traceparent import format_traceparent, from_headers

log = logging.getLogger("cacheroute.worker")

SERVICE_NAME = "cacheroute-proxy"
SHUTDOWN_WAIT_S = 2.0
_MS = 1_000_000  # ns per ms: the trace's times are wall-clock milliseconds


class Tracing:
    """One per worker: the tracer provider, its batch processor and OTLP/HTTP exporter, all
    configured by the SDK's standard variables (endpoint, headers, timeout, sampler, batch
    delays, service name)."""

    def __init__(self, worker: str, strategy: str, exporter: Any = None) -> None:
        resource = Resource.create({"service.instance.id": worker, "process.pid": os.getpid()})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer("cacheroute_proxy.worker")
        self._strategy = strategy

    def begin(self, path: str, headers: list[tuple[bytes, bytes]], trace: Trace) -> RequestSpans:
        """The request's spans, its `receive` started at its arrival: a child of the client's
        traceparent if a valid one came, else the root of a new trace."""
        parent, state = from_headers(headers)
        context = None
        if parent is not None:
            # The tracestate is passed on as bytes by this module, not parsed into the SDK's
            # (which would log a warning for every request with a member it does not accept).
            context = otel.set_span_in_context(NonRecordingSpan(SpanContext(
                parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags))))
        root = self._tracer.start_span(
            "receive", context, SpanKind.SERVER, start_time=_ns(trace.proxy_recv_ms),
            attributes={"http.request.method": "POST", "url.path": path, "http.route": path,
                        "cacheroute.worker": trace.worker or "",
                        "cacheroute.strategy": self._strategy})
        return RequestSpans(self._tracer, root, trace, state)

    def finish(self, spans: RequestSpans, status: int) -> None:
        """End the request's spans (the batch processor exports them later, off this thread).
        Called in the request's `finally`: a failure here is logged, never the request's."""
        try:
            spans.finish(status)
        except Exception as exc:
            log.error("could not end the request's spans: %s", exc, exc_info=exc)

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Export what is still batched, waiting `wait_s` at most: the export blocks for as
        long as the exporter's timeout, and a collector that does not answer must not hold up
        the worker's exit (the thread is a daemon: it dies with the process)."""
        flush = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(wait_s)


class RequestSpans:
    """One request's spans: the live ones, and the headers that carry their ids on."""

    __slots__ = ("_tracer", "_trace", "_root", "_state", "_forwards", "_live", "_head_ns",
                 "error", "_attempt")

    def __init__(self, tracer: Any, root: Any, trace: Trace, state: bytes | None) -> None:
        self._tracer = tracer
        self._trace = trace
        self._root = root
        self._state = state  # the client's tracestate, passed on as it came
        self._forwards: list[Any] = []
        self._live: dict[str, Any] = {}
        self._head_ns: int | None = None
        self.error: str | None = None  # a stream cut after it started: the status alone is 200
        self._attempt = 0

    # --- while the request runs -------------------------------------------------------------
    def forward_headers(self, instance: InstanceSlot) -> bytes:
        """A new `forward` span for this attempt, and the traceparent (and tracestate) lines
        that make it the instance's parent."""
        span = self._tracer.start_span(
            "forward", otel.set_span_in_context(self._root), SpanKind.CLIENT,
            start_time=_ns(self._trace.forward_start_ms),
            attributes={"cacheroute.instance_id": instance.instance_id,
                        "server.address": instance.host, "server.port": instance.port,
                        "cacheroute.attempt": self._attempt})
        self._forwards.append(span)
        self._head_ns = None
        lines = b"traceparent: %s\r\n" % _traceparent(span).encode()
        if self._state:
            lines += b"tracestate: %s\r\n" % self._state
        return lines

    def answer_head(self, status: int) -> None:
        """The instance's answer head arrived: the first byte of a JSON answer."""
        self._head_ns = now_ms() * _MS  # milliseconds, as every time the trace holds
        if self._forwards:
            self._forwards[-1].set_attribute("http.response.status_code", status)

    def attempt_failed(self, reason: str) -> None:
        """The attempt failed before the client saw anything; another instance is tried."""
        if self._forwards:
            span = self._forwards[-1]
            if span.is_recording() and getattr(span, "end_time", None) is None:
                span.set_status(Status(StatusCode.ERROR, reason))
                span.set_attribute("error.type", reason)
                span.end(now_ms() * _MS)  # milliseconds: the next attempt's times are
        self._attempt += 1

    def kdn_headers(self) -> dict[str, str]:
        """The traceparent for the KDN search: a live `kdn_fetch` under `prepare`."""
        return self._child_headers("kdn_fetch", self._trace.kdn_fetch_start_ms)

    def kv_inject_headers(self) -> dict[str, str]:
        """The traceparent for the instance's KV pull: a live `kv_inject` under `prepare`."""
        return self._child_headers("kv_inject", self._trace.kv_ack_start_ms)

    def _child_headers(self, name: str, start_ms: int | None) -> dict[str, str]:
        prepare = self._live.get("prepare")
        if prepare is None:
            prepare = self._live["prepare"] = self._tracer.start_span(
                "prepare", otel.set_span_in_context(self._root),
                start_time=_ns(self._trace.prepare_start_ms or start_ms))
        earlier = self._live.get(name)
        if earlier is not None:  # a retry's KV pull on another instance: the first one is over
            earlier.end(_ns(start_ms))
        span = self._live[name] = self._tracer.start_span(
            name, otel.set_span_in_context(prepare), SpanKind.CLIENT, start_time=_ns(start_ms))
        headers = {"traceparent": _traceparent(span)}
        if self._state:
            headers["tracestate"] = self._state.decode("latin-1")
        return headers

    # --- at the end -------------------------------------------------------------------------
    def finish(self, status: int) -> None:
        """End every span, with the times the trace recorded; the rest built from them."""
        root, t = self._root, self._trace
        end = time.time_ns()
        if not root.is_recording():  # not sampled: the ids went on, nothing to export
            return
        under_root = otel.set_span_in_context(root)
        if t.route_select_start_ms is not None:
            self._span("select", under_root, t.route_select_start_ms, t.route_select_end_ms, end,
                       {"cacheroute.strategy": _str(root, "cacheroute.strategy"),
                        "cacheroute.instance_id": t.instance_id or "",
                        **({"cacheroute.snapshot_age_ms": t.snapshot_age_ms}
                           if t.snapshot_age_ms is not None else {})},
                       None if t.route_select_end_ms is not None else "no instance selected")
        self._end_prepare(under_root, end)
        if t.ready_enqueue_ms is not None:
            self._span("admission_wait", under_root, t.ready_enqueue_ms, t.ready_dequeue_ms, end,
                       {"cacheroute.instance_id": t.instance_id or ""},
                       None if t.ready_dequeue_ms is not None else "not admitted")
        self._end_forwards(end, status)
        attributes = {"http.response.status_code": status, "cacheroute.instance_id": t.instance_id,
                      "cacheroute.request_id": t.request_id, "cacheroute.retries": t.retries}
        root.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if self.error is not None or status >= 500:
            reason = self.error or f"status {status}"
            root.set_attribute("error.type", self.error or str(status))
            root.set_status(Status(StatusCode.ERROR, reason))
        root.end(end)

    def _end_prepare(self, under_root: Any, end: int) -> None:
        t = self._trace
        attributes = {k: v for k, v in (("cacheroute.injection_mode", t.injection_mode),
                                        ("cacheroute.iws_reason", t.iws_reason),
                                        ("cacheroute.kvcache_actual_path", t.kvcache_actual_path))
                      if v is not None}
        prepare = self._live.get("prepare")
        if prepare is not None:
            for name, start_ms, end_ms in (("kdn_fetch", t.kdn_fetch_start_ms, t.kdn_fetch_end_ms),
                                           ("kv_inject", t.kv_ack_start_ms, t.kv_ack_end_ms)):
                span = self._live.get(name)
                if span is not None:
                    if end_ms is None:
                        span.set_status(Status(StatusCode.ERROR, f"{name} did not complete"))
                    span.end(_ns(end_ms) if end_ms is not None else end)
            prepare.set_attributes(attributes)
            prepare.end(_ns(t.prepare_self_done_ms) if t.prepare_self_done_ms is not None else end)
        elif t.prepare_start_ms is not None:
            self._span("prepare", under_root, t.prepare_start_ms, t.prepare_self_done_ms, end,
                       attributes, None)

    def _end_forwards(self, end: int, status: int) -> None:
        t = self._trace
        if not self._forwards:
            return
        last = self._forwards[-1]
        if getattr(last, "end_time", None) is not None:  # the last attempt failed and nothing came after it
            return
        first_ns = _ns(t.first_token_ms) if t.first_token_ms is not None else self._head_ns
        if first_ns is not None:
            first = self._tracer.start_span("first_token", otel.set_span_in_context(last),
                                            start_time=_ns(t.forward_start_ms))
            first.end(max(first_ns, _ns(t.forward_start_ms)))
        if status >= 500 or self.error is not None:
            last.set_status(Status(StatusCode.ERROR, self.error or f"status {status}"))
        last.end(_ns(t.forward_end_ms) if t.forward_end_ms is not None else end)

    def _span(self, name: str, context: Any, start_ms: int, end_ms: int | None, end: int,
              attributes: dict[str, Any], error: str | None) -> None:
        span = self._tracer.start_span(name, context, start_time=_ns(start_ms), attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(_ns(end_ms) if end_ms is not None else end)


def _traceparent(span: Any) -> str:
    context = span.get_span_context()
    return format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))


def _ns(ms: int | None) -> int:
    return (ms if ms is not None else now_ms()) * _MS


def _str(span: Any, key: str) -> str:
    return str(span.attributes.get(key, "")) if span.is_recording() else ""
