"""The worker's side of the host-wide per-instance counters: reading every lane, and changing
them through the worker's own row.

A slot has a few counter lanes (inflight, ready admission, prepare/ready activity and queue
depth; see layout). A worker changes them itself (CAS, tagged with the slot generation) and
mirrors its own share in its row, so the sidecar can subtract exactly what a dead worker held.
The two writes cannot be one atomic step, so each update is bracketed by a journal word naming
lane, slot and direction; what the sidecar does with a row whose worker died is in `repair`.
"""

from __future__ import annotations

import enum
import struct
import time

from . import layout, process_identity
from .bitfields import CounterWord, JournalWord
from .repair import free_row, subtract_row
from .segment import Segment

# The hot path (_apply) inlines these instead of calling the bitfields methods.
_WORD = layout.WORD
_LANES = layout.LANES
_COUNTERS = layout.COUNTERS_OFFSET
_GEN_SHIFT = CounterWord.GENERATION_SHIFT
_COUNT_MASK = CounterWord.COUNT_MASK
_SEQ_SHIFT = JournalWord.SEQUENCE_SHIFT
_LANE_SHIFT = JournalWord.LANE_SHIFT
_JOURNAL_END = JournalWord.END_BIT
_INFLIGHT = layout.LANE_INFLIGHT


class WorkerTableFull(RuntimeError):
    pass


class Admission(enum.IntEnum):
    ADMITTED = 1
    FULL = 0    # the lane is at its limit: wait and try again
    STALE = -1  # the slot no longer carries the generation: the instance is gone


# _apply's result -> Admission, by index: an Enum call by value costs about a microsecond.
_ADMISSION_OF_RESULT = (Admission.FULL, Admission.ADMITTED, Admission.STALE)


class CountersReader:
    """Plain loads of the counter lanes: one struct call, no lock, no syscall."""

    def __init__(self, seg: Segment) -> None:
        self._buf = seg.buf
        self._inflight: dict[int, struct.Struct] = {}
        self._lanes: dict[int, struct.Struct] = {}

    def words(self, span: int) -> tuple[int, ...]:
        """The inflight CounterWord of slots 0 .. span-1."""
        unpacker = self._inflight.get(span)
        if unpacker is None:
            unpacker = self._inflight[span] = layout.inflight_struct(span)
        return unpacker.unpack_from(self._buf, _COUNTERS)

    def lanes(self, span: int) -> tuple[int, ...]:
        """Every used lane of slots 0 .. span-1, LANES_USED words per slot (layout.lane_index)."""
        unpacker = self._lanes.get(span)
        if unpacker is None:
            unpacker = self._lanes[span] = layout.lanes_struct(span)
        return unpacker.unpack_from(self._buf, _COUNTERS)


def counter_value(seg: Segment, slot: int, generation: int, lane: int = _INFLIGHT) -> int | None:
    """The count of a (slot, lane) if the slot still carries `generation`, else None."""
    return CounterWord.count_under(seg.load(seg.geometry.counter_offset(slot, lane)), generation)


def inflight_count(seg: Segment, slot: int, generation: int) -> int | None:
    return counter_value(seg, slot, generation, _INFLIGHT)


