"""Run a role's server and tell systemd what it does (the sidecar and every worker): uvicorn's
(the sidecar), or any server that says the same four things (`NativeServer`: a worker's
proxy_workers/http1_server.py).

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
from typing import Any, Callable, Coroutine, Protocol

import uvicorn

from . import uvicorn_seam as seam
from .systemd import Notifier, watchdog_interval_s

TICK_S = 0.1  # how often the reporter looks at the server (as often as uvicorn's own loop)
STATUS_EVERY_S = 5.0

Describe = Callable[[Any], str]


class NativeServer(Protocol):
    """What the reporter reads of a server that is not uvicorn's."""

    def has_started(self) -> bool: ...

    def exit_requested(self) -> bool: ...

    def requests_in_flight(self) -> int: ...

    def open_connections(self) -> int: ...


class _UvicornView:
    """uvicorn's server, seen as a NativeServer (through the seam)."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server

    def has_started(self) -> bool:
        return seam.has_started(self.server)

    def exit_requested(self) -> bool:
        return seam.exit_requested(self.server)

    def requests_in_flight(self) -> int:
        return seam.requests_in_flight(self.server)

    def open_connections(self) -> int:
        return seam.open_connections(self.server)




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


def serve_native(server: NativeServer, serve_forever: Callable[[], Coroutine[Any, Any, None]],
                 describe: Describe, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
                 notifier: Notifier | None = None) -> None:
    """Run `serve_forever()` (the native server's serve) on a loop from `loop_factory`, telling
    systemd what `server` does, as `serve` does for uvicorn."""
    notifier = notifier or Notifier()
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            if not notifier.enabled:
                runner.run(serve_forever())
            else:
                runner.run(_report_while(server, server, serve_forever(), describe, notifier))
    finally:
        notifier.close()


async def _serve(server: uvicorn.Server, describe: Describe, notifier: Notifier,
                 sockets: list[socket.socket] | None) -> None:
    await _report_while(_UvicornView(server), server, server.serve(sockets=sockets), describe,
                        notifier)


async def _report_while(view: NativeServer, described: Any, serving: Coroutine[Any, Any, None],
                        describe: Describe, notifier: Notifier) -> None:
    reporter = _Reporter(view, described, describe, notifier, watchdog_interval_s())
    task = asyncio.create_task(reporter.run())
    try:
        await serving
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if view.has_started():
            reporter.stopping()  # a shutdown faster than one tick still says STOPPING=1


class _Reporter:
    """Looks at the server every TICK_S on its own event loop and tells systemd."""

    def __init__(self, view: NativeServer, server: Any, describe: Describe, notifier: Notifier,
                 watchdog_s: float | None) -> None:
        # `view` is read; `server` is what `describe` is given (uvicorn's, or the native one).
        self._view, self._server, self._describe, self._notifier = view, server, describe, notifier
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
