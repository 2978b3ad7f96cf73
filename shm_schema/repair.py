"""The sidecar's repair of the counters: reading worker rows, giving back what a departed
worker held, and re-deriving a count from the live rows.

A worker killed between its two writes (the host-wide count and its own share, see
`counters`) leaves its journal naming the (slot, lane). Its shares are subtracted so that the
count can only be left too high, never too low, and that (slot, lane) is then made equal to
the sum of the live rows' shares (`reconcile`) at a quiescent moment. A worker's clean exit
goes through the same subtraction (WorkerRow.release).
"""

from __future__ import annotations

from typing import NamedTuple

from . import header, layout
from .bitfields import CounterWord, JournalWord, ProcessIdentity
from .records import ROW_HEADER
from .segment import Segment

_LANES = layout.LANES
_INFLIGHT = layout.LANE_INFLIGHT


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
    unpack, identity = ROW_HEADER.struct.unpack_from, ROW_HEADER.index.identity
    for row in range(seg.geometry.worker_capacity):
        words = unpack(seg.buf, seg.geometry.row_offset(row))
        if words[identity]:  # decoded by name only for claimed rows: the sidecar scans often
            fields = ROW_HEADER.make(words)
            journal = fields.journal
            rows.append(RowState(row, fields.identity, ProcessIdentity.pid(fields.identity),
                                 fields.worker_index, fields.heartbeat_ns, fields.claimed_at_ns,
                                 JournalWord.pending_slot(journal),
                                 JournalWord.pending_is_end(journal),
                                 JournalWord.pending_lane(journal), fields.ring_tail,
                                 fields.ring_head, fields.events_dropped))
    return rows


def row_contributions(seg: Segment, row: int, lane: int | None = _INFLIGHT) -> dict:
    """Non-zero shares of a row: slot -> (generation, count) for one lane, or
    (slot, lane) -> (generation, count) for every lane when `lane` is None."""
    geometry = seg.geometry
    words = geometry.contributions_struct(geometry.instance_capacity).unpack_from(
        seg.buf, geometry.contributions_base(row))
    shares = {}
    for index, word in enumerate(words):
        count = CounterWord.count(word)
        if count:
            slot, word_lane = divmod(index, _LANES)
            if lane is None:
                shares[(slot, word_lane)] = (CounterWord.generation(word), count)
            elif word_lane == lane:
                shares[slot] = (CounterWord.generation(word), count)
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
        while count > 0 and CounterWord.generation(word) == generation:
            remaining = max(0, CounterWord.count(word) - count)
            previous = seg.atomic.cas_u64(offset, word, CounterWord.pack(generation, remaining))
            if previous == word:
                subtracted[(slot, lane)] = CounterWord.count(word) - remaining
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
        header.add_events_dropped_gone(seg, dropped)
    seg.store(base + layout.R_JOURNAL, JournalWord.idle(0))
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
    slot = JournalWord.pending_slot(journal)
    pending = None if slot is None else (slot, JournalWord.pending_lane(journal))
    landed = pending if JournalWord.pending_is_end(journal) else None
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
    generation = CounterWord.generation(word)
    expected = sum(CounterWord.count(share) for _, share in before
                   if CounterWord.generation(share) == generation)
    correction = expected - CounterWord.count(word)
    if correction == 0:
        return 0
    if seg.atomic.cas_u64(offset, word, CounterWord.pack(generation, expected)) != word:
        return None
    header.count_reconcile_correction(seg)
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
        if JournalWord.pending_slot(journal) is not None:
            return None
        states.append((journal, seg.load(geometry.contribution_offset(row, slot, lane))))
    return states
