"""A minimal keep-alive HTTP/1.1 client for the forward to an instance: one asyncio Protocol per
connection, responses parsed by httptools (the parser uvicorn uses), a LIFO pool per address.

Why not aiohttp here: on this path it cost several times the CPU per request of this client, which
writes a cached request line and headers with the body in one call and parses the answer in C. The
sidecar's Scheduler link uses it too, for the one thing aiohttp cannot tell it: whether a failed
request had any byte of its answer back (`Http1Pool.send`, the keep-alive race). aiohttp stays for
everything else (the KDN, the instances' control plane). What this client does not do, because
neither needs it: redirects, cookies, proxies, compression (no Accept-Encoding is sent, so the
instance answers uncompressed and the bytes can be relayed as they are); TLS only for a whole pool
(the Scheduler over https).
"""

from __future__ import annotations

import asyncio
from ssl import SSLContext
from typing import Callable

import httptools

from .chunk_pass import ChunkPasser

# Idle connections are closed after 4 s, before the 5 s keep-alive of uvicorn (so of vLLM, and
# of a Scheduler served by it) closes them under a request being sent.
KEEPALIVE_S = 4.0
# The upstream's buffered body that pauses reading until the client takes some of it.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class ConnectFailed(Exception):
    """No connection to the peer: refused, unreachable, a name that does not resolve, or not
    within the connect bound. Nothing was sent."""


class ConnectionClosed(ConnectionError):
    """The server (an instance, the Scheduler) closed the connection, or sent something
    unparsable, mid-exchange."""


class HeadTimeout(Exception):
    """No status line and headers within the first-byte bound."""


class IdleTimeout(Exception):
    """The body went silent for longer than the idle bound while it was being read."""


