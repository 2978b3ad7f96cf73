"""The order in which one worker's prepared requests for one instance go on to ready admission.

Each request takes a ticket, numbered in arrival order, before it prepares. `ordered` releases
tickets strictly in that order, so a request whose preparation finished early still waits for
the ones ahead of it; `text_bypass` also lets text requests (nothing to wait for at the
instance) pass a head still preparing, at most `bypass_max` per flush. A ticket abandoned
before its turn (client gone, timeout) never wedges the ones behind it.

Most requests are released the moment they are offered, so a ticket makes a future only when
someone actually waits on it.
"""

from __future__ import annotations

import asyncio

from .admission import resolve
from .trace import Trace


class Ticket:
    __slots__ = ("seq", "injection_type", "trace", "released", "_future")

    def __init__(self, seq: int, injection_type: str = "text", trace: Trace | None = None) -> None:
        self.seq = seq
        self.injection_type = injection_type  # the release class ("text" may bypass)
        self.trace = trace  # where the release is recorded (ready_release_seq, ...)
        self.released = False
        self._future: asyncio.Future[None] | None = None

    def release(self) -> None:
        self.released = True
        if self._future is not None:
            resolve(self._future)

    async def wait(self) -> None:
        """Until released. A cancelled wait leaves the ticket unreleased (the caller abandons it)."""
        if not self.released:
            self._future = asyncio.get_running_loop().create_future()
            await self._future


class ReleaseOrder:
    """One instance's tickets in this worker: issued, offered when prepared, released in turn."""

    def __init__(self, policy: str, bypass_max: int) -> None:
        self.policy = policy  # "ordered" | "text_bypass"
        self.bypass_max = bypass_max
        self.next_seq = 1
        self.next_release = 1
        self.released = 0  # tickets released so far (a ticket's ready_release_seq)
        self._waiting: dict[int, Ticket] = {}  # offered, not yet released
        self._done: set[int] = set()  # released out of order, or abandoned

    def issue(self, trace: Trace | None = None) -> Ticket:
        ticket = Ticket(self.next_seq, trace=trace)
        self.next_seq += 1
        return ticket

    def pass_through(self, trace: Trace) -> int:
        """A request with nothing to wait for, when every ticket is settled: issued and released
        at once, as `issue` then `offer` would (no Ticket made); returns its sequence number."""
        seq = self.next_seq
        self.next_seq = self.next_release = seq + 1
        self._count_release(trace, None)
        return seq

    @property
    def settled(self) -> bool:
        """Every ticket issued was released or abandoned, none out of turn is pending."""
        return self.next_release == self.next_seq and not self._waiting and not self._done

    def offer(self, ticket: Ticket) -> None:
        """`ticket` is prepared: release it, and whatever it unblocks, if its turn has come."""
        if not ticket.released and ticket.seq not in self._waiting:
            self._waiting[ticket.seq] = ticket
            self._flush()

    async def wait(self, ticket: Ticket) -> None:
        self.offer(ticket)
        await ticket.wait()

    def abandon(self, ticket: Ticket) -> None:
        """A request that leaves before its turn must not wedge the ones behind it."""
        self._waiting.pop(ticket.seq, None)
        if ticket.seq >= self.next_release:
            self._done.add(ticket.seq)
        ticket.release()
        self._flush()

    def _flush(self) -> None:
        while True:
            seq = self.next_release
            if seq in self._done:
                self._done.discard(seq)
            elif seq in self._waiting:
                self._release(self._waiting.pop(seq), None)
            else:
                break
            self.next_release += 1
        if self.policy != "text_bypass" or not self._waiting:
            return
        bypass = [t for _, t in sorted(self._waiting.items()) if t.injection_type == "text"]
        for ticket in bypass[:self.bypass_max]:
            del self._waiting[ticket.seq]
            self._done.add(ticket.seq)
            self._release(ticket, self.next_release)

    def _release(self, ticket: Ticket, blocked_seq: int | None) -> None:
        """Release `ticket` and record how: `blocked_seq` is the head a bypass passed."""
        self._count_release(ticket.trace, blocked_seq)
        ticket.release()

    def _count_release(self, trace: Trace | None, blocked_seq: int | None) -> None:
        self.released += 1
        if trace is not None:
            trace.ready_release_seq = self.released
            trace.ready_release_policy = self.policy
            trace.ready_bypass = blocked_seq is not None
            trace.ready_blocked_seq = blocked_seq
