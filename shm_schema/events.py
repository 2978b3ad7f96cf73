"""Worker -> sidecar events: one single-producer/single-consumer ring per worker row.

Why rings in the segment: a POSIX message queue holds 10 messages here and an AF_UNIX datagram
socket about 11, far too shallow for bursts. A ring of `ring_capacity` fixed 64-byte records
(records.EventRecord) costs one struct write and one atomic store per event, never blocks, and
survives a sidecar restart. When the ring is full the worker keeps events in a bounded local
spill, in order, and moves them in as the sidecar catches up; only when the spill is full too
is an event dropped, and then it is counted in the row (`events_dropped`, shown in
/debug/status).

A writer given a `wake` calls it after publishing an event while the header says the sidecar
sleeps (header.set_sidecar_sleeping): the worker's doorbell ring. FIRST_TOKEN and COMPLETE are
quiet (and RESERVE and PREFIX too for a writer made with `ring_requests=False`), since a wake
costs the sidecar about as much CPU as the tick: they wait for the next tick
(the next ringing event, any worker's, or the snapshot heartbeat). The timeline already
predicts the prefill's end, which a first token only corrects; and a reader of the snapshot
sees a completion it does not count yet in the live inflight counters, below what the snapshot
announces (routing.load_view takes those off the predicted wait).

Events carry the sidecar epoch they were written under; a restarted sidecar (new epoch)
discards older ones and the workers re-send the state of every request still in flight.

The writer has one method per kind, with that kind's payload as named parameters. The
sidecar reads with `EventReader.consume`: one struct call per contiguous span of the ring, then
one loop that decodes each record's words and calls the handler of its kind (EventHandlers),
building no object per event; `drain` yields `Event`s with the payload by name, for the rare
kinds and for tests (RESIDENT and PREFIX carry records.ResidencyPayload in the four payload
words: `residency(event)` names them). Both sides pack the record in EventRecord's field order
with the EventTag / SlotGeneration formats inlined: three events per streamed request, so no
record object is built on either path.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, NamedTuple

from . import layout
from .bitfields import EventTag, SlotGeneration
from .records import EVENT, WORD, EventKind, ResidencyPayload
from .segment import Segment

try:  # the ring write in C (shm_schema/_ring.c), built by `pip install` where a compiler is
    from ._ring import RingWriter as _NativeRing
except ImportError:  # pragma: no cover - no compiler at install: PythonRing below
    _NativeRing = None

NATIVE_RING = _NativeRing is not None

__all__ = ["NATIVE_RING", "Event", "EventHandlers", "EventKind", "EventReader", "EventWriter",
           "PythonRing", "residency"]

_PACK_INTO = EVENT.struct.pack_into
_SIZE = EVENT.size
_RECORD_WORDS = _SIZE // WORD
_EPOCH_SHIFT = EventTag.EPOCH_SHIFT
_KIND_MASK = EventTag.KIND_MASK
_SLOT_SHIFT = SlotGeneration.SLOT_SHIFT
_GENERATION_MASK = SlotGeneration.GENERATION_MASK
_RESERVE = int(EventKind.RESERVE)
_FIRST_TOKEN = int(EventKind.FIRST_TOKEN)
_COMPLETE = int(EventKind.COMPLETE)
_RESYNC = int(EventKind.RESYNC)
_RESIDENT = int(EventKind.RESIDENT)
# A row header's words the sidecar scans on every poll, as word indexes within the row.
_IDENTITY = layout.R_IDENTITY // WORD
_TAIL = layout.R_RING_TAIL // WORD
_HEAD = layout.R_RING_HEAD // WORD
_DROPPED = layout.R_EVENTS_DROPPED // WORD
_PREFIX = int(EventKind.PREFIX)
_SLEEPING = layout.H_SIDECAR_SLEEPING


class Event(NamedTuple):
    """A decoded event. The payload fields are those of records.ReservePayload (RESERVE,
    RESYNC) and records.CompletePayload (COMPLETE); the others are 0 / False."""
    kind: int
    epoch: int
    request_key: int
    slot: int
    generation: int
    t_us: int
    service_us: int = 0
    decode_us: int = 0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    failed: bool = False


class EventWriter:
    """The worker side (single producer) of one row's ring, with a bounded local spill.

    Every write never blocks and returns False only if the event had to be dropped (counted).
    """

    def __init__(self, seg: Segment, row: int, spill_limit: int = 65536,
                 wake: Callable[[], None] | None = None, ring_requests: bool = True,
                 native: bool = NATIVE_RING) -> None:
        geometry = seg.geometry
        self._fetch_add = seg.atomic.fetch_add_u64
        base = geometry.row_offset(row)
        self._dropped_offset = base + layout.R_EVENTS_DROPPED
        # `wake` is rung after an event is published while the sidecar sleeps
        # (header.set_sidecar_sleeping); ring_requests=False: a request's RESERVE and PREFIX
        # ring no one.
        self._ring_requests = ring_requests
        where = (base + layout.R_RING_TAIL, base + layout.R_RING_HEAD, _SLEEPING,
                 geometry.ring_offset(row), geometry.ring_capacity, _RECORD_WORDS, wake)
        if native:
            assert _NativeRing is not None
            ring: Any = _NativeRing(seg.buf, *where)
            seg.on_close(ring.close)  # it holds the segment's buffer
        else:
            ring = PythonRing(seg, *where)
        self._ring = ring
        # put(record, wakes=True) -> False when the ring is full: one call an event.
        self._put: Callable[..., bool] = ring.put
        self._spill: collections.deque[tuple[int, ...]] = collections.deque()
        self._spill_limit = spill_limit
        self.dropped = 0

    @property
    def written(self) -> int:
        """Events this writer published into the ring."""
        return self._ring.written

    @property
    def spilled(self) -> int:
        return len(self._spill)

    # --- one method per kind ----------------------------------------------------------------
    def reserve(self, epoch: int, request_key: int, slot: int, generation: int, t_us: int,
                service_us: int, decode_us: int, decode_tokens: int, prompt_tokens: int) -> bool:
        """Released to ready: the request takes its place on the instance's timeline."""
        record = (_RESERVE | (epoch << _EPOCH_SHIFT), request_key, (slot << _SLOT_SHIFT) | generation,
                  t_us, service_us, decode_us, decode_tokens, prompt_tokens)
        return (not self._spill and self._put(record, self._ring_requests)) or self._spill_or_drop(record)

    def resync(self, epoch: int, request_key: int, slot: int, generation: int, reserved_at_us: int,
               service_us: int, decode_us: int, decode_tokens: int, prompt_tokens: int) -> bool:
        """A live request re-announced to a new sidecar, as it was reserved."""
        record = (_RESYNC | (epoch << _EPOCH_SHIFT), request_key, (slot << _SLOT_SHIFT) | generation,
                  reserved_at_us, service_us, decode_us, decode_tokens, prompt_tokens)
        return (not self._spill and self._put(record)) or self._spill_or_drop(record)

    def first_token(self, epoch: int, request_key: int, slot: int, generation: int, t_us: int) -> bool:
        """Quiet: it wakes no sleeping sidecar (see the module's docstring)."""
        record = (_FIRST_TOKEN | (epoch << _EPOCH_SHIFT), request_key,
                  (slot << _SLOT_SHIFT) | generation, t_us, 0, 0, 0, 0)
        return (not self._spill and self._put(record, False)) or self._spill_or_drop(record)

    def complete(self, epoch: int, request_key: int, slot: int, generation: int, t_us: int,
                 failed: bool) -> bool:
        """Finished (`failed` False) or failed/cancelled: the reservation goes away. Quiet, as a
        first token (see the module's docstring)."""
        record = (_COMPLETE | (epoch << _EPOCH_SHIFT), request_key,
                  (slot << _SLOT_SHIFT) | generation, t_us, int(failed), 0, 0, 0)
        return (not self._spill and self._put(record, False)) or self._spill_or_drop(record)

    def resident(self, epoch: int, slot: int, generation: int, t_us: int, keys: tuple[int, ...],
                 tokens_each: int) -> bool:
        """The instance acknowledged the KV of up to three knowledge ids (their key hashes)."""
        return self._residency(_RESIDENT, epoch, slot, generation, t_us, keys, tokens_each)

    def prefix(self, epoch: int, slot: int, generation: int, t_us: int, keys: tuple[int, ...],
               tokens_each: int, prompt_blocks: int = 0) -> bool:
        """Up to three prompt-prefix blocks (their chained hashes) were forwarded to the instance;
        `prompt_blocks`, in the event whose first key is the prompt's first block, is the
        prompt's size in blocks (the sidecar weighs and fits the prompt's homes by it), else 0."""
        return self._residency(_PREFIX, epoch, slot, generation, t_us, keys, tokens_each, prompt_blocks,
                               wakes=self._ring_requests)

    def _residency(self, kind: int, epoch: int, slot: int, generation: int, t_us: int,
                   keys: tuple[int, ...], tokens_each: int, prompt_blocks: int = 0,
                   wakes: bool = True) -> bool:
        if not 1 <= len(keys) <= 3:
            raise ValueError(f"a residency event carries 1 to 3 keys, not {len(keys)}")
        padded = (*keys, 0, 0)[:3]
        record = (kind | (epoch << _EPOCH_SHIFT), prompt_blocks, (slot << _SLOT_SHIFT) | generation,
                  t_us, *padded, tokens_each)
        return (not self._spill and self._put(record, wakes)) or self._spill_or_drop(record)

    # --- the ring and the spill ---------------------------------------------------------------
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

    def _spill_or_drop(self, record: tuple[int, ...]) -> bool:
        """The ring is full, or older events wait in the spill: keep order behind them."""
        if len(self._spill) >= self._spill_limit:
            self.dropped += 1
            self._fetch_add(self._dropped_offset, 1)
            return False
        self._spill.append(record)
        self.flush()
        return True


