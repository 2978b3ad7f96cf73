"""The product's HTTP/1.1 server, for every role (the workers' data plane, the sidecar's
control plane): one asyncio Protocol per connection, requests parsed by httptools. A worker's
two proxied routes are handlers given the request's :class:`Cycle` itself (`routes`); every
other request goes to the role's ASGI app (Starlette) through a minimal scope/receive/send of
the same Cycle.

Why its own: under uvicorn, its protocol callbacks, the ASGI messages of every chunk and the
private attributes the worker had to reach into for a one-write answer and a disconnect
callback were a large share of a request's CPU. Here those are plain methods of the Cycle:
`read_body`, `start`/`write`/`end`, `send_whole` (head and body in one write),
`on_disconnect` (called once when the client leaves before the answer is complete), `started`
and `complete`.

What it keeps from uvicorn's behaviour, on purpose, because clients and tests depend on it:
HTTP/1.1 keep-alive by default, `Connection: close` and HTTP/1.0 honoured, pipelined requests
answered in order (reading pauses while one is answered), the idle keep-alive timeout,
`transfer-encoding: chunked` for a response without a length, `date` and `server` headers, 400
and close on a request that does not parse, 500 when the app fails before answering, and the
drain of proxy_workers/drain.py (stop accepting, never close a connection under a request that
may be on its way, cut at the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import re
import signal
import socket
import time
from collections import deque
from http import HTTPStatus
from typing import Any, Callable, Coroutine, Protocol

import httptools

log = logging.getLogger("cacheroute.http")

ASGIApp = Callable[..., Any]
Header = tuple[bytes, bytes]
Handler = Callable[["Cycle"], Coroutine[Any, Any, None]]

SERVER_HEADER = (b"server", b"cacheroute-proxy")
# Request body buffered before reading pauses until the app takes it (as uvicorn: 64 KiB).
BODY_HIGH_WATER = 64 * 1024
CUT_FLUSH_S = 2.0

_STATUS_LINES = {int(s): b"HTTP/1.1 %d %s\r\n" % (s, s.phrase.encode()) for s in HTTPStatus}
_NO_BODY_STATUSES = frozenset({204, 304})
_DISCONNECT = {"type": "http.disconnect"}
# What a header may not carry (response splitting); uvicorn refuses the same.
_UNSAFE_NAME = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")
_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0A-\x1F\x7F]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _checked(name: bytes, value: bytes) -> None:
    if _UNSAFE_NAME.search(name):
        raise RuntimeError("Invalid HTTP header name.")
    if _UNSAFE_VALUE.search(value):
        raise RuntimeError("Invalid HTTP header value.")


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class _DateHeader:
    """The `date` header, formatted once a second, not once a response."""

    def __init__(self) -> None:
        self._second = -1
        self.value = b""

    def current(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self.value = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.value


_DATE = _DateHeader()


def _plain(status: int, text: bytes) -> bytes:
    return (status_line(status) + _DATE.current() + b"server: cacheroute-proxy\r\n"
            b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(text) + text)


class Draining(Protocol):
    """What the server asks of the role's drain: a worker's proxy_workers/drain.py Drain, or
    :class:`GracefulExit`."""

    timeout_s: float
    # True: an idle connection stays open through the drain (a request may be on its way,
    # and a peer on the same port takes the next one); False: it is closed at once.
    keeps_idle_connections: bool

    @property
    def draining(self) -> bool: ...

    def begin(self, connections: int) -> None: ...

    def cut_remaining(self) -> None: ...

    def report(self) -> None: ...

    async def run(self, cycle: Cycle, request: Coroutine[Any, Any, None]) -> None:
        """Run one request's handling, knowing it is in flight (and ending it if it is cut)."""


class GracefulExit:
    """The plain drain (the sidecar's): stop accepting, close idle connections (no peer takes
    over the port, so nothing is gained by waiting on them), give what is in flight
    `timeout_s`, then the server closes what is left; nothing to finish by hand or report."""

    keeps_idle_connections = False

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False

    def begin(self, connections: int) -> None:
        self.draining = True

    def cut_remaining(self) -> None:
        pass

    def report(self) -> None:
        pass

    async def run(self, cycle: Cycle, request: Coroutine[Any, Any, None]) -> None:
        await request


