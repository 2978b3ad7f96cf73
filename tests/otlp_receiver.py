"""A test OTLP/HTTP trace receiver: what a collector is to the proxy, on 127.0.0.1.

It accepts `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` (gzip or not), as the
SDK's OTLP/HTTP exporter sends it, decodes it with opentelemetry-proto and keeps every span,
flattened into a `ReceivedSpan`; it answers with an empty `ExportTraceServiceResponse`.
Anything else is a 404 or a 400, counted in `rejected`, so a test sees a wrong export.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.background_http import BackgroundHTTPServer


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver(BackgroundHTTPServer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        super().__init__(self._handler())

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT is set to (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self.bound_port}"

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def _received(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                        span.kind, span.start_time_unix_nano, span.end_time_unix_nano,
                        _attributes(span.attributes), span.status.code, resource))
        with self._lock:
            self.spans += spans

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces":
                    receiver.rejected.append(f"POST {self.path}")
                    self._answer(404, b"")
                    return
                try:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    receiver._received(body)
                except Exception as exc:  # a body that is not an ExportTraceServiceRequest
                    receiver.rejected.append(f"{type(exc).__name__}: {exc}")
                    self._answer(400, b"")
                    return
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # quiet: pytest shows failures
                pass

        return Handler


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
