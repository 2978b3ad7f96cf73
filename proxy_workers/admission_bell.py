"""Waking another worker's requests that wait for ready admission to an instance.

The ready gate is host-wide (READY_CONCURRENCY, a count in the instance's slot), so a place one
worker frees may be another worker's to take. A worker that frees a place while the instance's
host-wide ready queue holds more waiters than its own sends the slot's number to every other
worker's bell: a datagram to an abstract Unix socket named after the segment and the worker's
row (cacheroute_proxy/doorbell.py). The woken worker's head waiter for that instance tries at
once, so a waiting head needs no fast poll: it backs off (admission.POLL_S_WITH_BELLS).

No wake-up is lost for good: a waiter counts itself in the queue lane before it first tries, and
the freeing worker reads that lane after its release (both sequentially consistent atomics), so
either the waiter's try sees the free place or the freer sees the waiter. A ring that cannot be
sent (a full socket queue, a worker gone) costs at most the waiter's slow poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from cacheroute_proxy.doorbell import datagram_socket, worker_address
from shm_schema import InstanceSlot, Segment, claimed_rows, counter_value, layout

log = logging.getLogger("cacheroute.worker")


class AdmissionBells:
    """This worker's bell (bound to its row's address) and its rings to the others'."""

    def __init__(self, seg: Segment, row: int) -> None:
        self._seg = seg
        self._row = row
        self._sock = datagram_socket(worker_address(seg.name, row))
        self._on_slot: Callable[[int], None] | None = None
        self.rings_sent = 0
        self.rings_heard = 0

    def listen(self, on_slot: Callable[[int], None]) -> None:
        """Call `on_slot(slot)` for each slot another worker rings about (on the running loop)."""
        self._on_slot = on_slot
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_ring)

    def others_wait(self, instance: InstanceSlot, own: int) -> bool:
        """More requests wait for `instance`'s ready gate host-wide than this worker's `own`."""
        waiting = counter_value(self._seg, instance.slot, instance.generation, layout.LANE_READY_WAITING)
        return waiting is not None and waiting > own

    def ring_others(self, slot: int) -> None:
        """A place of `slot`'s ready gate is free: every other worker's head waiter may try."""
        message, name = b"%d" % slot, self._seg.name
        for row in claimed_rows(self._seg):
            if row != self._row:
                with contextlib.suppress(OSError):  # gone, or its queue full of rings already
                    self._sock.sendto(message, worker_address(name, row))
                    self.rings_sent += 1

    def _on_ring(self) -> None:
        slots = set()
        with contextlib.suppress(BlockingIOError):
            while True:
                message = self._sock.recv(32)
                self.rings_heard += 1
                with contextlib.suppress(ValueError):
                    slots.add(int(message))
        if self._on_slot is not None:
            for slot in slots:
                self._on_slot(slot)

    def describe(self) -> dict[str, int]:
        return {"rings_sent": self.rings_sent, "rings_heard": self.rings_heard}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()


def open_bells(seg: Segment, row: int) -> AdmissionBells | None:
    """This worker's bells, or None (its waiters then poll fast) if the address is taken or the
    platform has no abstract Unix sockets."""
    try:
        return AdmissionBells(seg, row)
    except OSError as exc:
        log.warning("no admission bell (%s): requests waiting for ready admission poll", exc)
        return None
