"""A stdlib HTTP server on 127.0.0.1, served from a daemon thread for the length of a `with`
block: the base of the suite's small scripted peers (a fake control plane, an OTLP receiver)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class BackgroundHTTPServer:
    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def bound_port(self) -> int:
        return self._server.server_address[1]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def answer_json(handler: BaseHTTPRequestHandler, body: bytes, status: int = 200) -> None:
    """Send `body` (JSON bytes, or what a test passes off as JSON) as the whole answer."""
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
