"""systemd's service notifications (sd_notify(3)) without libsystemd.

The protocol: newline-separated `KEY=VALUE` lines in one datagram to the AF_UNIX socket named
by $NOTIFY_SOCKET (a path, or an abstract name written with a leading '@'). Unset: every call
is a no-op, so the same code runs under the supervisor, by hand and under systemd. What a
server tells systemd, and when, is serving.py's business.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("cacheroute.sd_notify")


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
