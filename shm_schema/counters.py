"""Host-wide per-instance counters and the per-worker rows that make them crash-safe.

A slot has a few counter lanes (inflight, ready admission, prepare/ready activity and queue
depth; see layout). A worker changes them itself (CAS, tagged with the slot generation) and
mirrors its own share in its row, so the sidecar can subtract exactly what a dead worker held.
The two writes cannot be one atomic step, so each update is bracketed by a journal word naming
lane, slot and direction: a worker killed between them is handled by subtracting so that the
count can only be left too high, then re-deriving that (lane, slot) from the live rows
(`reconcile`) at a quiescent moment.
"""

from __future__ import annotations

import enum
import struct
import time
from typing import NamedTuple

from . import layout, process_identity
from .segment import Segment

_WORD = layout.WORD
_LANES = layout.LANES
_COUNTERS = layout.COUNTERS_OFFSET
_GEN_SHIFT = layout.GEN_SHIFT
_COUNT_MASK = layout.COUNT_MASK
_SEQ_SHIFT = layout.JOURNAL_SEQ_SHIFT
_LANE_SHIFT = layout.JOURNAL_LANE_SHIFT
_JOURNAL_END = layout.JOURNAL_END_BIT
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
        """The inflight word of slots 0 .. span-1."""
        unpacker = self._inflight.get(span)
        if unpacker is None:
            unpacker = self._inflight[span] = layout.inflight_struct(span)
        return unpacker.unpack_from(self._buf, _COUNTERS)

    def lanes(self, span: int) -> tuple[int, ...]:
        """Every used lane of slots 0 .. span-1, LANES_USED words per slot."""
        unpacker = self._lanes.get(span)
        if unpacker is None:
            unpacker = self._lanes[span] = layout.lanes_struct(span)
        return unpacker.unpack_from(self._buf, _COUNTERS)



