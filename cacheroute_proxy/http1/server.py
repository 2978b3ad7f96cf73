"""The server (`Http1Server`): listens on given sockets, serves its routes and an ASGI app,
runs the app's lifespan, and drains on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
import socket

from .connection import Connection
from .cycle import Handler
from .draining import Draining
from .lifespan import ASGIApp, Lifespan
from .limits import HeadLimits

CUT_FLUSH_S = 2.0


class Http1Server:
    """Serves its `routes` and, for every other request, an ASGI app on given sockets until
    SIGTERM/SIGINT, then drains (see module doc).

    Also runs the app's lifespan (startup before listening, shutdown after the drain)."""

    def __init__(self, app: ASGIApp, drain: Draining, keepalive_timeout_s: float,
                 limits: HeadLimits, *, routes: dict[tuple[str, bytes], Handler] | None = None,
                 handle_signals: bool = True) -> None:
        self.app = app
        self.limits = limits
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
        lifespan = Lifespan(self.app)
        try:
            if not await lifespan.startup():
                return
            if self._exit_asked:
                return
            for sock in sockets:
                servers.append(await self.loop.create_server(lambda: Connection(self), sock=sock,
                                                             backlog=2048))
            self.started = True
            sweep = self.loop.create_task(self._sweep())
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

    async def _sweep(self) -> None:
        """The keep-alive timeout and the head timeout of every connection, by one sweep a
        fraction of the shorter apart instead of timers per connection re-armed on every
        request."""
        idle_s, head_s = self.keepalive_timeout_s, self.limits.timeout_s
        every = min(1.0, idle_s / 4, head_s / 4)
        while True:
            await asyncio.sleep(every)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.close_if_idle_since(now - idle_s)
                conn.refuse_if_head_began_before(now - head_s)

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
