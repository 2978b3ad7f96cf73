"""systemd's service notifications (sd_notify(3)) without libsystemd, and a uvicorn runner that
sends them.

The protocol: newline-separated `KEY=VALUE` lines in one datagram to the AF_UNIX socket named
by $NOTIFY_SOCKET (a path, or an abstract name written with a leading '@'). Unset: every call
is a no-op, so the same code runs under the supervisor, by hand and under systemd.

`serve()` runs a uvicorn server and, only when $NOTIFY_SOCKET is set, a small task on the same
event loop that says READY=1 once uvicorn listens, refreshes STATUS= every few seconds, pings
WATCHDOG=1 every WatchdogSec/2 (so a blocked loop stops pinging and systemd restarts the
process) and says STOPPING=1 as soon as shutdown begins. Nothing here runs per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Callable, Mapping

import uvicorn

log = logging.getLogger("cacheroute.sd_notify")

TICK_S = 0.1  # how often the reporter looks at the server (as often as uvicorn's own loop)
STATUS_EVERY_S = 5.0

Describe = Callable[[uvicorn.Server], str]


def socket_address(value: str) -> str | None:
    """$NOTIFY_SOCKET as an address for sendto: '@name' is the abstract name '\\0name'; an
    absolute path is itself; anything else (empty, relative, vsock:) is unsupported."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), or None when systemd expects
    none: $WATCHDOG_USEC unset or invalid, or $WATCHDOG_PID naming another process."""
    env = os.environ if environ is None else environ
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if watchdog_pid and watchdog_pid != str(os.getpid() if pid is None else pid):
        return None  # set for a parent that exec'd us in a child: the pings are not ours to send
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


class Notifier:
    """One datagram socket to systemd; sends never block and never raise."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = socket_address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: object) -> bool:
        """notify(READY=1, STATUS="...") -> True if the datagram left. One line per field;
        newlines inside a value would start a new field, so they become spaces."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # a full receiver drops a ping, never stalls the loop
            self._sock.sendto(message.encode(), self.address)
            return True
        except OSError as exc:
            if not self._warned:  # once: systemd gone or the socket misconfigured, not worth a flood
                self._warned = True
                log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def requests_in_flight(server: uvicorn.Server) -> int:
    """Requests uvicorn is running right now (one task per request cycle, streams included)."""
    return len(server.server_state.tasks)


def draining(server: uvicorn.Server) -> str:
    return (f"draining: {requests_in_flight(server)} requests, "
            f"{len(server.server_state.connections)} connections open")


def serve(server: uvicorn.Server, describe: Describe, sockets: list[socket.socket] | None = None,
          notifier: Notifier | None = None) -> None:
    """`server.run(sockets=sockets)`, telling systemd what the server does when it asks."""
    notifier = notifier or Notifier()
    if not notifier.enabled:
        server.run(sockets=sockets)
        return
    try:
        # What uvicorn's Server.run does, plus the reporter task on the same loop.
        factory = getattr(server.config, "get_loop_factory", None)
        if factory is None:  # older uvicorn installs an event loop policy instead
            server.config.setup_event_loop()
        with asyncio.Runner(loop_factory=factory() if factory else None) as runner:
            runner.run(_serve(server, describe, notifier, sockets))
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
        if server.started:
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
            if self._server.should_exit and not self._stopping:
                self.stopping()  # uvicorn sets should_exit in its signal handler, then drains
                next_status = now + STATUS_EVERY_S
            elif self._server.started and not self._ready and not self._stopping:
                # started: every listener is open, so a client connecting now is served.
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
