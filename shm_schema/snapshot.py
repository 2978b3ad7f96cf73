"""The sidecar's pressure snapshot: double-buffered records plus a generation counter.

The sidecar writes the inactive buffer, then bumps the generation. A reader loads the
generation, reads buffer `gen % 2` with one struct call and checks the generation again; if it
moved, the reader keeps what it had (never spins), so a descheduled or killed writer cannot
stall a worker. Readers decode only when the generation changed: the common case is one load.
Times are absolute (microseconds since the epoch), so the sidecar need not republish as time
passes and each worker computes "in N ms" against its own clock.

A record is a `records.SnapshotRecord` (`Pressure` here, its name on the publishing side).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Callable, Sequence

from . import layout
from .records import SNAPSHOT, SnapshotRecord
from .segment import Segment

Pressure = SnapshotRecord

_STRIDE = SNAPSHOT.count  # fields of one record in the flat tuple `records` returns
_GENERATION = SNAPSHOT.index.generation
_EMPTY = SnapshotRecord(*(0,) * SNAPSHOT.count)


def flat_index(slot: int, field: int) -> int:
    """Where field `field` (a SNAPSHOT.index) of `slot` is in the flat tuple of `records`."""
    return _STRIDE * slot + field


def fields_at(records: Sequence[int], slot: int, generation: int) -> int | None:
    """Where `slot`'s fields begin in the flat tuple of `SnapshotReader.records`, if the tuple
    covers the slot and the record describes `generation`; else None (the instance is unknown
    to it). A field is then `records[at + SNAPSHOT.index.<name>]`: no record built."""
    at = _STRIDE * slot
    if len(records) < at + _STRIDE or records[at + _GENERATION] != generation:
        return None
    return at


def record_at(records: Sequence[int], slot: int, generation: int) -> SnapshotRecord | None:
    """A slot's record from the flat tuple of `SnapshotReader.records` (as `fields_at`)."""
    at = fields_at(records, slot, generation)
    return None if at is None else SNAPSHOT.make(records[at:at + _STRIDE])


class SnapshotWriter:
    """The sidecar's side. Writes the records of slots 0 .. the highest it publishes in one
    struct call, and clears what a buffer held above that; a new writer (a restarted sidecar)
    does not know what its predecessor left, so it clears each buffer's whole capacity once."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        capacity = seg.geometry.instance_capacity
        self._written = [capacity, capacity]  # per buffer: slots that may hold a record

    def publish(self, records: dict[int, Pressure]) -> int:
        """Write every slot's record (absent slots are cleared) and make them visible."""
        seg = self._seg
        generation = seg.load(layout.H_SNAPSHOT_GEN)
        buffer = (generation + 1) % 2
        span = 1 + max(records, default=-1)
        width = max(span, self._written[buffer])
        get = records.get
        SNAPSHOT.array(width).pack_into(seg.buf, seg.geometry.snapshot_record_offset(buffer, 0),
                         *itertools.chain.from_iterable([get(slot, _EMPTY) for slot in range(width)]))
        self._written[buffer] = span
        seg.store(layout.H_SNAPSHOT_PUBLISHED_US, time.time_ns() // 1000)
        seg.store(layout.H_SNAPSHOT_GEN, generation + 1)
        return generation + 1


class SnapshotReader:
    """A worker's cached view of the pressure snapshot."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._generation = -1
        self._records: tuple[int, ...] = ()
        self._span = 0
        # The generation published now: one atomic load, prebound. The writer stores the
        # publish time before it bumps the generation, so what a caller derived from `records`
        # and `published_us` stays true while this is unchanged (least_load's C selector
        # re-reads the records only then).
        self.generation: Callable[[], int] = functools.partial(seg.atomic.load_u64,
                                                               layout.H_SNAPSHOT_GEN)
        # When the records now published were written (µs since the epoch; 0: never).
        self.published_us: Callable[[], int] = functools.partial(seg.atomic.load_u64,
                                                                 layout.H_SNAPSHOT_PUBLISHED_US)

    # Where `generation` reads, for a reader in C (cacheroute_proxy/routing/_least_load.c).
    generation_offset = layout.H_SNAPSHOT_GEN

    def records(self, span: int) -> tuple[int, ...]:
        """The records of slots 0 .. span-1 as one flat tuple (SNAPSHOT.count fields a slot,
        at SNAPSHOT.index within it; `record_at` decodes one); () if never published."""
        seg = self._seg
        generation = self.generation()
        if generation == self._generation and span <= self._span:
            return self._records
        if generation == 0:
            return ()
        offset = seg.geometry.snapshot_record_offset(generation % 2, 0)
        records = SNAPSHOT.array(span).unpack_from(seg.buf, offset)
        if self.generation() != generation:
            # The writer moved on while we read: keep the previous records, if they cover the
            # span asked for (a caller indexes every slot below it); else nothing is known yet.
            return self._records if span <= self._span else ()
        self._generation, self._records, self._span = generation, records, span
        return records