class PythonRing:
    """The C RingWriter (shm_schema/_ring.c) in Python, where the install built none: the same
    positions (over the segment, where the C one takes its buffer) and the same `put`, step
    for step (tests/test_event_ring.py holds them word for word)."""

    def __init__(self, seg: Segment, tail_offset: int, head_offset: int, sleeping_offset: int,
                 ring_offset: int, capacity: int, record_words: int,
                 wake: Callable[[], None] | None = None) -> None:
        if record_words != _RECORD_WORDS:
            raise ValueError(f"an event record is {_RECORD_WORDS} words, not {record_words}")
        self._buf = seg.buf
        self._load, self._store = seg.atomic.load_u64, seg.atomic.store_u64
        self._tail_offset, self._head_offset = tail_offset, head_offset
        self._sleeping_offset, self._ring_offset = sleeping_offset, ring_offset
        self._capacity = capacity
        self._wake = wake
        self._tail = self._load(tail_offset)
        self.written = 0

    def put(self, record: tuple[int, ...], wakes: bool = True) -> bool:
        tail = self._tail
        if tail - self._load(self._head_offset) >= self._capacity:
            return False
        _PACK_INTO(self._buf, self._ring_offset + _SIZE * (tail % self._capacity), *record)
        self._tail = tail + 1
        self._store(self._tail_offset, tail + 1)  # publish after the record is written
        self.written += 1
        if wakes and self._wake is not None and self._load(self._sleeping_offset):
            self._wake()
        return True


