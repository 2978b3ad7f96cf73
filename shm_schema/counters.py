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
import itertools
import struct
import time
from typing import Any, Callable

from . import layout, process_identity
from .bitfields import CounterWord, JournalWord
from .repair import free_row, subtract_row
from .segment import Segment

try:  # the update path in C (shm_schema/_lanes.c), built by `pip install` where a compiler is
    from ._lanes import Updater as _NativeUpdater
except ImportError:  # pragma: no cover - no compiler at install: the Python closures below
    _NativeUpdater = None

NATIVE_UPDATES = _NativeUpdater is not None

# The hot path (WorkerRow._update) inlines these instead of calling the bitfields methods.
_WORD = layout.WORD
_LANES = layout.LANES
_COUNTERS = layout.COUNTERS_OFFSET
_HALF = _WORD // 2  # a CounterWord's count and generation halves (CounterWord.HALVES)
_GEN_SHIFT = CounterWord.GENERATION_SHIFT
_COUNT_MASK = CounterWord.COUNT_MASK
_SEQ_SHIFT = JournalWord.SEQUENCE_SHIFT
_LANE_SHIFT = JournalWord.LANE_SHIFT
_JOURNAL_END = JournalWord.END_BIT
_INFLIGHT = layout.LANE_INFLIGHT
_DIRECTORY_SEQ = layout.H_DIRECTORY_SEQ


class WorkerTableFull(RuntimeError):
    pass


class Admission(enum.IntEnum):
    ADMITTED = 1
    FULL = 0    # the lane is at its limit: wait and try again
    STALE = -1  # the slot no longer carries the generation: the instance is gone


# An update's result (1 applied, 0 refused, -1 stale) -> what the caller returns, by index:
# an Enum call by value costs about a microsecond.
_ADMISSION_OF_RESULT = (Admission.FULL, Admission.ADMITTED, Admission.STALE)
_APPLIED = (False, True, False)


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

    # Where the words are in the segment, for a reader in C (cacheroute_proxy/routing/_least_load.c).
    # A CounterWord read as its two native 32-bit halves (CounterWord.HALVES) is two loads: such a
    # reader checks the directory sequence after them, since a slot's generation changes only
    # inside the directory's write bracket (DirectoryWriter resets the slot's counters there).
    directory_seq_offset = _DIRECTORY_SEQ

    @staticmethod
    def count_offset(slot: int, lane: int) -> int:
        """The byte offset of (slot, lane)'s count half."""
        return layout.counter_offset(slot, lane) + _HALF * CounterWord.HALVES.index("count")

    @staticmethod
    def generation_offset(slot: int) -> int:
        """The byte offset of the slot's generation half (its inflight word's)."""
        return layout.counter_offset(slot, _INFLIGHT) + _HALF * CounterWord.HALVES.index("generation")


def counter_value(seg: Segment, slot: int, generation: int, lane: int = _INFLIGHT) -> int | None:
    """The count of a (slot, lane) if the slot still carries `generation`, else None."""
    return CounterWord.count_under(seg.atomic.load_u64(layout.counter_offset(slot, lane)), generation)


