"""The one module that knows uvicorn beyond `uvicorn.Config` and `uvicorn.Server(...).serve()`.

Everything here reads or sets attributes uvicorn does not document, which is why pyproject.toml
pins uvicorn to 0.54.x and tests/test_uvicorn_seam.py runs each piece against a real uvicorn
server on 127.0.0.1: if the pinned internals move, those tests fail, instead of the worker
silently taking a slow path or answering wrongly. tests/test_layout.py checks that no other
module reaches for them. Three layers:

- a request (the worker's hot path, `RequestResponseCycle` of the httptools protocol, whose
  bound `send` an app is given, so `send.__self__` is the cycle): `send_whole` writes a complete
  response in one `transport.write` instead of two (two loopback segments, two wake-ups of the
  client, a regex per header: about a tenth of a worker's CPU per JSON answer);
  `watch_disconnect` has the protocol call back when the client leaves, instead of a task per
  request blocked in `receive()`; `response_progress` says whether a response has started or
  ended without wrapping `send`. For anything that is not that cycle (another server, a test
  transport) these answer "not here" and the caller does it the plain ASGI way.
- a connection (the worker's graceful drain, policy in proxy_workers/drain.py):
  `draining_protocol` never closes a connection under a request that may be on its way;
  `DrainingServer` tells the drain when uvicorn's shutdown begins and cuts what is left at its
  deadline.
- a server (systemd's status line and readiness, the simulators): how many requests and
  connections it has, whether it listens or was asked to exit, running it on its configured
  event loop, and a server whose signals its caller handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Coroutine, Iterator
from typing import Any, Callable, Protocol

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

# --- a request ------------------------------------------------------------------------------
# The attribute a cycle carries while somebody waits for its client to leave.
DISCONNECT_HOOK = "cacheroute_on_disconnect"
# Control characters other than tab: what uvicorn refuses in a header value.
_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0A-\x1F\x7F]")
_CRLF = b"\r\n"
_SEP = b": "


def cycle_of(send: Callable[..., Any]) -> RequestResponseCycle | None:
    cycle = getattr(send, "__self__", None)
    return cycle if isinstance(cycle, RequestResponseCycle) else None


def response_progress(send: Callable[..., Any]) -> tuple[bool, bool]:
    """(started, complete) of the response `send` belongs to. Not uvicorn's cycle: (True,
    False), "under way", the answer that makes a caller wait rather than cut it short."""
    cycle = cycle_of(send)
    if cycle is None:
        return True, False
    return cycle.response_started, cycle.response_complete


def send_whole(send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]],
               body: bytes) -> bool:
    """Write `status`, `headers` (lower-case names, no content-length) and `body` as one
    response in one write. False, with nothing written, when the fast path does not apply
    (not uvicorn's cycle, already started, client gone, writes paused, HEAD, access log on):
    then the caller sends it through `send`."""
    cycle = cycle_of(send)
    if (cycle is None or cycle.response_started or cycle.disconnected or cycle.access_log
            or cycle.flow.write_paused or cycle.scope["method"] == "HEAD"):
        return False
    for _, value in headers:
        if _UNSAFE_VALUE.search(value):
            raise RuntimeError("Invalid HTTP header value.")  # as uvicorn's send would
    parts = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers):
        parts += (name, _SEP, value, _CRLF)
    keep_alive = cycle.keep_alive
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"content-length: %d\r\n\r\n" % len(body), body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.transport.write(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def watch_disconnect(send: Callable[..., Any], callback: Callable[[], None]) -> RequestResponseCycle | None:
    """Have `callback` called once if the client disconnects before the response completes
    (only under `draining_protocol`, which calls it from `connection_lost`). Returns the cycle
    to pass to :func:`unwatch_disconnect`, or None if this is not uvicorn's cycle (nothing
    registered: watch `receive()` instead)."""
    cycle = cycle_of(send)
    if cycle is None:
        return None
    setattr(cycle, DISCONNECT_HOOK, callback)
    return cycle


def unwatch_disconnect(cycle: RequestResponseCycle) -> None:
    setattr(cycle, DISCONNECT_HOOK, None)


def client_gone(cycle: RequestResponseCycle) -> bool:
    return cycle.disconnected


def _notify_disconnect(cycle: RequestResponseCycle | None) -> None:
    """After uvicorn's `connection_lost`: call the callback if the client left before the
    response completed."""
    if cycle is None or not cycle.disconnected:
        return
    callback = getattr(cycle, DISCONNECT_HOOK, None)
    if callback is not None:
        setattr(cycle, DISCONNECT_HOOK, None)
        callback()


# --- a connection ------------------------------------------------------------------------------
class Draining(Protocol):
    """What the protocol asks of the worker's drain (proxy_workers/drain.py)."""

    @property
    def draining(self) -> bool: ...