class UpstreamResponse:
    """Status and head of one answer, and its body as it arrives (`readany`, `read_nowait`), or
    handed on as it arrives (`relay`)."""

    __slots__ = ("status", "content_type", "headers", "keep_alive", "_conn", "_head", "_chunks", "_size",
                 "_eof", "_error", "_waiter", "_paused", "_idle_s", "_idle_timer",
                 "_waiting_since", "_sink", "_passer")

    def __init__(self, conn: Http1Connection, head: asyncio.Future[None]) -> None:
        self.status = 0
        self.content_type: str | None = None
        self.headers: list[tuple[bytes, bytes]] = []  # every header, names lower-case, in order
        self.keep_alive = False
        self._conn = conn
        self._head = head
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._idle_s = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0
        self._sink: Callable[[bytes], bool] | None = None  # set while `relay` runs
        self._passer: ChunkPasser | None = None  # each read goes through it first (`relay`)

    # --- the consumer ----------------------------------------------------------------------
    def started(self) -> asyncio.Future[None]:
        """What to await for the status line and headers (the future itself: no coroutine
        between the request's task and the head)."""
        return self._head

    def time_out(self) -> None:
        """The first-byte timer: fail the wait for the head (a no-op once it arrived)."""
        if not self._head.done():
            self._head.set_exception(HeadTimeout())

    async def readany(self) -> bytes:
        """What has arrived (waiting for something if nothing has); b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            loop = self._conn.loop
            self._waiter = loop.create_future()
            self._waiting_since = loop.time()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    async def relay(self, sink: Callable[[bytes], bool], passer: ChunkPasser | None = None) -> bool:
        """Hand the body to `sink` as it arrives, from the connection's own callback: no task
        wakes up for a piece of it, and what one read of the socket brought goes in one call.

        `sink` returns True when its consumer is full: the connection stops reading and `relay`
        returns False; call it again once the consumer takes more. True at the end of the body;
        the body's error (IdleTimeout, the connection's) or the sink's otherwise.

        `passer` (chunk_pass.py), the consumer's, takes over from the first relay of a chunked
        body whose head came whole in one read (so it can follow every byte of the body): a
        read it passes to the client as it came does not reach `sink`."""
        while self._chunks:  # what arrived while nothing was handed on
            if sink(self._take()):
                self._stop_reading()
                return self.at_eof()
        if self._paused and self._size <= LOW_WATER:
            self._paused = False
            self._conn.resume_reading()
        if self._error is not None:
            raise self._error
        if self._eof:
            return True
        loop = self._conn.loop
        if passer is not None and self._passer is None:
            body = self._conn.body_read
            if body is not None:  # every byte of the body so far is known: the passer follows them
                if body:
                    passer(body)  # not relaying yet: it only follows the framing
                self._passer = passer
        self._sink = sink
        if self._passer is not None:
            self._passer.relaying = True
        self._waiter = loop.create_future()
        self._waiting_since = loop.time()
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._stop_relay()
        if self._error is not None:
            raise self._error
        return self.at_eof()

    def limit_idle(self, idle_s: float) -> None:
        """From now on, a `readany` that waits more than `idle_s` for data raises IdleTimeout.

        One lazy timer for the whole body: a wait records when it started and the timer, when
        it fires, fails the read only if that wait is really that old, else it re-arms -- no
        timer is created or cancelled per chunk. Time the consumer spends holding a chunk does
        not count."""
        if self._idle_timer is None and not self._eof:
            self._idle_s = idle_s
            self._idle_timer = self._conn.loop.call_later(idle_s, self._check_idle)

    def _check_idle(self) -> None:
        loop = self._conn.loop
        due = self._waiting_since + self._idle_s
        if self._waiter is not None and loop.time() >= due:
            self._idle_timer = None
            self._fail(IdleTimeout())
            return
        later = due if self._waiter is not None else loop.time() + self._idle_s
        self._idle_timer = loop.call_at(later, self._check_idle)

    def _stop_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def read_nowait(self) -> bytes:
        if self._chunks:
            return self._take()
        if self._error is not None:
            raise self._error
        return b""

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def release(self) -> None:
        """The body was read: the connection goes back to the pool if it can be reused."""
        self._stop_idle()
        if self._eof and not self._chunks and self.keep_alive:
            self._conn.finished()
        else:
            self._conn.close()

    def close(self) -> None:
        """Drop the connection, so the instance sees a disconnect and stops working on it."""
        self._stop_idle()
        self._conn.close()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size -= len(data)
        if self._paused and self._size <= LOW_WATER:
            self._paused = False
            self._conn.resume_reading()
        return data

    # --- the protocol ----------------------------------------------------------------------
    def _feed(self, parts: list[bytes]) -> None:
        """Take the body pieces one read brought (emptying `parts`, the connection's list)."""
        self._chunks += parts
        self._size += sum(map(len, parts))
        parts.clear()
        if self._sink is not None:
            return  # handed on once the read is parsed (_hand_over), with the rest it brought
        if self._size > HIGH_WATER:
            self._stop_reading()
        self._wake()

    def _hand_over(self) -> None:
        """What the last read brought, to the relay's sink in one call."""
        if self._sink is not None and self._chunks:
            self._hand_on(self._take())

    def _hand_on(self, data: bytes) -> None:
        """`data` to the relay's sink; a full consumer stops the reading until `relay` is called
        again, a failing one ends the relay with its error. (A relayed stream's read comes here
        straight from `data_received`: a call a token, often on a cold cache.)"""
        self._waiting_since = self._conn.loop.time()  # the idle bound counts from the last piece
        try:
            full = self._sink(data)  # type: ignore[misc]
        except Exception as exc:
            self._sink_failed(exc)
            return
        if full:
            self._consumer_full()

    def _consumer_full(self) -> None:
        self._stop_relay()
        self._stop_reading()
        self._wake()

    def _sink_failed(self, error: Exception) -> None:
        self._stop_relay()
        self._error = error
        self._wake()

    def _stop_relay(self) -> None:
        self._sink = None
        if self._passer is not None:
            self._passer.relaying = False

    def _stop_reading(self) -> None:
        if not self._paused:
            self._paused = True
            self._conn.pause_reading()

    def _end(self) -> None:
        self._hand_over()
        self._eof = True
        self._stop_idle()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._eof or self._error is not None:  # the first cause is the one worth reporting
            return
        self._stop_idle()
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Http1Connection(asyncio.Protocol):
    """One connection to an instance; at most one request at a time (no pipelining)."""

    def __init__(self, pool: Http1Pool, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # when the last answer ended (the instance's keep-alive clock)
        self.reused = False  # has it carried an answer before the current request?
        self.received_any = False  # has the current request had any byte back?
        # The body's pieces (one a chunk of a chunked answer) go into this list by the parser's
        # C call of its append, not by a Python callback each: a stream of tokens is one chunk a
        # token. data_received hands the list to the response once the whole read is parsed.
        self._body: list[bytes] = []
        self.on_body = self._body.append  # the parser takes its callbacks once, at its creation
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._content_type: bytes | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._framed = False  # Content-Length or chunked: else the body ends when the connection does
        self._chunked = False
        self._until_close = False
        self._in_head = False  # the parser is inside a head
        self._head_split = False  # the head being parsed began in an earlier read
        self._head_now = False  # the head completed in the read being parsed
        # A chunked body's bytes so far, when all of them came in the read that brought its
        # whole head (b"" when the head ended the read); else None (`relay`).
        self.body_read: bytes | None = None
        # The first-byte bound: one lazy timer per connection, not one per request (see request).
        self._head_due = 0.0
        self._head_timer: asyncio.TimerHandle | None = None

    # --- used by the pool and the response -------------------------------------------------
    def request(self, data: bytes, head_due: float) -> UpstreamResponse:
        """Send `data`; the response fails with HeadTimeout if its head has not arrived by
        `head_due` (loop time).

        The timer is armed only when none is: when it fires it fails the request that waits
        for its head too long, re-arms for the one that waits less, and otherwise lapses until
        the next request. So a connection that carries thousands of requests within the bound
        creates one timer, not one (and its cancel) per request."""
        response = UpstreamResponse(self, self.loop.create_future())
        self._response = response
        self._content_type = None
        self._headers = []
        self._framed = self._chunked = self._until_close = self.received_any = False
        self._in_head = self._head_split = self._head_now = False
        self.body_read = None
        self._body.clear()  # what a failed answer left
        self._head_due = head_due
        timer = self._head_timer
        if timer is None or timer.when() > head_due:
            self._arm_head_timer()
        assert self.transport is not None
        self.transport.write(data)
        return response

    def _arm_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_at(self._head_due, self._check_head)

    def _check_head(self) -> None:
        self._head_timer = None
        response = self._response
        if response is None or response._head.done():
            return  # no head awaited: the next request arms the timer again
        if self.loop.time() >= self._head_due:
            response.time_out()
        else:
            self._arm_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def finished(self) -> None:
        self._response = None
        self.reused = True
        self.pool.put(self)

    def close(self) -> None:
        self._stop_head_timer()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if self._response is not None:
            self._response._fail(ConnectionClosed("connection closed by the proxy"))

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self._response is None:  # nothing asked: an instance talking out of turn
            self.close()
            return
        response = self._response
        passer = response._passer
        if passer is not None:  # a relayed chunked body: whole chunks go past the parser
            try:
                passed = passer(data)
            except Exception as exc:
                response._sink_failed(exc)
                return
            if passed:
                response._waiting_since = self.loop.time()
                if passed == 2:
                    response._consumer_full()
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(ConnectionClosed(f"unparsable answer: {exc}"))
            self.close()
            return
        if self._head_now:
            self._note_body_start(data, response)
        elif self.body_read is not None:
            self.body_read = None
        elif self._in_head:
            self._head_split = True
        body = self._body
        if body:
            if response._sink is not None and not response._chunks:  # a relayed stream's read
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                response._hand_on(data)
                return
            response._feed(body)
        response._hand_over()

    def eof_received(self) -> bool:
        if self._response is None:  # idle: never hand it out again (connection_lost comes later)
            self.closed = True
            self.pool.discard(self)
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_head_timer()
        response = self._response
        if response is None:  # idle in the pool: the instance's keep-alive ran out, or it went
            self.pool.discard(self)
        elif self._until_close and exc is None:
            response._end()  # an HTTP/1.0-style body, delimited by the close: complete
        elif not response._eof:
            response._fail(ConnectionClosed(
                f"the server closed the connection{f': {exc}' if exc else ''}"))

    def _note_body_start(self, data: bytes, response: UpstreamResponse) -> None:
        """The read that completed the head: what of a chunked body it brought, if the whole
        head came in it too (then the head ends at the read's first empty line)."""
        whole_head = not self._head_split
        self._head_now, self._head_split = False, self._in_head  # another began (after a 1xx)
        if self._chunked and whole_head and not self._in_head and not response._eof \
                and response.status >= 200:
            self.body_read = data[data.find(b"\r\n\r\n") + 4:]
        else:
            self.body_read = None

    # --- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        self._headers.append((lowered, value))
        if lowered == b"content-type":
            self._content_type = value
        elif lowered == b"content-length":
            self._framed = True
        elif lowered == b"transfer-encoding":  # framed only if chunked is the last coding
            self._framed = self._chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None
        response.status = self._parser.get_status_code()
        response.keep_alive = self._parser.should_keep_alive()
        response.headers = self._headers
        status = response.status
        self._until_close = not self._framed and status >= 200 and status not in (204, 304)
        self._in_head, self._head_now = False, True
        if self._content_type is not None:
            response.content_type = self._content_type.decode("latin-1")
        if not response._head.done():
            response._head.set_result(None)

    def on_message_complete(self) -> None:
        response = self._response
        assert response is not None
        self.idle_since = self.loop.time()
        if self._body:
            response._feed(self._body)
        response._end()


class Http1Pool:
    """Idle keep-alive connections per (host, port), most recently used first; connections past
    `keepalive_s` of idleness are closed instead of reused (before the peer's own keep-alive
    timeout closes them under a request being sent). `ssl`: every connection of this pool is TLS
    (the Scheduler link over https; the forward never is)."""

    def __init__(self, size: int, keepalive_s: float, ssl: SSLContext | None = None) -> None:
        self._size = size
        self._keepalive_s = keepalive_s
        self._ssl = ssl
        self._idle: dict[tuple[str, int], list[Http1Connection]] = {}
        self.resent = 0  # requests sent again after the keep-alive race (`send`)

    async def send(self, host: str, port: int, request: bytes, head_timeout_s: float,
                   connect_timeout_s: float, sent: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send `request` (complete bytes) on an idle connection, else a new one, and return
        the response once its head has arrived (within `head_timeout_s` of its first sending).

        The keep-alive race: the peer may close an idle connection just as a request goes out
        on it. A reused connection closed or reset before any byte of the answer was closed
        unread, so the request goes once more, on a new connection. A request whose answer had
        started, or that fails on a new connection, is never sent again.
        `sent`, if given, is called once, when the request is first written: work that need
        not delay it is done while the peer answers.
        Raises ConnectFailed, HeadTimeout, or OSError (closed or reset before the head)."""
        conn = await self.acquire(host, port, connect_timeout_s)
        head_due = conn.loop.time() + head_timeout_s
        while True:
            response = conn.request(request, head_due)
            try:
                if sent is not None:
                    sent, then = None, sent
                    then()
                await response.started()
                return response
            except OSError:
                conn.close()
                if conn.reused and not conn.received_any:
                    self.resent += 1
                    conn = await self.acquire(host, port, connect_timeout_s, fresh=True)
                    continue
                raise
            except BaseException:  # HeadTimeout, or cancelled (the caller left): the connection goes
                conn.close()
                raise

    async def acquire(self, host: str, port: int, connect_timeout_s: float,
                      fresh: bool = False) -> Http1Connection:
        """An idle connection (unless `fresh`), else a new one; ConnectFailed if there is none."""
        key = (host, port)
        idle = None if fresh else self._idle.get(key)
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if not conn.closed and conn.loop.time() - conn.idle_since <= self._keepalive_s \
                    and transport is not None and not transport.is_closing():
                return conn
            conn.close()
        # Only for a new connection: on CPython 3.11 every get_running_loop() is a getpid()
        # syscall, which a request on a kept-alive connection does without.
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Http1Connection(self, key, loop),
                                                       host.strip("[]"), port, ssl=self._ssl)
        except TimeoutError:
            raise ConnectFailed(f"no connection within {connect_timeout_s:g}s") from None
        except (OSError, ValueError) as exc:  # ValueError: a host idna rejects
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        return conn

    def put(self, conn: Http1Connection) -> None:
        if conn.closed:
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self._size:
            conn.close()
            return
        idle.append(conn)

    def discard(self, conn: Http1Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def request_line(path: str, host: str, port: int) -> bytes:
    """The request line of a POST and its Host header."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode("latin-1")


def header_lines(headers: dict[str, str]) -> bytes:
    """`name: value\r\n` for each header, in order."""
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")