def claimed_rows(seg: Segment) -> list[int]:
    """The worker rows a process holds now (identity not 0): one load a row."""
    geometry, load = seg.geometry, seg.load
    return [row for row in range(geometry.worker_capacity)
            if load(geometry.row_offset(row) + layout.R_IDENTITY)]


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
        # JournalWord.idle(1), idle(2), ...: the journal between operations, one more each time.
        self._next_journal = itertools.count(JournalWord.idle(1), JournalWord.idle(1)).__next__
        # Process-local mirror of this row's contribution words (single writer: this process),
        # for the Python closures; the C updater reads the words themselves.
        self._mirror: list[int] = [0] * (geometry.instance_capacity * _LANES)
        self._own_inflight: dict[int, struct.Struct] = {}
        self._bind_updates()

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
    # begin and end are bound per row in __init__ (`_update`): they run twice per request, and
    # a closure over the row's offsets and atomic functions saves the method call into a
    # shared `_apply` and every attribute lookup of the row.
    begin: Callable[[int, int], bool]
    """+1 on the instance's host-wide inflight and on this worker's share; False if the
    slot no longer carries `generation` (the instance vanished or was replaced)."""
    end: Callable[[int, int], bool]
    """-1, the mirror of `begin`; a stale generation is a no-op that returns False."""

    def add(self, lane: int, slot: int, generation: int) -> bool:
        return self._adds[lane](slot, generation)

    def remove(self, lane: int, slot: int, generation: int) -> bool:
        return self._removes[lane](slot, generation)

    def try_admit(self, lane: int, slot: int, generation: int, limit: int) -> Admission:
        """+1 only while the host-wide count is below `limit`: N workers together never
        exceed it."""
        return self._admits[lane](slot, generation, limit)

    def _bind_updates(self, native: bool = NATIVE_UPDATES) -> None:
        """Every lane's updates, from one journal sequence: the C updater's ops where it was
        built (`native`), the Python closures of `_update` otherwise. Both do the same steps
        in the same order (tests/test_lane_updates.py holds them word for word); a row that
        changes path carries the sequence and its shares over."""
        updater = getattr(self, "_updater", None)
        if updater is not None and getattr(self, "_native", native) != native:
            step = JournalWord.idle(1)  # one sequence for both paths
            if native:
                updater.journal = self._next_journal() - step
            else:  # and the closures' mirror of the shares, which the C ops wrote
                self._next_journal = itertools.count(updater.journal + step, step).__next__
                self._mirror[:] = struct.unpack_from(f"@{len(self._mirror)}Q", self._seg.buf,
                                                     self._contrib_base)
        self._native = native
        update = self._native_update if native else self._update
        self.begin = update(_INFLIGHT, 1, _APPLIED)
        self.end = update(_INFLIGHT, -1, _APPLIED)
        lanes = range(layout.LANES_USED)
        self._adds = tuple(update(lane, 1, _APPLIED) for lane in lanes)
        self._removes = tuple(update(lane, -1, _APPLIED) for lane in lanes)
        self._admits = tuple(update(lane, 1, _ADMISSION_OF_RESULT) for lane in lanes)

    def _native_update(self, lane: int, delta: int, results: tuple) -> Callable[..., Any]:
        updater = getattr(self, "_updater", None)
        if updater is None:
            assert _NativeUpdater is not None
            step = JournalWord.idle(1)
            updater = self._updater = _NativeUpdater(
                self._seg.buf, self._journal_offset, self._contrib_base, _COUNTERS,
                self._next_journal() - step, step, _LANES, _GEN_SHIFT, _COUNT_MASK,
                _LANE_SHIFT, _JOURNAL_END)
            self._seg.on_close(updater.close)  # it holds the segment's buffer
        return updater.bind(lane, delta, results)

    def _update(self, lane: int, delta: int, results: tuple) -> Callable[..., Any]:
        """`update(slot, generation, limit=COUNT_MASK)`: `delta` on (slot, lane) and on this
        worker's share, then `results[r]` for r = 1 applied, 0 refused (at the limit or the
        floor), -1 stale generation.

        The hot path: the CAS loop, the share update and the CounterWord / JournalWord formats
        are inlined, every constant and atomic function is a closure variable (see
        bench/bench_select.py for its cost). A word carries `generation` exactly when
        `word - (generation << GENERATION_SHIFT)` is a count (0 .. COUNT_MASK), and within the
        limits adding `delta` to the word changes the count alone: one big-int operation where
        decoding both fields and packing them again took four."""
        load, store, cas = self._load, self._store, self._cas
        journal_offset, contrib_base, mirror = self._journal_offset, self._contrib_base, self._mirror
        next_journal = self._next_journal
        # JournalWord.pending without the slot: (slot + 1) is added per call.
        pending = (lane << _LANE_SHIFT) | (_JOURNAL_END if delta < 0 else 0) | 1
        decrement = delta < 0

        def update(slot: int, generation: int, limit: int = _COUNT_MASK) -> Any:
            journal = next_journal()
            store(journal_offset, journal | (pending + slot))
            index = _LANES * slot + lane
            offset = _COUNTERS + _WORD * index
            tag = generation << _GEN_SHIFT
            word = load(offset)
            result = 0
            while True:
                count = word - tag
                if count < 0 or count > _COUNT_MASK:
                    result = -1
                    break
                count += delta
                if count < 0 or count > limit:
                    break
                previous = cas(offset, word, word + delta)
                if previous == word:
                    result = 1
                    break
                word = previous
            # The share records what this worker holds: an increment counts only if it landed,
            # but a decrement always gives the share back, even if the host-wide count was
            # already at its floor; otherwise a later reconcile would resurrect something
            # nobody holds.
            if result > 0 or decrement:
                share = mirror[index]
                own = share - tag
                if own < 0 or own > _COUNT_MASK:  # a share of another generation is 0
                    share, own = tag, 0
                if own + delta >= 0:
                    share += delta
                    mirror[index] = share
                    store(contrib_base + _WORD * index, share)
            store(journal_offset, journal)
            return results[result]
        return update

    def own_words(self, span: int) -> tuple[int, ...]:
        """This worker's own inflight contribution words (the per-worker ablation view): plain
        reads of words only this process writes."""
        unpacker = self._own_inflight.get(span)
        if unpacker is None:
            unpacker = self._own_inflight[span] = layout.inflight_struct(span)
        return unpacker.unpack_from(self._seg.buf, self._contrib_base)

    def heartbeat(self) -> None:
        self._atomic.store_u64(self._base + layout.R_HEARTBEAT_NS, time.time_ns())

    def release(self) -> dict[tuple[int, int], int]:
        """On a clean exit: give back whatever this worker still holds, then free the row."""
        subtracted = subtract_row(self._seg, self.row)
        free_row(self._seg, self.row, self.identity)
        return subtracted