def residency(event: Event) -> ResidencyPayload:
    """The payload of a RESIDENT or PREFIX event, by name (the reader decodes every kind but
    COMPLETE into the same four payload fields)."""
    return ResidencyPayload(event.service_us, event.decode_us, event.decode_tokens,
                            event.prompt_tokens)


class EventHandlers(NamedTuple):
    """What `EventReader.consume` calls, per kind, with the fields decoded: times in seconds
    (t_us / 1e6), durations in seconds. `other` receives RESIDENT and PREFIX as `Event`s."""
    reserve: Callable[[int, int, int, float, float, float], None]  # slot, gen, key, t, service, decode
    first_token: Callable[[int, float], None]                       # key, t
    complete: Callable[[int, float, bool], None]                    # key, t, failed
    other: Callable[[Event], None]


FULL_SCAN_EVERY = 20  # scans (100 ms at the default 5 ms poll): see EventReader.scan
SCAN_STEP = 8         # rows a scan reads further while the last one it read is claimed


class RingScan(NamedTuple):
    """Every worker row's ring at one glance (EventReader.scan)."""
    identities: tuple[int, ...]  # per row: its owner's ProcessIdentity, 0 = free
    unread: list[int]            # the claimed rows with events to take
    dropped: int                 # events the claimed rows' workers had to drop, summed


