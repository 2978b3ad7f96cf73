"""The sidecar's doorbell: how a worker wakes an idle sidecar instead of the sidecar polling.

Busy, the sidecar drains the workers' event rings every PROXY_EVENT_POLL_MS. Idle (nothing
written for a while), it sets the header's `sidecar_sleeping` word, looks at the rings once more,
and sleeps until its doorbell rings or its next periodic duty (the snapshot heartbeat) is due. A
worker that publishes an event then loads that word and, when it is set, rings: one datagram to
the sidecar's socket. Either the sidecar's last look sees the event or the worker sees the word
(both are sequentially consistent atomics), so an event never waits for the heartbeat.

The socket is a Unix datagram socket in the abstract namespace, named after the segment: no file
to clean up, gone with the sidecar, private to the host's network namespace. A ring that cannot
be sent (no sidecar, its queue full of rings already) is dropped: it was not needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

log = logging.getLogger("cacheroute.doorbell")


def address(shm_name: str) -> bytes:
    return b"\0cacheroute-doorbell" + shm_name.encode()


class Doorbell:
    """The sidecar's side: bound to the segment's address."""

    def __init__(self, shm_name: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(address(shm_name))
        self._rung = asyncio.Event()
        self._watching = False
        self.rings = 0

    async def wait(self, timeout_s: float) -> bool:
        """Until a worker rings (True) or `timeout_s` passes (False)."""
        if not self._watching:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_ring)
            self._watching = True
        try:
            await asyncio.wait_for(self._rung.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        self._rung.clear()
        return True

    def _on_ring(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self._sock.recv(16)
                self.rings += 1
        self._rung.set()

    def close(self) -> None:
        if self._watching:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()


def open_doorbell(shm_name: str) -> Doorbell | None:
    """The sidecar's doorbell, or None (it then polls the rings at every tick) if the address is
    taken or the platform has no abstract Unix sockets."""
    try:
        return Doorbell(shm_name)
    except OSError as exc:
        log.warning("no doorbell (%s): polling the event rings at every tick, idle or not", exc)
        return None


class Bell:
    """A worker's side."""

    def __init__(self, shm_name: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._address = address(shm_name)

    def ring(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendto(b"!", self._address)

    def close(self) -> None:
        self._sock.close()
