"""One request and its response (`Cycle`): what a route handler reads and writes, and the ASGI
scope/receive/send of the app behind the routes."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Protocol

from .chunk_pass import ChunkPass, ChunkPasser
from .wire import CONTINUE, DATE, NO_BODY_STATUSES, UNSAFE_VALUE, Header, check_header, status_line

Handler = Callable[["Cycle"], Coroutine[Any, Any, None]]

_DISCONNECT = {"type": "http.disconnect"}
# Request body buffered before reading pauses until the app takes it (as uvicorn: 64 KiB).
BODY_HIGH_WATER = 64 * 1024


class ConnectionSide(Protocol):
    """What a Cycle needs of the connection it arrived on (connection.Connection)."""

    client: tuple[str, int] | None
    local: tuple[str, int] | None
    write_paused: bool

    def write(self, data: bytes) -> None: ...

    async def writable(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def response_done(self, cycle: Cycle) -> None: ...


class BodyTooLarge(Exception):
    """The request body passed the limit `read_body` was given."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BadBody(ClientGone):
    """The request body did not parse (a malformed chunk): the server answered 400 itself and
    closes the connection; there is nothing to answer."""


class Cycle:
    """One request and its response: what a route handler reads and writes (`read_body`,
    `start`/`write`/`end`, `send_whole`, `on_disconnect`), and what ASGI calls `scope`,
    `receive` and `send` for the app behind the routes."""

    __slots__ = ("conn", "method", "raw_path", "query_string", "headers", "http_version",
                 "keep_alive", "body", "body_size", "more_body", "disconnected", "malformed",
                 "started", "complete", "chunked", "head_only", "on_disconnect", "expect_continue",
                 "handler", "task", "_body_event", "_scope")

    def __init__(self, conn: ConnectionSide, method: str, raw_path: bytes, query_string: bytes,
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
        self.malformed = False  # the body did not parse (refuse)
        self.started = False
        self.complete = False
        self.chunked = False
        self.head_only = method == "HEAD"
        self.on_disconnect: Callable[[], None] | None = None
        # The task that answers it (Connection._run): asyncio.current_task() would cost a
        # getpid() syscall on CPython 3.11, twice a request.
        self.task: asyncio.Task[None] | None = None
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

    def refuse(self) -> None:
        """The body did not parse: the server answers 400 and closes; for the handler, the
        client is gone (read_body raises BadBody, receive says http.disconnect)."""
        self.malformed = True
        self.lost()

    def _wake(self) -> None:
        if self._body_event is not None:
            self._body_event.set()

    async def _more(self) -> None:
        """Wait for more of the body (or its end, or the client leaving)."""
        if self.expect_continue:
            self.expect_continue = False
            if not self.started:
                self.conn.write(CONTINUE)
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

    def whole_body(self, limit: int) -> bytes | None:
        """The body, taken as `read_body` would, when all of it is here within `limit` and the
        client is still there (usually: it came with the head); else None, with nothing taken,
        and `read_body` says what there is. A plain call: no coroutine for the usual case."""
        if self.more_body or self.disconnected or self.body_size > limit:
            return None
        return self._take_body()

    async def read_body(self, limit: int) -> bytes:
        """The whole body; BodyTooLarge as soon as what arrived passes `limit` bytes (the rest
        is then dropped as it comes), ClientGone if the client leaves first (BadBody if the body
        did not parse)."""
        while self.more_body and not self.disconnected:
            if self.body_size > limit:
                break
            await self._more()
        if self.disconnected:
            raise BadBody if self.malformed else ClientGone
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

    def body_writer(self) -> Callable[[bytes], bool]:
        """`write` for a started body that streams: the same framing and answer, straight to the
        connection's transport in one call (`write` checks at each part what cannot change
        while the body streams, and goes through the connection). A stream is a part a token,
        each written on a cold cache when tokens come milliseconds apart: a frame saved is
        saved a token. `write` itself when there is no transport to write to."""
        transport = self._streaming_transport()
        if transport is None:
            return self.write
        conn, chunked = self.conn, self.chunked

        def write_part(body: bytes) -> bool:
            if body and not transport.is_closing():
                transport.write(b"%x\r\n%b\r\n" % (len(body), body) if chunked else body)
            return conn.write_paused
        return write_part

    def chunk_passer(self, marker: bytes, look_back: int) -> ChunkPasser | None:
        """For a chunked body relayed into this one (UpstreamResponse.relay): a ChunkPass that
        writes a read of whole chunks straight to this connection, as the instance framed them,
        when their data would go on unchanged (it ends a line with no `marker` in its last
        `look_back` bytes; http1/_chunk_pass.c). None without the C build, or unless this body
        is chunked and streams."""
        transport = self._streaming_transport()
        if ChunkPass is None or transport is None or not self.chunked:
            return None
        return ChunkPass(transport, self.conn, marker, look_back)  # type: ignore[no-any-return]

    def _streaming_transport(self) -> Any:
        """The transport a started body that streams may be written to directly, or None."""
        if not self.started or self.complete or self.head_only or self.disconnected:
            return None
        return getattr(self.conn, "transport", None)

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
        parts = [status_line(status), DATE.current(), b"server: cacheroute-proxy\r\n"]
        length_known = False
        for name, value in headers:
            check_header(name, value)
            if name == b"content-length":
                length_known = True
            elif name == b"transfer-encoding":
                length_known = True  # the app frames its own body
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
        if not length_known and not self.head_only and status not in NO_BODY_STATUSES:
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
        parts = [status_line(status), DATE.current(), b"server: cacheroute-proxy\r\n"]
        for name, value in headers:
            if UNSAFE_VALUE.search(value):
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
