"""The sidecar's doorbell: how a worker wakes an idle sidecar instead of the sidecar polling.

Busy, the sidecar drains the workers' event rings every PROXY_EVENT_POLL_MS (busier, at each
publish: sidecar/pressure.py). As soon as a tick finds no event, it sets the header's
`sidecar_sleeping` word, looks at the rings once more, and sleeps until its doorbell rings or
its next periodic duty (the snapshot heartbeat) is due. A worker that publishes an event then
loads that word and, when it is set, rings: one datagram to the sidecar's socket. Either the
sidecar's last look sees the event or the worker sees the word (both are sequentially
consistent atomics), so an event that rings never waits for the heartbeat (first tokens and
completions do not ring: shm_schema/events.py). What changes inside the sidecar and is
published at its next tick (an engine's KV events) rings the bell from there (`ring_here`).

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


def datagram_socket(bind_to: bytes | None = None) -> socket.socket:
    """A non-blocking Unix datagram socket, bound to `bind_to` if given (OSError if taken)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    if bind_to is not None:
        try:
            sock.bind(bind_to)
        except OSError:
            sock.close()
            raise
    return sock


def worker_address(shm_name: str, row: int) -> bytes:
    """The bell of the worker on `row` (proxy_workers/admission_bell.py): the sidecar's address
    and the row, which no segment name can spell (it holds no second slash)."""
    return address(shm_name) + b"/w%d" % row


class Doorbell:
    """The sidecar's side: bound to the segment's address."""

    def __init__(self, shm_name: str) -> None:
        self._sock = datagram_socket(address(shm_name))
        self._rung = False  # since the last wait
        self._waiter: asyncio.Future[None] | None = None
        self._watching = False
        self.rings = 0

    async def wait(self, timeout_s: float) -> bool:
        """Until a worker or the sidecar itself rings (True) or `timeout_s` passes (False). A
        future and a timer, no task: the sidecar waits here after nearly every quiet tick."""
        loop = asyncio.get_running_loop()
        if not self._watching:
            loop.add_reader(self._sock.fileno(), self._on_ring)
            self._watching = True
        if not self._rung:
            self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, self._wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        rung, self._rung = self._rung, False
        return rung

    def settle(self) -> None:
        """Forget the rings so far: the tick that just ran took what they announced."""
        self._rung = False

    def ring_here(self) -> None:
        """A ring from inside the sidecar: something its next tick publishes has changed."""
        self._rung = True
        self._wake()

    def _on_ring(self) -> None:
        # Every queued ring at once: one left for a later call would wake the sidecar again
        # after the tick that took what it announced.
        with contextlib.suppress(BlockingIOError):
            while True:
                self._sock.recv(16)
                self.rings += 1
        self.ring_here()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
        self._sock = datagram_socket()
        self._address = address(shm_name)
        self._due = False

    def ring(self) -> None:
        """Ring once the event loop's current step is done: the woken sidecar would take a core
        from under it, and that step is often sending a request on (a reserve event comes just
        before the forward). Rings asked for in one step are one datagram."""
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool, a test): at once
            self._send()
            return
        self._due = True
        loop.call_soon(self._send)

    def _send(self) -> None:
        self._due = False
        with contextlib.suppress(OSError):
            self._sock.sendto(b"!", self._address)

    def close(self) -> None:
        self._sock.close()
