"""The worker's access log (PROXY_ACCESS_LOG, off by default): one line per proxied request,
written when it ends -- method, path, status, duration, the instance that served it and the
request id -- on the `cacheroute.access` logger, in the process's log format (text: the line;
JSON: the same fields as members). Not uvicorn's access logger: that one knows neither the
instance nor the request id, and formats on every request whether anyone reads it or not.

The request id is the client's X-Request-Id, else the Scheduler body's Request_ID (when not 0).
Nothing here runs unless JSON logs or the access log are on (DataPlane decides once, at start).
"""

from __future__ import annotations

import logging

from cacheroute_proxy import logs

from .headers import Header
from .trace import Trace

_log = logging.getLogger(logs.ACCESS_LOGGER)
_REQUEST_ID_HEADER = b"x-request-id"


def client_request_id(headers: list[Header]) -> str | None:
    for name, value in headers:
        if name == _REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return None


def tag_from_body(trace: Trace) -> None:
    """No X-Request-Id: the Scheduler's Request_ID names the request (a plain OpenAI body has 0)."""
    if logs.REQUEST_ID.get() is None and trace.request_id:
        logs.REQUEST_ID.set(str(trace.request_id))


def write(method: str, path: str, status: int, duration_s: float, trace: Trace) -> None:
    duration_ms = round(duration_s * 1000, 1)
    instance = trace.instance_id
    request_id = logs.REQUEST_ID.get()
    _log.info("%s %s %d %.1fms instance=%s request_id=%s", method, path, status, duration_ms,
              instance or "-", request_id or "-",
              extra={logs.ACCESS_FIELDS: {"method": method, "path": path, "status": status,
                                          "duration_ms": duration_ms, "instance": instance,
                                          "worker": trace.worker}})
