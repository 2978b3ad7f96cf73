"""Whether this worker builds OpenTelemetry spans, decided once at start.

`start_tracing` is the only door to proxy_workers/spans.py, which needs the optional
`[otel]` extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http): it is imported
only when an OTLP endpoint is set. Without the extra the worker says so once and serves
without spans; the client's traceparent then passes through untouched, as with tracing off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cacheroute_proxy.config import Settings

if TYPE_CHECKING:
    from .spans import Tracing

log = logging.getLogger("cacheroute.worker")


def start_tracing(settings: Settings, worker: str, index: int) -> Tracing | None:
    """The worker's Tracing, or None (off: no endpoint, OTEL_SDK_DISABLED, or no SDK).
    Worker 0 alone logs a missing SDK at error level: one line per host, not one per worker."""
    if not settings.otel_traces_on:
        return None
    try:
        from .spans import Tracing
    except ImportError as exc:
        (log.error if index == 0 else log.debug)(
            "tracing is off: OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not "
            "installed (%s); install the extra: pip install 'cacheroute-proxy[otel]'", exc)
        return None
    endpoint = settings.otel_exporter_otlp_traces_endpoint or settings.otel_exporter_otlp_endpoint
    if index == 0:
        log.info("tracing on: spans exported over OTLP/HTTP to %s", endpoint)
    return Tracing(worker, settings.strategy_name)
