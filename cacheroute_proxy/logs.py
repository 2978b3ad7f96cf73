"""One log format for every process, chosen by PROXY_LOG_FORMAT:

- `text` (the default): `time role[pid] level logger: message`, one line per event;
- `json`: one JSON object per line: `time` (UTC, ISO 8601 with milliseconds), `level`, `role`,
  `pid`, `logger`, `message`, `request_id` when the line was logged while a worker served a
  request that has one (see REQUEST_ID), `exception` with the traceback when there is one, and
  the fields of an access-log line (proxy_workers/access_log.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import Any

import msgspec

# The id of the request being served, for the lines logged on its behalf: set by the worker for
# the duration of a request (its own task, so nothing leaks to the next one), only when a log
# line can show it (JSON logs or the access log), so the text default costs nothing per request.
REQUEST_ID: ContextVar[str | None] = ContextVar("cacheroute_request_id", default=None)
# An access-log record carries its fields here (logging's `extra`), merged into the JSON object.
ACCESS_FIELDS = "cacheroute_access"
ACCESS_LOGGER = "cacheroute.access"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self._role = role
        self._pid = os.getpid()
        self._encoder = msgspec.json.Encoder()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso_utc(record.created), "level": record.levelname, "role": self._role,
            "pid": self._pid, "logger": record.name, "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        fields = getattr(record, ACCESS_FIELDS, None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return self._encoder.encode(entry).decode()


def _iso_utc(created: float) -> str:
    seconds = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"


def configure(role: str, level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else logging.Formatter(
        f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's access log is per request: noise at info on a data plane (the worker has its own,
    # off by default: PROXY_ACCESS_LOG).
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # Access lines are written only when PROXY_ACCESS_LOG asks for them, and then whatever
    # PROXY_LOG_LEVEL says (asking for them is the point).
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)


def keep_control_after_signals() -> None:
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with the default handler
    that kills the process before our `finally` blocks release shared-memory state. A no-op
    handler makes the re-raise harmless, so cleanup always runs."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