class BodyTooLarge(Exception):
    """The request body passed the limit `read_body` was given."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Cycle:
    """One request and its response: what a route handler reads and writes (`read_body`,
    `start`/`write`/`end`, `send_whole`, `on_disconnect`), and what ASGI calls `scope`,
    `receive` and `send` for the app behind the routes."""

    __slots__ = ("conn", "method", "raw_path", "query_string", "headers", "http_version",
                 "keep_alive", "body", "body_size", "more_body", "disconnected", "started",
                 "complete", "chunked", "head_only", "on_disconnect", "expect_continue",
                 "handler", "_body_event", "_scope")

    def __init__(self, conn: Connection, method: str, raw_path: bytes, query_string: bytes,
                 headers: list[Header], http_version: str, keep_alive: bool,
                 handler: Handler | None = None) -> None:
        self.conn = conn
        self.method = method
        self.raw_path = raw_path
        self.query_string = query_string
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.handler = handler  # a route of the server's own; None: the ASGI app answers
        self.body: list[bytes] = []
        self.body_size = 0
        self.more_body = True
        self.disconnected = False
        self.started = False
        self.complete = False
        self.chunked = False
        self.head_only = method == "HEAD"
        self.on_disconnect: Callable[[], None] | None = None
        self.expect_continue = False  # `Expect: 100-continue`: say so when the body is asked for
        self._body_event: asyncio.Event | None = None
        self._scope: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return self.raw_path.decode("latin-1")

    @property
    def scope(self) -> dict[str, Any]:
        """The ASGI scope, built only for a request the ASGI app answers."""
        if self._scope is None:
            conn = self.conn
            self._scope = {
                "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": self.http_version, "method": self.method, "scheme": "http",
                "path": self.path, "raw_path": self.raw_path, "query_string": self.query_string,
                "root_path": "", "headers": self.headers, "client": conn.client,
                "server": conn.local,
            }
        return self._scope

    # --- request body ------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self.complete:  # answered already (a 413, say): the rest of the body is dropped
            return
        self.body.append(data)
        self.body_size += len(data)
        if self.body_size >= BODY_HIGH_WATER:
            self.conn.pause_reading()
        self._wake()

    def end_of_body(self) -> None:
        self.more_body = False
        self._wake()

    def lost(self) -> None:
        self.disconnected = True
        self._wake()
        callback = self.on_disconnect
        if callback is not None and not self.complete:
            self.on_disconnect = None
            callback()

    def _wake(self) -> None:
        if self._body_event is not None:
            self._body_event.set()

    async def _more(self) -> None:
        """Wait for more of the body (or its end, or the client leaving)."""
        if self.expect_continue:
            self.expect_continue = False
            if not self.started:
                self.conn.write(_CONTINUE)
        self._body_event = event = asyncio.Event()
        self.conn.resume_reading()
        await event.wait()
        self._body_event = None

    def _take_body(self) -> bytes:
        body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.body_size = 0
        if self.more_body:
            self.conn.resume_reading()
        return body

    async def read_body(self, limit: int) -> bytes:
        """The whole body; BodyTooLarge as soon as what arrived passes `limit` bytes (the rest
        is then dropped as it comes), ClientGone if the client leaves first."""
        while self.more_body and not self.disconnected:
            if self.body_size > limit:
                break
            await self._more()
        if self.disconnected:
            raise ClientGone
        if self.body_size > limit:
            self.body.clear()
            raise BodyTooLarge
        return self._take_body()

    async def receive(self) -> dict[str, Any]:
        if self.disconnected or self.complete:
            return _DISCONNECT
        if self.more_body and not self.body:
            await self._more()
            if self.disconnected:
                return _DISCONNECT
        body = self._take_body()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    # --- response ------------------------------------------------------------------------------
    async def send(self, message: dict[str, Any]) -> None:
        if self.disconnected:
            return
        kind = message["type"]
        if kind == "http.response.start":
            self.start(message["status"], message.get("headers", ()))
        elif kind == "http.response.body":
            body = message.get("body", b"")
            if message.get("more_body", False):
                if self.write(body):
                    await self.conn.writable()
            else:
                self.end(body)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def start(self, status: int, headers: Any) -> None:
        """The response head; the body follows by `write` and `end`."""
        if self.started:
            raise RuntimeError("response already started")
        if self.disconnected:
            self.started = True  # nobody reads it: the handler goes on to its end regardless
            return
        self._write_head(status, headers)

    def write(self, body: bytes) -> bool:
        """A part of the body (framed as a chunk when the head gave no length). True when the
        client's socket is full: await `writable()` before writing more."""
        if not self.started or self.complete:
            raise RuntimeError("response body without a head, or after its end")
        conn = self.conn
        if body and not self.head_only and not self.disconnected:
            conn.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)
        return conn.write_paused

    def end(self, body: bytes = b"") -> None:
        """The last part of the body: the response is complete."""
        if not self.started or self.complete:
            raise RuntimeError("response body without a head, or after its end")
        if not self.head_only and not self.disconnected:
            if not self.chunked:
                if body:
                    self.conn.write(body)
            elif body:
                self.conn.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            else:
                self.conn.write(b"0\r\n\r\n")
        self._completed()

    async def writable(self) -> None:
        """Return once the client's socket takes more (at once unless writes are paused)."""
        if self.conn.write_paused:
            await self.conn.writable()

    def _write_head(self, status: int, headers: Any) -> None:
        parts = [status_line(status), _DATE.current(), b"server: cacheroute-proxy\r\n"]
        length_known = False
        for name, value in headers:
            _checked(name, value)
            if name == b"content-length":
                length_known = True
            elif name == b"transfer-encoding":
                length_known = True  # the app frames its own body
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
        if not length_known and not self.head_only and status not in _NO_BODY_STATUSES:
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.started = True
        self.conn.write(b"".join(parts))

    def send_whole(self, status: int, headers: list[Header], body: bytes) -> bool:
        """The whole answer (headers without content-length) in one write; False when it does
        not apply (started, gone, HEAD): the caller then uses `send`."""
        if self.started or self.disconnected or self.head_only:
            return False
        parts = [status_line(status), _DATE.current(), b"server: cacheroute-proxy\r\n"]
        for name, value in headers:
            if _UNSAFE_VALUE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"content-length: %d\r\n\r\n" % len(body), body)
        self.started = True
        self.conn.write(b"".join(parts))
        self._completed()
        return True

    def _completed(self) -> None:
        self.complete = True
        self.on_disconnect = None
        self.conn.response_done(self)


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one at a time, keeps the idle timer."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.cycle: Cycle | None = None  # the request being answered
        self.queued: deque[Cycle] = deque()  # pipelined requests waiting their turn
        self.parsing: Cycle | None = None  # the request whose head or body is arriving
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False
        self.idle_since: float | None = None  # loop time the connection became idle
        self._url = b""
        self._headers: list[Header] = []
        self._expect_continue = False
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.local = (sock[0], sock[1]) if isinstance(sock, tuple) else None
        self._arm_idle_timer()
        if self.server.drain.draining:  # accepted after the listeners closed
            self.shutdown()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # as uvicorn without WebSockets: served as plain HTTP
            log.warning("Unsupported upgrade request.")
        except httptools.HttpParserError:
            self._refuse(400, b"Invalid HTTP request received.")

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._cancel_idle_timer()
        for cycle in (self.cycle, self.parsing, *self.queued):
            if cycle is not None:
                cycle.lost()
        self.queued.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._cancel_idle_timer()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = self._url
        if b"?" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            path, query = parsed.path, parsed.query or b""
        else:  # the usual proxied request: no query, nothing to parse
            path, query = url, b""
        method = parser.get_method().decode("ascii")
        server = self.server
        keep_alive = parser.should_keep_alive() and not server.drain.draining
        cycle = Cycle(self, method, path, query, self._headers, parser.get_http_version(),
                      keep_alive, server.routes.get((method, path)))
        cycle.expect_continue = self._expect_continue
        self.parsing = cycle
        if self.cycle is None:
            self._run(cycle)
        else:  # pipelined: answered after the one before it; read no more meanwhile
            self.queued.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing.feed(body)

    def on_message_complete(self) -> None:
        if self.parsing is not None:
            self.parsing.end_of_body()
            self.parsing = None

    # --- running requests -------------------------------------------------------------------------
    def _run(self, cycle: Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self._call_app(cycle))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _call_app(self, cycle: Cycle) -> None:
        server = self.server
        handler = cycle.handler
        try:
            await server.drain.run(cycle, handler(cycle) if handler is not None
                                   else server.app(cycle.scope, cycle.receive, cycle.send))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.error("exception in the app", exc_info=exc)
            self._app_failed(cycle)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not cycle.complete:  # returned without finishing its answer
            self._app_failed(cycle)

    def _app_failed(self, cycle: Cycle) -> None:
        if cycle.disconnected or cycle.complete:
            return
        if not cycle.started:
            cycle.keep_alive = False
            cycle.started = True
            self.write(_plain(500, b"Internal Server Error"))
            cycle.complete = True
        if self.transport is not None:
            self.transport.close()

    def response_done(self, cycle: Cycle) -> None:
        """The response of `cycle` is out: close, or go on with the next request."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not cycle.keep_alive:
            transport.close()
            return
        # A body still arriving for an answered request is read and dropped (Cycle.feed), and
        # the connection stays: the client then reads its answer instead of a reset.
        self.cycle = None
        if self.queued:
            self._run(self.queued.popleft())
            if not self.queued:
                self.resume_reading()
            return
        self.resume_reading()
        self._arm_idle_timer()

    def _refuse(self, status: int, text: bytes) -> None:
        if self.cycle is None or self.cycle.complete:
            self.write(_plain(status, text))
        if self.transport is not None:
            self.transport.close()

    # --- I/O ------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def writable(self) -> None:
        if not self.write_paused or self.transport is None or self.transport.is_closing():
            return
        if self._writable is None:
            self._writable = self.loop.create_future()
        await self._writable

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and self.cycle is not None \
                and self.queued:
            return  # a pipelined request waits: stay paused
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _arm_idle_timer(self) -> None:
        self.idle_since = self.loop.time()

    def _cancel_idle_timer(self) -> None:
        self.idle_since = None

    def close_if_idle_since(self, before: float) -> None:
        """Close if idle since `before` or earlier: the keep-alive sweep, or a drain that keeps
        no idle connection."""
        since = self.idle_since
        if since is None or since > before:
            return
        self.idle_since = None
        idle = self.parsing is None or self.parsing.complete
        if self.cycle is None and idle and self.transport is not None:
            self.transport.close()

    # --- drain ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """The drain began: an idle connection keeps its keep-alive timer (a request may be on
        its way); a request not answered yet gets `Connection: close`; a stream under way keeps
        going and the next request (if any) gets `Connection: close`."""
        cycle = self.cycle
        if cycle is not None and not cycle.started:
            cycle.keep_alive = False
        for queued in self.queued:
            queued.keep_alive = False

    def end_at_deadline(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.complete:
            if self.transport is not None:
                self.transport.close()
        else:
            cycle.keep_alive = False

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Http1Server:
    """Serves its `routes` and, for every other request, an ASGI app on given sockets until
    SIGTERM/SIGINT, then drains (see module doc).

    Also runs the app's lifespan (startup before listening, shutdown after the drain)."""

    def __init__(self, app: ASGIApp, drain: Draining, keepalive_timeout_s: float, *,
                 routes: dict[tuple[str, bytes], Handler] | None = None,
                 handle_signals: bool = True) -> None:
        self.app = app
        # (method, path) -> a handler given the Cycle itself: the hot routes, without ASGI.
        self.routes = routes or {}
        self._signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        self.drain = drain
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self._exit_asked = False
        self._forced = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._exit: asyncio.Event | None = None

    # --- what systemd's reporter reads (cacheroute_proxy/serving.py) ---------------------------
    def requests_in_flight(self) -> int:
        return len(self.tasks)

    def open_connections(self) -> int:
        return len(self.connections)

    def exit_requested(self) -> bool:
        return self._exit_asked

    def has_started(self) -> bool:
        return self.started

    def request_exit(self) -> None:
        """SIGTERM/SIGINT: drain; a second one: stop waiting for what is in flight (as uvicorn)."""
        if self._exit_asked:
            self._forced = True
        self._exit_asked = True
        if self._exit is not None:
            self._exit.set()

    # --- running ---------------------------------------------------------------------------------
    async def serve(self, sockets: list[socket.socket]) -> None:
        self.loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        if self._exit_asked:
            self._exit.set()
        # Before the app starts: a SIGTERM during its startup is a clean exit, not a kill that
        # leaves what the role holds (a worker's row and leases) behind.
        for signum in self._signals:
            self.loop.add_signal_handler(signum, self.request_exit)
        servers: list[asyncio.AbstractServer] = []
        sweep: asyncio.Task[None] | None = None
        lifespan = _Lifespan(self.app)
        try:
            if not await lifespan.startup():
                return
            if self._exit_asked:
                return
            for sock in sockets:
                servers.append(await self.loop.create_server(lambda: Connection(self), sock=sock,
                                                             backlog=2048))
            self.started = True
            sweep = self.loop.create_task(self._close_idle_connections())
            await self._exit.wait()
            for server in servers:
                server.close()
            await self._drain()
        finally:
            if sweep is not None:
                sweep.cancel()
            for server in servers:
                server.close()
            await lifespan.shutdown()
            for signum in self._signals:  # ignored from now on: the caller's cleanup must run
                self.loop.add_signal_handler(signum, _ignore)

    async def _close_idle_connections(self) -> None:
        """The keep-alive timeout of every connection, by one sweep a fraction of it apart
        instead of a timer per connection re-armed on every request."""
        timeout = self.keepalive_timeout_s
        every = min(1.0, timeout / 4)
        while True:
            await asyncio.sleep(every)
            before = self.loop.time() - timeout
            for conn in list(self.connections):
                conn.close_if_idle_since(before)

    async def _drain(self) -> None:
        drain = self.drain
        drain.begin(len(self.connections))
        now = self.loop.time()
        for conn in list(self.connections):
            conn.shutdown()
            if not drain.keeps_idle_connections:
                conn.close_if_idle_since(now)
        deadline = self.loop.call_later(drain.timeout_s, self._at_deadline)
        try:
            end = self.loop.time() + drain.timeout_s + CUT_FLUSH_S
            while (self.connections or self.tasks) and self.loop.time() < end and not self._forced:
                await asyncio.sleep(0.05)
            for conn in list(self.connections):  # the backstop: nothing waits past it
                conn.abort()
            for task in list(self.tasks):
                task.cancel()
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=1.0)
        finally:
            deadline.cancel()
            drain.report()

    def _at_deadline(self) -> None:
        self.drain.cut_remaining()
        for conn in list(self.connections):
            conn.end_at_deadline()


def _ignore() -> None:
    pass


class _Lifespan:
    """The ASGI lifespan protocol, just enough for Starlette's lifespan context."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._failed = False
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        if self._failed:
            log.error("the app failed to start")
        return not self._failed

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=10.0)

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self._app(scope, self._inbox.get, self._send)
        except BaseException as exc:
            if not self._started.is_set():
                log.error("lifespan startup failed", exc_info=exc)
                self._failed = True
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.failed":
            self._failed = True
            log.error("lifespan startup failed: %s", message.get("message", ""))
        if kind.startswith("lifespan.startup"):
            self._started.set()
        elif kind.startswith("lifespan.shutdown"):
            self._stopped.set()
