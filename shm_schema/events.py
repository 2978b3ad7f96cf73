"""Worker -> sidecar events: one single-producer/single-consumer ring per worker row.

Why rings in the segment: a POSIX message queue holds 10 messages here and an AF_UNIX datagram
socket about 11, far too shallow for bursts. A ring of `ring_capacity` fixed 64-byte records
costs one struct write and one atomic store per event, never blocks, and survives a sidecar
restart. When the ring is full the worker keeps events in a bounded local spill, in order, and
moves them in as the sidecar catches up; only when the spill is full too is an event dropped,
and then it is counted in the row (`events_dropped`, shown in /debug/status).

Events carry the sidecar epoch they were written under; a restarted sidecar (new epoch)
discards older ones and the workers re-send the state of every request still in flight.
"""

from __future__ import annotations

import collections
import enum
from typing import Iterator, NamedTuple

from . import layout
from .records import EVENT
from .segment import Segment

_FIELDS = EVENT.struct
_SIZE = EVENT.size


class EventKind(enum.IntEnum):
    RESERVE = 1      # released to ready: a = predicted prefill us, b = predicted decode us,
                     # c = decode tokens, d = prompt tokens
    FIRST_TOKEN = 2  # the instance produced its first byte of output
    COMPLETE = 3     # finished (a = 0) or failed/cancelled (a = 1); the reservation goes away
    RESYNC = 4       # a live request re-announced to a new sidecar: same payload as RESERVE,
                     # plus t_us = original reserve time; FIRST_TOKEN follows if it was seen


class Event(NamedTuple):
    kind: int
    epoch: int
    request_key: int
    slot: int
    generation: int
    t_us: int
    a: int = 0
    b: int = 0
    c: int = 0
    d: int = 0


class EventWriter:
    """The worker side (single producer) of one row's ring, with a bounded local spill."""

    def __init__(self, seg: Segment, row: int, spill_limit: int = 65536) -> None:
        geometry = seg.geometry
        self._buf = seg.buf
        self._load = seg.atomic.load_u64
        self._store = seg.atomic.store_u64
        self._fetch_add = seg.atomic.fetch_add_u64
        base = geometry.row_offset(row)
        self._tail_offset = base + layout.R_RING_TAIL
        self._head_offset = base + layout.R_RING_HEAD
        self._dropped_offset = base + layout.R_EVENTS_DROPPED
        self._ring_base = geometry.ring_offset(row)
        self._capacity = geometry.ring_capacity
        self._tail = self._load(self._tail_offset)
        self._spill: collections.deque[tuple[int, ...]] = collections.deque()
        self._spill_limit = spill_limit
        self.written = 0
        self.dropped = 0

    @property
    def spilled(self) -> int:
        return len(self._spill)

    def write(self, kind: int, epoch: int, request_key: int, slot: int, generation: int,
              t_us: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> bool:
        """Never blocks. False only if the event had to be dropped (counted)."""
        record = (kind | (epoch << 8), request_key, (slot << 32) | generation, t_us, a, b, c, d)
        if self._spill or not self._put(record):
            if len(self._spill) >= self._spill_limit:
                self.dropped += 1
                self._fetch_add(self._dropped_offset, 1)
                return False
            self._spill.append(record)
            self.flush()
        return True

    def flush(self) -> int:
        """Move spilled events into the ring, oldest first; returns how many remain."""
        spill = self._spill
        while spill and self._put(spill[0]):
            spill.popleft()
        return len(spill)

    def discard_spill(self) -> int:
        """Forget spilled events (they belong to a sidecar epoch that has ended)."""
        count = len(self._spill)
        self._spill.clear()
        return count

    def _put(self, record: tuple[int, ...]) -> bool:
        tail = self._tail
        if tail - self._load(self._head_offset) >= self._capacity:
            return False
        _FIELDS.pack_into(self._buf, self._ring_base + _SIZE * (tail % self._capacity), *record)
        self._tail = tail + 1
        self._store(self._tail_offset, tail + 1)  # publish after the record is written
        self.written += 1
        return True


class EventReader:
    """The sidecar side (single consumer) of every row's ring."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def drain(self, row: int, limit: int | None = None) -> Iterator[Event]:
        """Yield the row's unread events in order and mark them consumed."""
        seg = self._seg
        geometry = seg.geometry
        base = geometry.row_offset(row)
        head = seg.load(base + layout.R_RING_HEAD)
        tail = seg.load(base + layout.R_RING_TAIL)
        if limit is not None:
            tail = min(tail, head + limit)
        ring = geometry.ring_offset(row)
        capacity = geometry.ring_capacity
        try:
            while head < tail:
                kind_epoch, key, slot_gen, t_us, a, b, c, d = _FIELDS.unpack_from(
                    seg.buf, ring + _SIZE * (head % capacity))
                head += 1
                yield Event(kind_epoch & 0xFF, kind_epoch >> 8, key, slot_gen >> 32,
                            slot_gen & 0xFFFFFFFF, t_us, a, b, c, d)
        finally:
            seg.store(base + layout.R_RING_HEAD, head)