def counter_value(seg: Segment, slot: int, generation: int, lane: int = _INFLIGHT) -> int | None:
    """The count of a (slot, lane) if the slot still carries `generation`, else None."""
    word = seg.load(seg.geometry.counter_offset(slot, lane))
    return layout.word_count(word) if layout.word_generation(word) == generation else None


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
        for offset, value in ((layout.R_JOURNAL, 0), (layout.R_WORKER_INDEX, worker_index),
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

        Hot path (twice per request for inflight): the CAS loop and the share update are
        inlined and the atomic methods pre-bound; see bench/bench_select.py for its cost."""
        seq = self._op_seq + 1
        self._op_seq = seq
        journal = seq << _SEQ_SHIFT
        self._store(self._journal_offset, journal | (lane << _LANE_SHIFT) | (slot + 1)
                    | (_JOURNAL_END if delta < 0 else 0))
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
        return tuple(self._mirror[0:span * _LANES:_LANES])

    def heartbeat(self) -> None:
        self._atomic.store_u64(self._base + layout.R_HEARTBEAT_NS, time.time_ns())

    def release(self) -> dict[tuple[int, int], int]:
        """On a clean exit: give back whatever this worker still holds, then free the row."""
        subtracted = subtract_row(self._seg, self.row)
        free_row(self._seg, self.row, self.identity)
        return subtracted


class RowState(NamedTuple):
    row: int
    identity: int
    pid: int
    worker_index: int
    heartbeat_ns: int
    claimed_at_ns: int
    pending_slot: int | None
    pending_is_end: bool
    pending_lane: int
    ring_tail: int
    ring_head: int
    events_dropped: int


def read_rows(seg: Segment) -> list[RowState]:
    """Every claimed worker row."""
    rows = []
    for row in range(seg.geometry.worker_capacity):
        (identity, heartbeat, journal, index, claimed_at, tail, head,
         dropped) = layout.ROW_FIELDS.unpack_from(seg.buf, seg.geometry.row_offset(row))
        if identity:
            pid, _ = layout.unpack_identity(identity)
            rows.append(RowState(row, identity, pid, index, heartbeat, claimed_at,
                                 layout.journal_pending_slot(journal),
                                 layout.journal_pending_is_end(journal),
                                 layout.journal_pending_lane(journal), tail, head, dropped))
    return rows


def row_contributions(seg: Segment, row: int, lane: int | None = _INFLIGHT) -> dict:
    """Non-zero shares of a row: slot -> (generation, count) for one lane, or
    (slot, lane) -> (generation, count) for every lane when `lane` is None."""
    geometry = seg.geometry
    words = geometry.contributions_struct(geometry.instance_capacity).unpack_from(
        seg.buf, geometry.contributions_base(row))
    shares = {}
    for index, word in enumerate(words):
        if layout.word_count(word):
            slot, word_lane = divmod(index, _LANES)
            if lane is None:
                shares[(slot, word_lane)] = (layout.word_generation(word), layout.word_count(word))
            elif word_lane == lane:
                shares[slot] = (layout.word_generation(word), layout.word_count(word))
    return shares


def subtract_row(seg: Segment, row: int, landed_decrement: tuple[int, int] | None = None
                 ) -> dict[tuple[int, int], int]:
    """Subtract a row's shares (every lane, same generation only) and zero them.

    `landed_decrement` names a (slot, lane) whose decrement may have reached the host-wide
    count but not the share (the row died between the two writes): one less is subtracted
    there, so the count can only be left one too high (reconcile lowers it), never too low.
    Returns (slot, lane) -> amount subtracted."""
    subtracted: dict[tuple[int, int], int] = {}
    geometry = seg.geometry
    for (slot, lane), (generation, count) in row_contributions(seg, row, lane=None).items():
        if (slot, lane) == landed_decrement:
            count -= 1
        offset = geometry.counter_offset(slot, lane)
        word = seg.load(offset)
        while count > 0 and layout.word_generation(word) == generation:
            remaining = max(0, layout.word_count(word) - count)
            previous = seg.atomic.cas_u64(offset, word, layout.pack_word(generation, remaining))
            if previous == word:
                subtracted[(slot, lane)] = layout.word_count(word) - remaining
                break
            word = previous
        seg.store(geometry.contribution_offset(row, slot, lane), 0)
    return subtracted


def free_row(seg: Segment, row: int, identity: int) -> bool:
    """Release a row for reuse, if it still belongs to `identity`. The row's count of dropped
    events moves to the header first, so "no event lost" survives the worker that lost some."""
    base = seg.geometry.row_offset(row)
    if seg.load(base + layout.R_IDENTITY) != identity:
        return False
    dropped = seg.atomic.exchange_u64(base + layout.R_EVENTS_DROPPED, 0)
    if dropped:
        seg.fetch_add(layout.H_EVENTS_DROPPED_GONE, dropped)
    seg.store(base + layout.R_JOURNAL, 0)
    return seg.atomic.cas_u64(base + layout.R_IDENTITY, identity, 0) == identity


def take_row(seg: Segment, row: int, dead_identity: int, reaper_identity: int) -> bool:
    """Take a dead worker's row for reaping; False if it no longer belongs to `dead_identity`
    (already reaped, or released and claimed by a new worker since it was scanned)."""
    base = seg.geometry.row_offset(row) + layout.R_IDENTITY
    return seg.atomic.cas_u64(base, dead_identity, reaper_identity) == dead_identity


class Reaped(NamedTuple):
    subtracted: dict[tuple[int, int], int]
    pending: tuple[int, int] | None  # (slot, lane) left mid-update: reconcile it


def reap_row(seg: Segment, row: int, dead_identity: int, reaper_identity: int,
             taken: bool = False) -> Reaped | None:
    """Subtract a dead worker's shares and free its row. Ownership is taken by CAS *before*
    anything is subtracted (unless the caller already took it: `taken`)."""
    if not taken and not take_row(seg, row, dead_identity, reaper_identity):
        return None
    journal = seg.load(seg.geometry.row_offset(row) + layout.R_JOURNAL)
    slot = layout.journal_pending_slot(journal)
    pending = None if slot is None else (slot, layout.journal_pending_lane(journal))
    landed = pending if layout.journal_pending_is_end(journal) else None
    subtracted = subtract_row(seg, row, landed)
    free_row(seg, row, reaper_identity)
    return Reaped(subtracted, pending)


def reconcile(seg: Segment, slot: int, lane: int = _INFLIGHT) -> int | None:
    """Make a (slot, lane) count equal the sum of the claimed rows' shares.

    Only acts on a quiescent moment: no row has an update half done, and nothing changed
    between two reads around the counter word; the final CAS fails if anything moved since.
    Returns the correction applied (0 if none was needed), or None if the slot was busy."""
    geometry = seg.geometry
    before = _row_states_for(seg, slot, lane)
    if before is None:
        return None
    offset = geometry.counter_offset(slot, lane)
    word = seg.load(offset)
    after = _row_states_for(seg, slot, lane)
    if after != before:
        return None
    generation = layout.word_generation(word)
    expected = sum(layout.word_count(c) for _, c in before if layout.word_generation(c) == generation)
    correction = expected - layout.word_count(word)
    if correction == 0:
        return 0
    if seg.atomic.cas_u64(offset, word, layout.pack_word(generation, expected)) != word:
        return None
    seg.fetch_add(layout.H_RECONCILE_COUNT, 1)
    return correction


def reconcile_slot(seg: Segment, slot: int) -> int | None:
    """Reconcile every lane of a slot; the sum of corrections, or None if any lane was busy."""
    total = 0
    for lane in range(layout.LANES_USED):
        correction = reconcile(seg, slot, lane)
        if correction is None:
            return None
        total += correction
    return total


def _row_states_for(seg: Segment, slot: int, lane: int) -> list[tuple[int, int]] | None:
    """(journal, contribution word) of every claimed row for one (slot, lane); None if any row
    is in the middle of an update."""
    geometry = seg.geometry
    states = []
    for row in range(geometry.worker_capacity):
        base = geometry.row_offset(row)
        if not seg.load(base + layout.R_IDENTITY):
            continue
        journal = seg.load(base + layout.R_JOURNAL)
        if layout.journal_pending_slot(journal) is not None:
            return None
        states.append((journal, seg.load(geometry.contribution_offset(row, slot, lane))))
    return states
