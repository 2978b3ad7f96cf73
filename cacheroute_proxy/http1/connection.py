"""One client connection (`Connection`, an asyncio Protocol): parses requests with httptools,
answers them one at a time and in order, keeps the idle timer, and holds every head to its
limits (limits.HeadLimits: 414, 431, and 408 from the server's sweep).

Reading stops only to bound memory, never for longer: while a body past the high-water mark
waits for its handler to take it, or while more than that much of a pipelined request waits
its turn. Otherwise the socket is read while a request is answered, so a client that leaves
is seen whatever the size of its body (asyncio reports no EOF on a transport that does not
read)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import httptools

from .cycle import BODY_HIGH_WATER, Cycle, Handler
from .draining import Draining
from .lifespan import ASGIApp
from .limits import HeadLimits
from .wire import Header, plain_answer

log = logging.getLogger("cacheroute.http")


class ServerSide(Protocol):
    """What a Connection needs of the server that accepted it (server.Http1Server)."""

    app: ASGIApp
    routes: dict[tuple[str, bytes], Handler]
    drain: Draining
    limits: HeadLimits
    loop: asyncio.AbstractEventLoop
    connections: set[Connection]
    tasks: set[asyncio.Task[None]]


BAD_REQUEST = (400, b"Invalid HTTP request received.")
URI_TOO_LONG = (414, b"URI Too Long")
HEAD_TOO_LARGE = (431, b"Request Header Fields Too Large")
HEAD_TIMEOUT = (408, b"Request Timeout")
# What a header line holds besides its name and value: ": " and CRLF, as usually written.
_HEADER_LINE_EXTRA = 4


class _Refused(Exception):
    """Raised in a parser callback to stop parsing: the head broke a limit (Connection._refusal
    says how to answer)."""


class _Head:
    """The request head being received: when its first byte came, and what it holds so far
    (each a lower bound of its size: the URL and header lines parsed, and the reads that fell
    wholly inside it, which count a header line still arriving)."""

    __slots__ = ("began", "parsed", "read")

    def __init__(self, began: float) -> None:
        self.began = began
        self.parsed = 0
        self.read = 0


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one at a time, keeps the idle timer."""

    def __init__(self, server: ServerSide) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.cycle: Cycle | None = None  # the request being answered
        self.queued: deque[Cycle] = deque()  # pipelined requests waiting their turn
        self.parsing: Cycle | None = None  # the request whose head or body is arriving
        # What arrived after a pipelined request that waits its turn, parsed once it runs.
        self._held = bytearray()
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self.reading_paused = False
        self.idle_since: float | None = None  # loop time the connection became idle
        self._head: _Head | None = None  # the head being received, until it is complete
        self._refusal: tuple[int, bytes] | None = None  # why a callback stopped the parser
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
        if self.queued:  # a pipelined request waits: parse no further until it runs
            self._held += data
            if len(self._held) >= BODY_HIGH_WATER:
                self.pause_reading()
            return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        head = self._head  # still arriving after this read too: all of the read was head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # as uvicorn without WebSockets: served as plain HTTP
            log.warning("Unsupported upgrade request.")
        except httptools.HttpParserError:
            refusal, self._refusal = self._refusal, None
            self._refuse(*(refusal or BAD_REQUEST))
            return
        if head is not None and head is self._head:
            head.read += len(data)
            if head.read > self.limits.head_bytes:
                self._refuse(*HEAD_TOO_LARGE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._cancel_idle_timer()
        for cycle in (self.cycle, self.parsing, *self.queued):
            if cycle is not None:
                cycle.lost()
        self.queued.clear()
        self._held.clear()
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
        self._head = _Head(self.loop.time())

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.url_bytes:
            self._stop_parsing(URI_TOO_LONG)

    def on_header(self, name: bytes, value: bytes) -> None:
        head, limits = self._head, self.limits
        assert head is not None  # on_message_begin came first
        head.parsed += len(name) + len(value) + _HEADER_LINE_EXTRA
        if len(self._headers) >= limits.headers or head.parsed + len(self._url) > limits.head_bytes:
            self._stop_parsing(HEAD_TOO_LARGE)
        name = name.lower()
        self._headers.append((name, value))
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def _stop_parsing(self, refusal: tuple[int, bytes]) -> None:
        self._refusal = refusal
        raise _Refused

    def on_headers_complete(self) -> None:
        self._head = None
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
        else:  # pipelined: answered after the one before it (what follows is held meanwhile)
            self.queued.append(cycle)

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing.feed(body)

    def on_message_complete(self) -> None:
        if self.parsing is not None:
            self.parsing.end_of_body()
            self.parsing = None
        # Reading may have paused at the body's high-water mark: read on, to see the client
        # leave (or its next request) while this one is answered.
        self.resume_reading()

    # --- running requests -------------------------------------------------------------------------
    def _run(self, cycle: Cycle) -> None:
        self.cycle = cycle
        task = cycle.task = self.loop.create_task(self._call_app(cycle))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _call_app(self, cycle: Cycle) -> None:
        server = self.server
        handler = cycle.handler
        drain = server.drain
        drain.enter(cycle)
        cut = False
        try:
            await (handler(cycle) if handler is not None
                   else server.app(cycle.scope, cycle.receive, cycle.send))
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                if drain.cut_off(cycle):  # the drain's deadline: answered and ended there
                    cut = True
                    return
            elif cycle.disconnected:  # the client left (or its body did not parse): that is all
                log.debug("the app gave up on a request whose client left: %r", exc)
            else:
                log.error("exception in the app", exc_info=exc)
            self._app_failed(cycle)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            drain.leave(cycle, cut)
        if not cycle.complete:  # returned without finishing its answer
            self._app_failed(cycle)

    def _app_failed(self, cycle: Cycle) -> None:
        if cycle.disconnected or cycle.complete:
            return
        if not cycle.started:
            cycle.keep_alive = False
            cycle.started = True
            self.write(plain_answer(500, b"Internal Server Error"))
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
                self._parse_held()
            return
        self.resume_reading()
        self._arm_idle_timer()

    def _parse_held(self) -> None:
        """The last pipelined request runs: what arrived behind it is parsed now, in order."""
        held = bytes(self._held)
        self._held.clear()
        self.resume_reading()
        if held:
            self._parse(held)

    def _refuse(self, status: int, text: bytes) -> None:
        """Answer `status` and close: for a head, unless an earlier request's answer is due
        first; for a body, if its own request has not begun its answer (its handler is told:
        Cycle.refuse). Otherwise (a pipelined request, or the rest of a body already answered,
        a 413) the connection is only closed."""
        cycle, parsing = self.cycle, self.parsing
        if parsing is None:
            answer = cycle is None or cycle.complete
        else:
            answer = parsing is cycle and not parsing.started
            if answer:
                parsing.refuse()
        if answer:
            self.write(plain_answer(status, text))
        self._head = None  # refused: no more sweeps for it
        if self.transport is not None:
            self.transport.close()

    def refuse_if_head_began_before(self, before: float) -> None:
        """408 and close if the head still arriving began at `before` or earlier (the server's
        sweep); a head behind a request being answered waits for that answer first."""
        head = self._head
        if head is not None and head.began <= before and self.cycle is None:
            self._refuse(*HEAD_TIMEOUT)

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
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if len(self._held) >= BODY_HIGH_WATER:
            return  # held bytes of a pipelined request wait for its turn: stay paused
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
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