class EventReader:
    """The sidecar side (single consumer) of every row's ring."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._iter_unpack = EVENT.struct.iter_unpack
        geometry = seg.geometry
        self._rows = (geometry.worker_rows_offset,
                      geometry.worker_rows_offset + geometry.row_size * geometry.worker_capacity)
        self._stride = geometry.row_size // WORD  # rows are whole cache lines apart
        self._capacity = geometry.worker_capacity
        self._identities = [0] * geometry.worker_capacity  # as last seen, every row
        self._span = geometry.worker_capacity  # rows the next scan reads: all, the first time
        self._scans = 0

    def scan(self) -> RingScan:
        """Identity, ring tail and head and drop count of every row the sidecar must look at,
        on every poll. Each row is a page of its own (its ring follows its header), and on a
        shared machine touching 64 pages at every poll cost more than the events; so a scan reads
        the rows up to one past the highest claimed one, and further while the last row read is
        claimed: a worker claims the lowest free row (WorkerRow.claim), so a new row is there.
        Every FULL_SCAN_EVERY-th scan reads all rows, for the one way around that (a row
        claimed above another that was claimed and freed again between two scans). The
        identities are read by strided slices of the rows' region as native words (one C call
        a slice), the other words for the claimed rows only."""
        start, end = self._rows
        stride, capacity = self._stride, self._capacity
        self._scans += 1
        rows = capacity if self._scans % FULL_SCAN_EVERY == 0 else min(self._span, capacity)
        unread, lost = [], 0
        known = self._identities
        with self._seg.buf[start:end] as region, region.cast("Q") as words:
            known[:rows] = words[_IDENTITY:stride * rows:stride].tolist()
            while rows < capacity and known[rows - 1]:  # a run of claims may go on
                more = min(capacity, rows + SCAN_STEP)
                known[rows:more] = words[stride * rows + _IDENTITY:stride * more:stride].tolist()
                rows = more
            highest = -1
            for row in range(rows):
                if known[row]:
                    highest = row
                    base = stride * row
                    if words[base + _TAIL] != words[base + _HEAD]:
                        unread.append(row)
                    lost += words[base + _DROPPED]
        self._span = highest + 2
        identities = tuple(known)
        return RingScan(identities, unread, lost)

    def take(self, row: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The row's unread records as raw EventRecord word tuples, in order, marked consumed.
        One struct call per contiguous span of the ring (two when it wraps)."""
        seg = self._seg
        geometry = seg.geometry
        base = geometry.row_offset(row)
        head = seg.load(base + layout.R_RING_HEAD)
        tail = seg.load(base + layout.R_RING_TAIL)
        if limit is not None and tail - head > limit:
            tail = head + limit
        if tail <= head:
            return []
        ring, capacity = geometry.ring_offset(row), geometry.ring_capacity
        first = head % capacity
        count = tail - head
        end = min(capacity, first + count)
        buf = seg.buf
        records = list(self._iter_unpack(buf[ring + _SIZE * first:ring + _SIZE * end]))
        if end - first < count:  # wrapped: the rest from the ring's start
            records += self._iter_unpack(buf[ring:ring + _SIZE * (count - (end - first))])
        seg.store(base + layout.R_RING_HEAD, tail)
        return records

    def consume(self, row: int, epoch: int, handlers: EventHandlers,
                limit: int | None = None) -> tuple[int, int]:
        """Take the row's unread events and hand those of `epoch` to `handlers`, in order, in
        one loop with no per-event object; returns (taken, of another epoch)."""
        records = self.take(row, limit)
        reserve, first_token, complete, other = handlers
        kind_mask, epoch_shift = _KIND_MASK, _EPOCH_SHIFT
        slot_shift, generation_mask = _SLOT_SHIFT, _GENERATION_MASK
        stale = 0
        for record in records:
            tag, key, where, t_us, p0, p1, _, _ = record
            if tag >> epoch_shift != epoch:
                stale += 1  # written for a sidecar that has since restarted
                continue
            kind = tag & kind_mask
            if kind == _FIRST_TOKEN:
                first_token(key, t_us / 1e6)
            elif kind == _COMPLETE:
                complete(key, t_us / 1e6, p0 != 0)
            elif kind == _RESERVE or kind == _RESYNC:
                reserve(where >> slot_shift, where & generation_mask, key, t_us / 1e6,
                        p0 / 1e6, p1 / 1e6)
            else:
                other(_decode(record))
        return len(records), stale

    def drain(self, row: int, limit: int | None = None) -> Iterator[Event]:
        """The row's unread events in order, decoded, marked consumed."""
        return iter([_decode(record) for record in self.take(row, limit)])


def _decode(record: tuple[int, ...]) -> Event:
    tag, key, where, t_us, p0, p1, p2, p3 = record
    kind = tag & _KIND_MASK
    if kind == _COMPLETE:
        return Event(kind, tag >> _EPOCH_SHIFT, key, where >> _SLOT_SHIFT, where & _GENERATION_MASK,
                     t_us, failed=p0 != 0)
    return Event(kind, tag >> _EPOCH_SHIFT, key, where >> _SLOT_SHIFT, where & _GENERATION_MASK,
                 t_us, p0, p1, p2, p3)
