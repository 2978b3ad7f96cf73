"""Graceful drain of one worker on SIGTERM: stop accepting, let what is in flight finish up to
`PROXY_DRAIN_TIMEOUT_S`, then cut what is left cleanly, and say what happened.

Three pieces, one per layer uvicorn lets us change:

- :class:`DrainingServer` (uvicorn.Server) starts the drain when uvicorn begins its shutdown
  (listeners closed: with `net.ipv4.tcp_migrate_req=1` the kernel hands connections still in
  their accept queue to another worker of the `SO_REUSEPORT` group instead of resetting them),
  arms the deadline, and logs what was drained and what was cut.
- The HTTP protocol (:func:`draining_protocol`) decides how each connection ends. uvicorn's own
  shutdown closes idle keep-alive connections at once, which races with a client that is
  sending a request on one right now (it gets a reset, not an answer). Here no connection is
  closed while a request may be on its way: a request whose response head is not out yet is
  answered with `Connection: close`; a stream already under way stays keep-alive and the
  *next* request on that connection gets `Connection: close`; an idle connection keeps the
  normal keep-alive timer (`PROXY_KEEPALIVE_TIMEOUT_S`). A client whose idle timeout is shorter
  than that never sees a connection closed under it.
- :class:`DrainGate` (ASGI) knows every request in flight. At the deadline it cancels them (their
  leases end in the exchange's `finally`) and finishes each response itself: a stream gets a
  `cacheroute_meta` event whose `error` is `worker_drain_deadline` and no `[DONE]`, a request
  not yet answered gets 503 `worker_draining`, so no client hangs on a worker that is leaving.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from starlette.types import ASGIApp, Receive, Scope, Send

from .sse import cut_meta_event
from .uvicorn_cycle import notify_disconnect

log = logging.getLogger("cacheroute.worker")

DRAIN_CUT_ERROR = "worker_drain_deadline"
# uvicorn's own deadline comes this long after ours: cut streams get to send their last event.
CUT_FLUSH_S = 2.0
MIGRATE_REQ_PATH = "/proc/sys/net/ipv4/tcp_migrate_req"

_CUT_BODY = (b'{"error": "worker_draining", "detail": "the worker stopped at its drain deadline '
             b'before answering; retry"}')


def _progress(send: Send) -> tuple[bool, bool]:
    """(started, complete) of a response, read from uvicorn's RequestResponseCycle, whose bound
    `send` the app is given: so nothing wraps `send` on the path of every chunk."""
    cycle = getattr(send, "__self__", None)
    return getattr(cycle, "response_started", True), getattr(cycle, "response_complete", False)


def _under_way(send: Send) -> bool:
    # A JSON answer goes out in one go (head and body back to back), so a response that has
    # started and not ended is, in practice, a stream.
    started, complete = _progress(send)
    return started and not complete


class Drain:
    """What the worker is doing about its exit: draining or not, the requests in flight, counts."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active: dict[asyncio.Task[Any], Send] = {}  # request task -> uvicorn's send
        self.cutting: set[asyncio.Task[Any]] = set()
        self.in_flight_at_start = 0
        self.streams_at_start = 0
        self.finished = 0  # requests that ended normally after the drain began
        self.cut = 0
        self.cut_streams = 0

    def begin(self, connections: int) -> None:
        self.draining = True
        self.in_flight_at_start = len(self.active)
        self.streams_at_start = sum(map(_under_way, self.active.values()))
        log.info("draining: stopped accepting; %d requests in flight (%d streams) on %d connections; "
                 "deadline %.0fs", self.in_flight_at_start, self.streams_at_start, connections,
                 self.timeout_s)

    def cut_remaining(self) -> None:
        """The deadline: cancel every request still running; DrainGate ends each response."""
        for task, send in list(self.active.items()):
            started, complete = _progress(send)
            if complete:
                continue
            self.cutting.add(task)
            self.cut += 1
            self.cut_streams += started
            task.cancel(msg=DRAIN_CUT_ERROR)
        if self.cut:
            log.warning("drain deadline (%.0fs) reached: cutting %d requests (%d streams)",
                        self.timeout_s, self.cut, self.cut_streams)

    def report(self) -> None:
        log.info("drained: %d requests finished during the drain (%d were in flight at SIGTERM, "
                 "%d streams); %d cut at the deadline (%d streams)", self.finished,
                 self.in_flight_at_start, self.streams_at_start, self.cut, self.cut_streams)


async def finish_cut(send: Send) -> None:
    """End a response the deadline cut: a stream gets its error event and no [DONE]; a request
    not yet answered gets 503."""
    started, complete = _progress(send)
    if complete:
        return
    if started:
        body = cut_meta_event({}, DRAIN_CUT_ERROR)
    else:
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", b"1")]})
        body = _CUT_BODY
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainGate:
    """ASGI middleware: registers each HTTP request with the Drain, finishes it if it is cut."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self._app = app
        self._drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        drain = self._drain
        task = asyncio.current_task()
        assert task is not None
        drain.active[task] = send
        cut = False
        try:
            await self._app(scope, receive, send)
        except asyncio.CancelledError:
            if task not in drain.cutting:
                raise
            # Our own cancellation, handled once (a second one, from uvicorn's backstop or the
            # loop's shutdown, goes through): answer the client, then end normally.
            drain.cutting.discard(task)
            cut = True
            task.uncancel()
            await finish_cut(send)
        finally:
            del drain.active[task]
            if drain.draining and not cut:
                drain.finished += 1


def draining_protocol(drain: Drain) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, with a shutdown that never closes a connection under a
    request that may be on its way (see the module docstring), and that tells a request
    waiting for its client to leave (`uvicorn_cycle.watch_disconnect`) when it does."""

    class DrainingHttpTools(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if drain.draining:  # accepted after the listeners closed: shut down like the others
                self.shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            notify_disconnect(cycle)

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


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = self._drain
        drain.begin(len(self.server_state.connections))
        deadline = asyncio.get_running_loop().call_later(drain.timeout_s, self._at_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
            drain.report()

    def _at_deadline(self) -> None:
        self._drain.cut_remaining()
        for connection in list(self.server_state.connections):
            closer = getattr(connection, "close_at_deadline", None)
            if closer is not None:
                closer()


def uvicorn_graceful_timeout(drain_timeout_s: float) -> float:
    """uvicorn's own backstop, after our deadline and the flush of the cut responses."""
    return drain_timeout_s + CUT_FLUSH_S


def warn_if_queued_connections_may_reset() -> None:
    """One line at start if a restart would reset connections queued on a closing listener."""
    try:
        with open(MIGRATE_REQ_PATH) as f:
            value = f.read().strip()
    except OSError:
        return  # not Linux >= 5.14: nothing to say that an operator could change
    if value == "0":
        log.warning("net.ipv4.tcp_migrate_req is 0: a worker that restarts resets the connections "
                    "still queued on its listener; see deploy/sysctl/90-cacheroute-proxy.conf")
