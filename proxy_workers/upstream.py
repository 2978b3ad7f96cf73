"""Talking to instances: pooled keep-alive connections per worker, bounded timeouts.

The forward itself goes through cacheroute_proxy/http1/client.py (a pre-built request written
in one call, the answer parsed by httptools; a request sent again once after the keep-alive
race, `Http1Pool.send`); the rarer calls (the KDN, an instance's control plane) through
one aiohttp session, `Upstream.session`.

Three separate bounds, because they fail differently: connect (the instance is down),
first byte (it accepted the request but never answers: a hung engine) and idle (a stream that
stalls mid-way). None of them is the original's 6-hour total.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import aiohttp

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError

from .headers import Header, forwarded_block, request_dropped
from cacheroute_proxy.http1.chunk_pass import ChunkPasser
from cacheroute_proxy.http1.client import (KEEPALIVE_S, ConnectFailed, HeadTimeout, Http1Pool, IdleTimeout,
                                           UpstreamResponse, header_lines, request_line)

_LINE_CACHE_SIZE = 1024
# What `Upstream.send`'s awaitable raises when no answer head came (`Upstream.refusal`).
SEND_FAILURES = (ConnectFailed, HeadTimeout, OSError)


def base_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class UpstreamFailure(Exception):
    """The instance failed after the response started; `reason` goes into cacheroute_meta."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Upstream:
    def __init__(self, settings: Settings, replace_trace_context: bool = False) -> None:
        self._settings = settings
        own = {"Content-Type": "application/json"}
        if settings.openai_api_key:  # never "Bearer None"
            own["Authorization"] = f"Bearer {settings.openai_api_key}"
        # The proxy's own headers, last, up to the Content-Length header's value.
        self._own = header_lines(own) + b"Content-Length: "
        # replace_trace_context: spans are on, the exchange writes the forward's traceparent.
        self._dropped = request_dropped(replace_authorization=bool(settings.openai_api_key),
                                        replace_trace_context=replace_trace_context)
        self._session: aiohttp.ClientSession | None = None
        # The last client headers `forwarded` turned into lines, and those lines: a client
        # sends the same headers request after request, on one connection and on the next.
        self._last_headers: list[Header] = []
        self._last_block = b""
        self._pool = Http1Pool(settings.upstream_pool_size, KEEPALIVE_S)
        # Request line and Host per (path, host, port): built once, not per request.
        self._lines: dict[tuple[str, str, int], bytes] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._settings.upstream_pool_size,
                                         keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, connect=self._settings.upstream_connect_timeout_s,
                                        sock_connect=self._settings.upstream_connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        self._pool.close()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream.start() not called"
        return self._session

    def forwarded(self, client_headers: list[Header]) -> bytes:
        """The client's headers that go to the instance (proxy_workers/headers.py), as lines
        for `send`: computed once per request, whatever the attempts, and not again for the
        same headers as the last request's."""
        if client_headers == self._last_headers:
            return self._last_block
        block = forwarded_block(client_headers, self._dropped)  # HTTPError: not kept
        self._last_headers, self._last_block = list(client_headers), block
        return block

    def send(self, host: str, port: int, path: str, body: bytes, headers: bytes = b"",
             sent: Callable[[], None] | None = None) -> Awaitable[UpstreamResponse]:
        """POST: the awaitable gives the response once its head has arrived, or raises one of
        SEND_FAILURES (`refusal` says it to the client). `headers`: complete `name: value\r\n`
        lines (`forwarded`, and the request's own), written between the Host line and the
        proxy's own headers; `sent`: called once the request is written, before its answer is
        awaited (not when no connection was had). Not a coroutine: the request's task awaits
        the pool's own, one frame fewer at each of its resumptions.

        The first-byte bound is the connection's own lazy timer (Http1Connection.request: no
        asyncio.timeout, no timer per request); only a new connection's connect has its own."""
        settings = self._settings
        request = b"%s%s%s%d\r\n\r\n%s" % (self._line(path, host, port), headers, self._own,
                                             len(body), body)
        return self._pool.send(host, port, request, settings.upstream_first_byte_timeout_s,
                               min(settings.upstream_connect_timeout_s,
                                   settings.upstream_first_byte_timeout_s), sent)

    def refusal(self, exc: BaseException, host: str, port: int, path: str) -> HTTPError:
        """What a failure of `send` tells the client: 502 when no connection was had or it was
        closed or reset before the head, 504 when the head did not come in time."""
        url = f"{base_url(host, port)}{path}"
        if isinstance(exc, ConnectFailed):
            return HTTPError(502, "upstream_unavailable", f"cannot connect to {url}: {exc}")
        if isinstance(exc, HeadTimeout):
            return HTTPError(504, "upstream_timeout", f"{url} sent no response within "
                             f"{self._settings.upstream_first_byte_timeout_s:g}s")
        # reset or closed before the head (and not the keep-alive race)
        return HTTPError(502, "upstream_unavailable", f"{url}: {type(exc).__name__}: {exc}")

    def _line(self, path: str, host: str, port: int) -> bytes:
        line = self._lines.get((path, host, port))
        if line is None:
            if len(self._lines) >= _LINE_CACHE_SIZE:  # instances come and go: start afresh
                self._lines.clear()
            line = self._lines[(path, host, port)] = request_line(path, host, port)
        return line

    async def relay(self, response: UpstreamResponse, sink: Callable[[bytes], bool],
                    passer: ChunkPasser | None = None) -> bool:
        """`response.relay(sink, passer)`: the body handed on as it arrives, True at the end,
        False when the consumer is full; UpstreamFailure on a stall past the idle bound, a
        reset or a truncation."""
        response.limit_idle(self._settings.upstream_idle_timeout_s)
        try:
            return await response.relay(sink, passer)
        except (IdleTimeout, OSError) as exc:
            raise self._failure(exc) from None

    async def read_all(self, response: UpstreamResponse) -> bytes:
        """The whole body, with the same idle bound between arrivals as `relay`."""
        parts: list[bytes] = []
        try:
            while data := response.read_nowait():  # a small answer is often here already
                parts.append(data)
        except OSError as exc:
            raise self._failure(exc) from None
        if response.at_eof():
            return parts[0] if len(parts) == 1 else b"".join(parts)
        response.limit_idle(self._settings.upstream_idle_timeout_s)
        try:
            while chunk := await response.readany():  # no generator: this is the common path
                parts.append(chunk)
        except (IdleTimeout, OSError) as exc:
            raise self._failure(exc) from None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _failure(self, exc: BaseException) -> UpstreamFailure:
        """What a body's read failure tells the client: a stall past the idle bound, or the
        connection's error."""
        if isinstance(exc, IdleTimeout):
            return UpstreamFailure(f"upstream_idle_timeout: no data for "
                                   f"{self._settings.upstream_idle_timeout_s:g}s")
        return UpstreamFailure(f"upstream_failed: {type(exc).__name__}: {exc}")
