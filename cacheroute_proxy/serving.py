"""Run a role's server (the sidecar's, every worker's: cacheroute_proxy/http1/) on
uvloop and tell systemd what it does.

Outside systemd ($NOTIFY_SOCKET unset) this is `server.serve(sockets)`. Under systemd a small
task on the server's own event loop says READY=1 once every listener is open, refreshes STATUS=
every few seconds, pings WATCHDOG=1 every WatchdogSec/2 (a blocked loop stops pinging, and
systemd restarts the process) and says STOPPING=1 as soon as shutdown begins. Nothing here runs
per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Callable, Coroutine, Protocol

import uvloop

from .systemd import Notifier, watchdog_interval_s

TICK_S = 0.1  # how often the reporter looks at the server
STATUS_EVERY_S = 5.0

Describe = Callable[[Any], str]


class Server(Protocol):
    """What is run, and what the reporter reads of it (http1.Http1Server)."""

    def serve(self, sockets: list[socket.socket]) -> Coroutine[Any, Any, None]: ...

    def has_started(self) -> bool: ...

    def exit_requested(self) -> bool: ...

    def requests_in_flight(self) -> int: ...

    def open_connections(self) -> int: ...


def serve(server: Server, sockets: list[socket.socket], describe: Describe,
          notifier: Notifier | None = None) -> None:
    """Serve on `sockets` until the server stops, telling systemd what it does when it asks
    (`describe(server)` is the STATUS= line)."""
    notifier = notifier or Notifier()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            if not notifier.enabled:
                runner.run(server.serve(sockets))
            else:
                runner.run(_report_while(server, server.serve(sockets), describe, notifier))
    finally:
        notifier.close()


async def _report_while(server: Server, serving: Coroutine[Any, Any, None], describe: Describe,
                        notifier: Notifier) -> None:
    reporter = _Reporter(server, describe, notifier, watchdog_interval_s())
    task = asyncio.create_task(reporter.run())
    try:
        await serving
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if server.has_started():
            reporter.stopping()  # a shutdown faster than one tick still says STOPPING=1


class _Reporter:
    """Looks at the server every TICK_S on its own event loop and tells systemd."""

    def __init__(self, server: Server, describe: Describe, notifier: Notifier,
                 watchdog_s: float | None) -> None:
        self._view = self._server = server
        self._describe, self._notifier = describe, notifier
        self._watchdog_s = watchdog_s
        self._ready = self._stopping = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_ping = next_status = loop.time()
        while True:
            now = loop.time()
            if self._watchdog_s is not None and now >= next_ping:
                self._notifier.send(WATCHDOG=1)
                next_ping = now + self._watchdog_s
            if self._view.exit_requested() and not self._stopping:
                self.stopping()
                next_status = now + STATUS_EVERY_S
            elif self._view.has_started() and not self._ready and not self._stopping:
                # Not sent (a full notify socket): tried again next tick, else systemd would
                # give up on the start.
                self._ready = self._notifier.send(READY=1, STATUS=_safe(self._describe, self._server))
                next_status = now + STATUS_EVERY_S
            elif (self._ready or self._stopping) and now >= next_status:
                self._notifier.send(STATUS=self._draining() if self._stopping
                                    else _safe(self._describe, self._server))
                next_status = now + STATUS_EVERY_S
            await asyncio.sleep(TICK_S)

    def stopping(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._notifier.send(STOPPING=1, STATUS=self._draining())

    def _draining(self) -> str:
        view = self._view
        return (f"draining: {view.requests_in_flight()} requests, "
                f"{view.open_connections()} connections open")


def _safe(describe: Describe, server: Any) -> str:
    try:
        return describe(server)
    except Exception as exc:  # a status line is never worth stopping the pings for
        return f"serving (status unavailable: {exc.__class__.__name__})"
