"""The sidecar's pressure snapshot: double-buffered records plus a generation counter.

The sidecar writes the inactive buffer, then bumps the generation. A reader loads the
generation, reads buffer `gen % 2` with one struct call and checks the generation again; if it
moved, the reader keeps what it had (never spins), so a descheduled or killed writer cannot
stall a worker. Readers decode only when the generation changed: the common case is one load.
Times are absolute (microseconds since the epoch), so the sidecar need not republish as time
passes and each worker computes "in N ms" against its own clock.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from . import layout
from .segment import Segment

_FIELDS = layout.SNAPSHOT_FIELDS


class Pressure(NamedTuple):
    generation: int  # the slot generation it describes
    pending_prefill_count: int
    active_decode_count: int
    next_slot_free_at_us: int
    prefill_free_at_us: int
    decode_free_at_us: int
    marginal_backlog_us: int = 0  # what one more request adds to the backlog (see layout)


class SnapshotWriter:
    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def publish(self, records: dict[int, Pressure]) -> int:
        """Write every slot's record (absent slots are cleared) and make them visible."""
        seg = self._seg
        geometry = seg.geometry
        generation = seg.load(layout.H_SNAPSHOT_GEN)
        buffer = (generation + 1) % 2
        empty = (0,) * _FIELDS
        packer = layout.snapshot_struct(1)
        for slot in range(geometry.instance_capacity):
            record = records.get(slot)
            packer.pack_into(seg.buf, geometry.snapshot_record_offset(buffer, slot),
                             *(empty if record is None else record))
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
        self._structs: dict[int, object] = {}

    def published_us(self) -> int:
        return self._seg.load(layout.H_SNAPSHOT_PUBLISHED_US)

    def records(self, span: int) -> tuple[int, ...]:
        """Flat fields (SNAPSHOT_FIELDS a slot) of slots 0 .. span-1; () if never published."""
        seg = self._seg
        generation = seg.load(layout.H_SNAPSHOT_GEN)
        if generation == self._generation and span <= self._span:
            return self._records
        if generation == 0:
            return ()
        unpacker = self._structs.get(span)
        if unpacker is None:
            unpacker = self._structs[span] = layout.snapshot_struct(span)
        offset = seg.geometry.snapshot_record_offset(generation % 2, 0)
        records = unpacker.unpack_from(seg.buf, offset)  # type: ignore[attr-defined]
        if seg.load(layout.H_SNAPSHOT_GEN) != generation:
            return self._records  # the writer moved on while we read: keep the previous one
        self._generation, self._records, self._span = generation, records, span
        return records

    def pressure(self, slot: int, generation: int) -> Pressure | None:
        """One slot's record if it describes `generation`."""
        records = self.records(slot + 1)
        if not records:
            return None
        fields = records[_FIELDS * slot:_FIELDS * (slot + 1)]
        return Pressure(*fields) if fields and fields[0] == generation else None

