"""Host-wide inflight counters and the per-worker rows that make them crash-safe.

A worker changes an instance's inflight word itself (CAS, tagged with the slot generation),
and mirrors its own share in its row, so the sidecar can subtract exactly what a dead worker
held. The two writes cannot be one atomic step, so each begin/end is bracketed by a journal
word: a worker killed between them leaves the slot named in its journal, and the sidecar then
re-derives that slot's count from the live rows (`reconcile_slot`) instead of guessing.
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

from . import layout, process_identity
from .segment import Segment


_INFLIGHT = layout.INFLIGHT_OFFSET
_WORD = layout.WORD
_GEN_SHIFT = layout.GEN_SHIFT
_COUNT_MASK = layout.COUNT_MASK
_JOURNAL_SHIFT = layout.JOURNAL_SLOT_BITS
_JOURNAL_END = layout.JOURNAL_END_BIT


class WorkerTableFull(RuntimeError):
    pass


class InflightReader:
    """Plain loads of the contiguous inflight words: one struct call, no lock, no syscall."""

    def __init__(self, seg: Segment) -> None:
        self._buf = seg.buf
        self._structs: dict[int, struct.Struct] = {}

    def words(self, span: int) -> tuple[int, ...]:
        unpacker = self._structs.get(span)
        if unpacker is None:
            unpacker = self._structs[span] = struct.Struct(f"@{span}Q")
        return unpacker.unpack_from(self._buf, layout.INFLIGHT_OFFSET)


def inflight_count(seg: Segment, slot: int, generation: int) -> int | None:
    """The count of `slot` if it still carries `generation`, else None."""
    word = seg.load(seg.geometry.inflight_offset(slot))
    return layout.word_count(word) if layout.word_generation(word) == generation else None


class WorkerRow:
    """A worker's claimed row: its begin/end path and its own contributions."""

    def __init__(self, seg: Segment, row: int, identity: int) -> None:
        self._seg = seg
        self._atomic = seg.atomic
        self.row = row
        self.identity = identity
        geometry = seg.geometry
        self._base = geometry.row_offset(row)
        self._journal_offset = self._base + layout.R_JOURNAL
        self._contrib_base = geometry.contributions_base(row)
        self._load = seg.atomic.load_u64
        self._store = seg.atomic.store_u64
        self._cas = seg.atomic.cas_u64
        self._op_seq = 0
        # Process-local mirror of this row's contribution words (single writer: this process).
        self._mirror: list[int] = [0] * geometry.instance_capacity
        self._structs: dict[int, struct.Struct] = {}

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
        zero = bytes(layout.WORD * seg.geometry.instance_capacity)
        seg.buf[self._contrib_base:self._contrib_base + len(zero)] = zero
        now = time.time_ns()
        for offset, value in ((layout.R_JOURNAL, 0), (layout.R_WORKER_INDEX, worker_index),
                              (layout.R_CLAIMED_AT_NS, now), (layout.R_HEARTBEAT_NS, now)):
            seg.store(self._base + offset, value)

    # --- the request path ------------------------------------------------------------------
    def begin(self, slot: int, generation: int) -> bool:
        """+1 on the instance's host-wide count and on this worker's share; False if the
        slot no longer carries `generation` (the instance vanished or was replaced)."""
        return self._apply(slot, generation, +1)

    def end(self, slot: int, generation: int) -> bool:
        """-1, the mirror of `begin`; a stale generation is a no-op that returns False."""
        return self._apply(slot, generation, -1)

    def _apply(self, slot: int, generation: int, delta: int) -> bool:
        # Hot path (every request runs it twice): the CAS loop and the share update are
        # inlined and the atomic methods pre-bound; see bench/bench_select.py for its cost.
        seq = self._op_seq + 1
        self._op_seq = seq
        journal = seq << _JOURNAL_SHIFT
        self._store(self._journal_offset, journal | (slot + 1) | (_JOURNAL_END if delta < 0 else 0))
        offset = _INFLIGHT + _WORD * slot
        word = self._load(offset)
        applied = False
        while word >> _GEN_SHIFT == generation:
            count = (word & _COUNT_MASK) + delta
            if count < 0 or count > _COUNT_MASK:
                break
            previous = self._cas(offset, word, (word & ~_COUNT_MASK) | count)
            if previous == word:
                applied = True
                break
            word = previous
        # The share records what this worker holds: a begin counts only if it landed, but an
        # end always gives the lease back, even if the host-wide count was already at its
        # floor; otherwise a later reconcile would resurrect a lease nobody holds.
        if applied or delta < 0:
            mirror = self._mirror[slot]
            own = mirror & _COUNT_MASK if mirror >> _GEN_SHIFT == generation else 0
            if own + delta >= 0:
                mirror = (generation << _GEN_SHIFT) | (own + delta)
                self._mirror[slot] = mirror
                self._store(self._contrib_base + _WORD * slot, mirror)
        self._store(self._journal_offset, journal)
        return applied

    def own_words(self, span: int) -> tuple[int, ...]:
        """This worker's own contribution words (the per-worker ablation view)."""
        return tuple(self._mirror[:span])

    def heartbeat(self) -> None:
        self._atomic.store_u64(self._base + layout.R_HEARTBEAT_NS, time.time_ns())

    def release(self) -> dict[int, int]:
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