def draining_protocol(drain: Draining) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, with a shutdown that never closes a connection under a
    request that may be on its way, and that calls `watch_disconnect`'s callbacks.

    uvicorn's own shutdown closes idle keep-alive connections at once, which races with a client
    sending a request on one right now (it gets a reset, not an answer). Here: a request whose
    response head is not out yet is answered with `Connection: close`; a stream under way stays
    keep-alive and the *next* request on that connection gets `Connection: close`; an idle
    connection keeps the normal keep-alive timer. A client whose idle timeout is shorter than
    the server's never sees a connection closed under it."""

    class DrainingHttpTools(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if drain.draining:  # accepted after the listeners closed: shut down like the others
                self.shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            _notify_disconnect(cycle)

        def shutdown(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                # Idle, or a request is arriving right now: keep it. The next request is
                # answered with Connection: close; the keep-alive timer ends it if none comes.
                if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler)
            elif not cycle.response_started:
                cycle.keep_alive = False  # its head will say Connection: close
            # else: a response under way whose head promised keep-alive; after it the
            # connection is idle as above, and the next request on it gets Connection: close.

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            if drain.draining and self.cycle is not None:
                self.cycle.keep_alive = False

        def close_at_deadline(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self.transport.close()
            else:
                cycle.keep_alive = False

    return DrainingHttpTools


class ShutdownHooks(Protocol):
    """What `DrainingServer` tells the drain, and when."""

    timeout_s: float

    def begin(self, connections: int) -> None: ...   # listeners closed, shutdown begins

    def cut_remaining(self) -> None: ...             # the deadline: cancel what still runs

    def report(self) -> None: ...                    # shutdown is over


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown is a drain: `hooks.begin` when the listeners close (with
    `net.ipv4.tcp_migrate_req=1` the kernel hands connections still queued on them to another
    worker of the SO_REUSEPORT group), `hooks.cut_remaining` at `hooks.timeout_s`, then every
    connection of `draining_protocol` is closed once its response is done."""

    def __init__(self, config: uvicorn.Config, hooks: ShutdownHooks) -> None:
        super().__init__(config)
        self._hooks = hooks

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        hooks = self._hooks
        hooks.begin(len(self.server_state.connections))
        deadline = asyncio.get_running_loop().call_later(hooks.timeout_s, self._at_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
            hooks.report()

    def _at_deadline(self) -> None:
        self._hooks.cut_remaining()
        for connection in list(self.server_state.connections):
            closer = getattr(connection, "close_at_deadline", None)
            if closer is not None:
                closer()


# --- a server ----------------------------------------------------------------------------------
def requests_in_flight(server: uvicorn.Server) -> int:
    """Requests the server runs right now (one task per request cycle, streams included)."""
    return len(server.server_state.tasks)


def open_connections(server: uvicorn.Server) -> int:
    return len(server.server_state.connections)


def has_started(server: uvicorn.Server) -> bool:
    """Every listener is open: a client connecting now is served."""
    return server.started


def exit_requested(server: uvicorn.Server) -> bool:
    """Shutdown has been asked for (uvicorn's signal handler sets it, then drains)."""
    return server.should_exit


def request_exit(server: uvicorn.Server, *, force: bool = False) -> None:
    """Begin a graceful shutdown; `force`: stop waiting for what is in flight."""
    server.should_exit = True
    if force:
        server.force_exit = True


def run_with(server: uvicorn.Server, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `main()` to completion on the event loop `server.run()` would use (uvloop when the
    config asks for it), so other tasks can share the server's loop."""
    factory = getattr(server.config, "get_loop_factory", None)
    if factory is None:  # older uvicorn installs an event loop policy instead
        server.config.setup_event_loop()
    with asyncio.Runner(loop_factory=factory() if factory else None) as runner:
        runner.run(main())


class SignalFreeServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to its caller (the simulators): uvicorn's
    own handler would re-raise the signal once serve() returns, so the process would end by
    signal instead of exit status 0, and it would start draining before the caller did what
    must come first (a simulated instance unregisters from the proxy, then asks to drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
