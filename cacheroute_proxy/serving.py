"""Run a role's uvicorn server and tell systemd what it does (the sidecar and every worker).

Outside systemd ($NOTIFY_SOCKET unset) this is `server.run(sockets=...)`. Under systemd a small
task on the server's own event loop says READY=1 once every listener is open, refreshes STATUS=
every few seconds, pings WATCHDOG=1 every WatchdogSec/2 (a blocked loop stops pinging, and
systemd restarts the process) and says STOPPING=1 as soon as shutdown begins. Nothing here runs
per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Callable

import uvicorn

from . import uvicorn_seam as seam
from .systemd import Notifier, watchdog_interval_s

TICK_S = 0.1  # how often the reporter looks at the server (as often as uvicorn's own loop)
STATUS_EVERY_S = 5.0

Describe = Callable[[uvicorn.Server], str]


def draining(server: uvicorn.Server) -> str:
    return (f"draining: {seam.requests_in_flight(server)} requests, "
            f"{seam.open_connections(server)} connections open")


def serve(server: uvicorn.Server, describe: Describe, sockets: list[socket.socket] | None = None,
          notifier: Notifier | None = None) -> None:
    """`server.run(sockets=sockets)`, telling systemd what the server does when it asks."""
    notifier = notifier or Notifier()
    if not notifier.enabled:
        server.run(sockets=sockets)
        return
    try:
        seam.run_with(server, lambda: _serve(server, describe, notifier, sockets))
    finally:
        notifier.close()


async def _serve(server: uvicorn.Server, describe: Describe, notifier: Notifier,
                 sockets: list[socket.socket] | None) -> None:
    reporter = _Reporter(server, describe, notifier, watchdog_interval_s())
    task = asyncio.create_task(reporter.run())
    try:
        await server.serve(sockets=sockets)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if seam.has_started(server):
            reporter.stopping()  # a shutdown faster than one tick still says STOPPING=1


class _Reporter:
    """Looks at the server every TICK_S on its own event loop and tells systemd."""

    def __init__(self, server: uvicorn.Server, describe: Describe, notifier: Notifier,
                 watchdog_s: float | None) -> None:
        self._server, self._describe, self._notifier = server, describe, notifier
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
            if seam.exit_requested(self._server) and not self._stopping:
                self.stopping()
                next_status = now + STATUS_EVERY_S
            elif seam.has_started(self._server) and not self._ready and not self._stopping:
                # Not sent (a full notify socket): tried again next tick, else systemd would
                # give up on the start.
                self._ready = self._notifier.send(READY=1, STATUS=_safe(self._describe, self._server))
                next_status = now + STATUS_EVERY_S
            elif (self._ready or self._stopping) and now >= next_status:
                self._notifier.send(STATUS=draining(self._server) if self._stopping
                                    else _safe(self._describe, self._server))
                next_status = now + STATUS_EVERY_S
            await asyncio.sleep(TICK_S)

    def stopping(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._notifier.send(STOPPING=1, STATUS=draining(self._server))


def _safe(describe: Describe, server: uvicorn.Server) -> str:
    try:
        return describe(server)
    except Exception as exc:  # a status line is never worth stopping the pings for
        return f"serving (status unavailable: {exc.__class__.__name__})"
