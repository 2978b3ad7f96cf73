"""The Scheduler link's HTTP: JSON POSTs to `SCHEDULER_CP_URL` over kept-alive HTTP/1.1.

It is the forward's client (cacheroute_proxy/http1/client.py), for its keep-alive rule. A pooled
connection idle for longer than KEEPALIVE_S (4 s, under the 5 s keep-alive of uvicorn and most
servers) is closed rather than reused; and a request on a reused connection that the Scheduler
closed or reset before a byte of the answer goes once more, on a new connection. A heartbeat
interval equal to the Scheduler's keep-alive (5 s and 5 s on uvicorn's defaults) would
otherwise send every few heartbeats on a connection being closed under it: a failure, then a
needless registration.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from urllib.parse import unquote, urlsplit

from cacheroute_proxy.http1.client import (KEEPALIVE_S, HeadTimeout, Http1Pool, UpstreamResponse,
                                           header_lines, request_line)

POOL_SIZE = 2          # one call at a time, and the unregister at the stop
REPLY_LIMIT = 1 << 20  # a Scheduler's answers are small; a runaway one must not fill memory


class ReplyTooLarge(Exception):
    pass


class SchedulerHttp:
    """POST, read the whole answer: (status, body). Raises TimeoutError past `timeout_s` (the
    whole call: connect, answer and body), ConnectFailed, OSError (closed or reset), or
    ReplyTooLarge."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        assert parts.hostname, base_url  # Settings checked the URL
        tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if tls else 80)
        self._prefix = parts.path.rstrip("/")
        self._timeout_s = timeout_s
        self._pool = Http1Pool(POOL_SIZE, KEEPALIVE_S, ssl.create_default_context() if tls else None)
        own = {"Content-Type": "application/json"}
        if parts.username is not None:  # user:password@ in the URL: Basic, as any client does
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            own["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        self._headers = header_lines(own) + b"Content-Length: "

    @property
    def resent(self) -> int:
        """Requests sent again after the Scheduler closed a kept-alive connection unanswered."""
        return self._pool.resent

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = b"%s%s%d\r\n\r\n%s" % (request_line(self._prefix + path, self._host, self._port),
                                         self._headers, len(body), body)
        async with asyncio.timeout(self._timeout_s):
            try:
                response = await self._pool.send(self._host, self._port, request, self._timeout_s,
                                                 self._timeout_s)
            except HeadTimeout:  # the same bound as the timeout around it, whichever fires first
                raise TimeoutError from None
            try:
                payload = await _read_all(response)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, payload

    def close(self) -> None:
        self._pool.close()


async def _read_all(response: UpstreamResponse) -> bytes:
    parts: list[bytes] = []
    size = 0
    while chunk := await response.readany():
        size += len(chunk)
        if size > REPLY_LIMIT:
            raise ReplyTooLarge(f"answer larger than {REPLY_LIMIT} bytes")
        parts.append(chunk)
    return b"".join(parts)