def read_rows(seg: Segment) -> list[RowState]:
    """Every claimed worker row."""
    rows = []
    for row in range(seg.geometry.worker_capacity):
        identity, heartbeat, journal, index, claimed_at = layout.ROW_FIELDS.unpack_from(
            seg.buf, seg.geometry.row_offset(row))
        if identity:
            pid, _ = layout.unpack_identity(identity)
            rows.append(RowState(row, identity, pid, index, heartbeat, claimed_at,
                                 layout.journal_pending_slot(journal),
                                 layout.journal_pending_is_end(journal)))
    return rows


def row_contributions(seg: Segment, row: int) -> dict[int, tuple[int, int]]:
    """slot -> (generation, count) for every non-zero share in a row."""
    cap = seg.geometry.instance_capacity
    words = seg.geometry.contributions_struct(cap).unpack_from(seg.buf, seg.geometry.contributions_base(row))
    return {slot: (layout.word_generation(w), layout.word_count(w))
            for slot, w in enumerate(words) if layout.word_count(w)}


def subtract_row(seg: Segment, row: int, landed_end: int | None = None) -> dict[int, int]:
    """Subtract a row's shares from the host-wide counts (same generation only) and zero them.

    `landed_end` names a slot whose end may have reached the host-wide count but not the
    share (the row died between the two writes): one less is subtracted there, so the count
    can only be left one too high (reconcile lowers it), never too low. Returns slot -> amount
    subtracted."""
    subtracted: dict[int, int] = {}
    for slot, (generation, count) in row_contributions(seg, row).items():
        if slot == landed_end:
            count -= 1
        offset = seg.geometry.inflight_offset(slot)
        word = seg.load(offset)
        while count > 0 and layout.word_generation(word) == generation:
            remaining = max(0, layout.word_count(word) - count)
            previous = seg.atomic.cas_u64(offset, word, layout.pack_word(generation, remaining))
            if previous == word:
                subtracted[slot] = layout.word_count(word) - remaining
                break
            word = previous
        seg.store(seg.geometry.contribution_offset(row, slot), 0)
    return subtracted


def free_row(seg: Segment, row: int, identity: int) -> bool:
    """Release a row for reuse, if it still belongs to `identity`."""
    base = seg.geometry.row_offset(row)
    seg.store(base + layout.R_JOURNAL, 0)
    return seg.atomic.cas_u64(base + layout.R_IDENTITY, identity, 0) == identity


class Reaped(NamedTuple):
    subtracted: dict[int, int]
    pending_slot: int | None  # a slot left mid-update: reconcile it


def reap_row(seg: Segment, row: int, dead_identity: int, reaper_identity: int) -> Reaped | None:
    """Take a dead worker's row, subtract its shares, free it. None if the row no longer
    belongs to `dead_identity` (already reaped, or released and claimed by a new worker
    since it was scanned): ownership is taken by CAS *before* anything is subtracted."""
    base = seg.geometry.row_offset(row)
    if seg.atomic.cas_u64(base + layout.R_IDENTITY, dead_identity, reaper_identity) != dead_identity:
        return None
    journal = seg.load(base + layout.R_JOURNAL)
    pending = layout.journal_pending_slot(journal)
    landed_end = pending if layout.journal_pending_is_end(journal) else None
    subtracted = subtract_row(seg, row, landed_end)
    free_row(seg, row, reaper_identity)
    return Reaped(subtracted, pending)


def reconcile_slot(seg: Segment, slot: int) -> int | None:
    """Make a slot's host-wide count equal the sum of the claimed rows' shares.

    Only acts on a quiescent moment: no row has an operation half done, and nothing changed
    between two reads around the inflight word; the final CAS fails if anything moved since.
    Returns the correction applied (0 if none was needed), or None if the slot was busy."""
    geometry = seg.geometry
    before = _row_states_for(seg, slot)
    if before is None:
        return None
    word = seg.load(geometry.inflight_offset(slot))
    after = _row_states_for(seg, slot)
    if after != before:
        return None
    generation = layout.word_generation(word)
    expected = sum(layout.word_count(c) for _, c in before
                   if layout.word_generation(c) == generation)
    correction = expected - layout.word_count(word)
    if correction == 0:
        return 0
    if seg.atomic.cas_u64(geometry.inflight_offset(slot), word, layout.pack_word(generation, expected)) != word:
        return None
    seg.fetch_add(layout.H_RECONCILE_COUNT, 1)
    return correction


def _row_states_for(seg: Segment, slot: int) -> list[tuple[int, int]] | None:
    """(journal, contribution word) of every claimed row for one slot; None if any row is
    in the middle of an operation."""
    geometry = seg.geometry
    states = []
    for row in range(geometry.worker_capacity):
        base = geometry.row_offset(row)
        if not seg.load(base + layout.R_IDENTITY):
            continue
        journal = seg.load(base + layout.R_JOURNAL)
        if layout.journal_pending_slot(journal) is not None:
            return None
        states.append((journal, seg.load(geometry.contribution_offset(row, slot))))
    return states