class WorkerRow:
    """A worker's claimed row: its update path and its own contributions."""

    def __init__(self, seg: Segment, row: int, identity: int) -> None:
        self._seg = seg
        self._atomic = seg.atomic
        self._load = seg.atomic.load_u64
        self._store = seg.atomic.store_u64
        self._cas = seg.atomic.cas_u64
        self.row = row
        self.identity = identity
        geometry = seg.geometry
        self._base = geometry.row_offset(row)
        self._journal_offset = self._base + layout.R_JOURNAL
        self._contrib_base = geometry.contributions_base(row)
        self._op_seq = 0
        # Process-local mirror of this row's contribution words (single writer: this process).
        self._mirror: list[int] = [0] * (geometry.instance_capacity * _LANES)

    @classmethod
    def claim(cls, seg: Segment, worker_index: int, identity: int | None = None) -> "WorkerRow":
        identity = process_identity.own_identity() if identity is None else identity
        geometry = seg.geometry
        for row in range(geometry.worker_capacity):
            base = geometry.row_offset(row)
            if seg.atomic.cas_u64(base + layout.R_IDENTITY, 0, identity) == 0:
                claimed = cls(seg, row, identity)
                claimed._initialise(worker_index)
                return claimed
        raise WorkerTableFull(
            f"all {geometry.worker_capacity} worker rows of the shared table are taken; "
            f"raise PROXY_SHM_WORKER_CAPACITY or check that the sidecar reaps dead workers")

    def _initialise(self, worker_index: int) -> None:
        seg = self._seg
        zero = bytes(seg.geometry.contributions_size)
        seg.buf[self._contrib_base:self._contrib_base + len(zero)] = zero
        now = time.time_ns()
        for offset, value in ((layout.R_JOURNAL, JournalWord.idle(0)),
                              (layout.R_WORKER_INDEX, worker_index),
                              (layout.R_CLAIMED_AT_NS, now), (layout.R_HEARTBEAT_NS, now),
                              (layout.R_RING_TAIL, 0), (layout.R_RING_HEAD, 0),
                              (layout.R_EVENTS_DROPPED, 0)):
            seg.store(self._base + offset, value)

    @property
    def segment(self) -> Segment:
        return self._seg

    # --- the request path ------------------------------------------------------------------
    def begin(self, slot: int, generation: int) -> bool:
        """+1 on the instance's host-wide inflight and on this worker's share; False if the
        slot no longer carries `generation` (the instance vanished or was replaced)."""
        return self._apply(_INFLIGHT, slot, generation, 1, _COUNT_MASK) > 0

    def end(self, slot: int, generation: int) -> bool:
        """-1, the mirror of `begin`; a stale generation is a no-op that returns False."""
        return self._apply(_INFLIGHT, slot, generation, -1, _COUNT_MASK) > 0

    def add(self, lane: int, slot: int, generation: int) -> bool:
        return self._apply(lane, slot, generation, 1, _COUNT_MASK) > 0

    def remove(self, lane: int, slot: int, generation: int) -> bool:
        return self._apply(lane, slot, generation, -1, _COUNT_MASK) > 0

    def try_admit(self, lane: int, slot: int, generation: int, limit: int) -> Admission:
        """+1 only while the host-wide count is below `limit`: N workers together never
        exceed it."""
        return _ADMISSION_OF_RESULT[self._apply(lane, slot, generation, 1, limit)]

    def _apply(self, lane: int, slot: int, generation: int, delta: int, limit: int) -> int:
        """1 applied, 0 refused (at the limit or the floor), -1 stale generation.

        Hot path (twice per request for inflight): the CAS loop, the share update and the
        CounterWord / JournalWord formats are inlined and the atomic methods pre-bound; see
        bench/bench_select.py for its cost."""
        seq = self._op_seq + 1
        self._op_seq = seq
        journal = seq << _SEQ_SHIFT  # JournalWord.idle
        self._store(self._journal_offset, journal | (lane << _LANE_SHIFT) | (slot + 1)
                    | (_JOURNAL_END if delta < 0 else 0))  # JournalWord.pending
        index = _LANES * slot + lane
        offset = _COUNTERS + _WORD * index
        word = self._load(offset)
        result = 0
        while True:
            if word >> _GEN_SHIFT != generation:
                result = -1
                break
            count = (word & _COUNT_MASK) + delta
            if count < 0 or count > limit:
                break
            previous = self._cas(offset, word, (word & ~_COUNT_MASK) | count)
            if previous == word:
                result = 1
                break
            word = previous
        # The share records what this worker holds: an increment counts only if it landed,
        # but a decrement always gives the share back, even if the host-wide count was already
        # at its floor; otherwise a later reconcile would resurrect something nobody holds.
        if result > 0 or delta < 0:
            mirror = self._mirror[index]
            own = mirror & _COUNT_MASK if mirror >> _GEN_SHIFT == generation else 0
            if own + delta >= 0:
                mirror = (generation << _GEN_SHIFT) | (own + delta)
                self._mirror[index] = mirror
                self._store(self._contrib_base + _WORD * index, mirror)
        self._store(self._journal_offset, journal)
        return result

    def own_words(self, span: int) -> tuple[int, ...]:
        """This worker's own inflight contribution words (the per-worker ablation view)."""
        return tuple(self._mirror[_INFLIGHT:span * _LANES:_LANES])

    def heartbeat(self) -> None:
        self._atomic.store_u64(self._base + layout.R_HEARTBEAT_NS, time.time_ns())

    def release(self) -> dict[tuple[int, int], int]:
        """On a clean exit: give back whatever this worker still holds, then free the row."""
        subtracted = subtract_row(self._seg, self.row)
        free_row(self._seg, self.row, self.identity)
        return subtracted
