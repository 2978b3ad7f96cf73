"""Every multi-word record of the segment, declared once as a NamedTuple of its fields.

The declaration is the format: a `Record` derives from the fields, in declaration order, the
struct that packs and unpacks them, each field's index in the unpacked tuple and its byte
offset in the record, so no reader or writer spells a position of its own. A field is a native
u64 word unless the record names it as text (a fixed number of bytes); whatever the fields do
not fill, up to the record's size, is reserved. Words whose bits are packed (a counter word,
an event tag...) are described in `bitfields`; layout.py places the records in the segment
and documents the whole byte map.
"""

from __future__ import annotations

import enum
import struct
from typing import Generic, Mapping, NamedTuple, TypeVar

WORD = 8  # every numeric field is an aligned native 64-bit word

T = TypeVar("T", bound=tuple)


class Record(Generic[T]):
    """How one declared record sits in memory.

    `index` and `offset` are instances of the declaration itself, holding each field's
    position in the unpacked tuple and its byte offset in the record:
    `SNAPSHOT.index.marginal_backlog_us` is 6 and `ROW_HEADER.offset.journal` is 16."""

    def __init__(self, declaration: type[T], size: int | None = None,
                 text: Mapping[str, int] | None = None) -> None:
        text = dict(text or {})
        fields: tuple[str, ...] = declaration._fields  # type: ignore[attr-defined]
        unknown = set(text) - set(fields)
        if unknown:
            raise ValueError(f"{declaration.__name__} has no field {sorted(unknown)}")
        codes = [f"{text[name]}s" if name in text else "Q" for name in fields]
        offsets = [struct.calcsize("@" + "".join(codes[:i])) for i in range(len(fields))]
        used = struct.calcsize("@" + "".join(codes))
        self.size = used if size is None else size
        if self.size < used or self.size % WORD:
            raise ValueError(f"{declaration.__name__}: {used} bytes of fields do not fit "
                             f"{self.size} bytes of whole words")
        self.declaration = declaration
        self.fields = fields
        self.count = len(fields)
        self.text = text
        self.index: T = declaration(*range(self.count))
        self.offset: T = declaration(*offsets)
        # Without a byte-order prefix, so `array` can repeat it.
        self.format = run_lengths(codes) + _padding(self.size - used)
        self.struct = struct.Struct("@" + self.format)
        self.make = declaration._make  # type: ignore[attr-defined]  # fields tuple -> record
        self._arrays: dict[int, struct.Struct] = {}

    def unpack_from(self, buffer: memoryview | bytes, offset: int = 0) -> T:
        return self.make(self.struct.unpack_from(buffer, offset))

    def pack_into(self, buffer: memoryview | bytearray, offset: int, record: T) -> None:
        self.struct.pack_into(buffer, offset, *record)

    def array(self, span: int) -> struct.Struct:
        """`span` records back to back, unpacked as one flat tuple of `count` fields each (made
        once a span: readers ask for the span they need at each read)."""
        array = self._arrays.get(span)
        if array is None:
            array = self._arrays[span] = struct.Struct("@" + self.format * span)
        return array


def run_lengths(codes: list[str]) -> str:
    """'5Q' rather than 'QQQQQ' (and '12x' rather than '4x4x4x'): the same bytes, but struct
    handles a run as one code, which is measurably faster when a reader unpacks every record
    of a region in one call. Text fields ('112s') stay apart: a run of them is one field."""
    runs: list[list] = []
    for code in codes:
        kind, size = code[-1], int(code[:-1] or 1)
        if runs and kind in _MERGEABLE and runs[-1][0] == kind:
            runs[-1][1] += size
        else:
            runs.append([kind, size])
    return "".join(code if count == 1 else f"{count}{code}" for code, count in runs)


_MERGEABLE = "QIx"


def _padding(size: int) -> str:
    return f"{size}x" if size else ""


# --- the header ------------------------------------------------------------------------------
class HeaderWords(NamedTuple):
    """The segment's first 256 bytes (layout.py says what each word is for)."""
    magic: int
    layout_version: int
    instance_capacity: int
    worker_capacity: int
    total_size: int
    creation_id: int
    created_at_ns: int
    directory_seq: int
    sidecar_identity: int
    sidecar_heartbeat_ns: int
    sidecar_epoch: int
    rr_counter: int
    tie_counter: int
    reconcile_count: int
    reaped_workers: int
    snapshot_gen: int
    snapshot_published_us: int
    ring_capacity: int
    events_dropped_gone: int
    claims_cursor: int   # records ever reserved in the claims ring (fetch_add by every worker)
    sidecar_sleeping: int  # 1 while the sidecar waits for a worker's doorbell instead of polling


HEADER = Record(HeaderWords, size=256)


# --- counter lanes ------------------------------------------------------------------------------
class CounterLanes(NamedTuple):
    """A slot's host-wide counters, one CounterWord each, in one cache line."""
    inflight: int
    active_ready: int         # the READY_CONCURRENCY admission counter
    active_prepare: int
    prepare_queue_depth: int
    ready_queue_depth: int


COUNTER_LANES = Record(CounterLanes, size=64)


# --- instance slots (the directory) ---------------------------------------------------------------
class SlotRecord(NamedTuple):
    """An instance slot, written only by the sidecar under the directory seqlock."""
    generation: int        # changes whenever the slot changes identity
    state: int             # SLOT_FREE or SLOT_ACTIVE
    alive: int
    port: int
    registered_at_ms: int
    last_seen_ms: int      # written without the seqlock: not used for selection
    qps_1m: int            # OptionalFloatWord
    id_len: int
    host_len: int
    cp_port: int           # control-plane port, 0 = unknown
    instance_id: bytes     # UTF-8, id_len bytes used
    host: bytes            # UTF-8, host_len bytes used
    max_num_seqs: int      # registered sequence limit, 0 = unknown
    kv_inject: int         # can the instance pull knowledge KV: layout.KV_INJECT_* (0 = unknown)
    unhealthy: int         # 1: out because the instance (or its probe) said unhealthy


SLOT = Record(SlotRecord, size=320, text={"instance_id": 112, "host": 64})


# --- the pressure snapshot ---------------------------------------------------------------------------
class SnapshotRecord(NamedTuple):
    """One instance's pressure as the sidecar's timeline predicts it. Times are absolute
    wall-clock microseconds: each reader subtracts its own "now"."""
    generation: int  # the slot generation it describes (0 = nothing published)
    pending_prefill_count: int
    active_decode_count: int
    next_slot_free_at_us: int
    prefill_free_at_us: int
    decode_free_at_us: int
    marginal_backlog_us: int = 0  # what one more request adds to the backlog
    pace_ppm: int = 0  # the instance's learned pace x 1e6 (observed / profile time), 0 = not learned


SNAPSHOT = Record(SnapshotRecord, size=64)


# --- worker rows --------------------------------------------------------------------------------------
class RowHeader(NamedTuple):
    """The fixed words of a worker row; its contributions and event ring follow."""
    identity: int        # ProcessIdentity of the owner, 0 = free row
    heartbeat_ns: int
    journal: int         # JournalWord
    worker_index: int    # the launcher's index
    claimed_at_ns: int
    ring_tail: int       # events written (single producer: the worker)
    ring_head: int       # events consumed (single consumer: the sidecar)
    events_dropped: int  # lost because the ring and the worker's spill were both full


ROW_HEADER = Record(RowHeader, size=128)


# --- events (worker -> sidecar) ---------------------------------------------------------------------------
class EventKind(enum.IntEnum):
    RESERVE = 1      # released to ready: the request now holds a place on the timeline
    FIRST_TOKEN = 2  # the instance produced its first byte of output
    COMPLETE = 3     # finished, failed or cancelled: the reservation goes away
    RESYNC = 4       # a live request re-announced to a new sidecar; t_us = its reserve time
    RESIDENT = 5     # the instance acknowledged knowledge KV (up to 3 knowledge-id hashes)
    PREFIX = 6       # prompt-prefix blocks were forwarded to the instance (up to 3 block hashes)


class EventRecord(NamedTuple):
    """One event in a worker's ring. The payload words mean what the kind says: ReservePayload
    for RESERVE and RESYNC, CompletePayload for COMPLETE, ResidencyPayload for RESIDENT and
    PREFIX, nothing for FIRST_TOKEN (unused words are 0)."""
    tag: int              # EventTag: kind and sidecar epoch
    request_key: int      # RequestKey
    slot_generation: int  # SlotGeneration: the instance
    t_us: int             # when, wall clock
    payload_0: int = 0
    payload_1: int = 0
    payload_2: int = 0
    payload_3: int = 0


EVENT = Record(EventRecord, size=64)
PAYLOAD_START = EVENT.index.payload_0


class ReservePayload(NamedTuple):
    service_us: int     # predicted service (prefill) time
    decode_us: int      # predicted decode time
    decode_tokens: int
    prompt_tokens: int


class CompletePayload(NamedTuple):
    failed: int  # 1 failed or cancelled, 0 finished


class ResidencyPayload(NamedTuple):
    """RESIDENT and PREFIX: up to three 64-bit key hashes (0 = none) that now hold KV on the
    event's instance, each standing for `tokens_each` tokens."""
    key_0: int
    key_1: int
    key_2: int
    tokens_each: int


# --- the affinity index (one row per instance slot; written only by the sidecar) -------------------
AFFINITY_ENTRIES = 512  # entries a row holds (see layout.py for why this many)


class AffinityRowHeader(NamedTuple):
    """The fixed words of an instance's affinity row; AFFINITY_ENTRIES entries follow."""
    generation: int       # the slot generation the entries describe, 0 = none
    seq: int              # seqlock: odd while the sidecar rewrites the row
    count: int            # entries in use, oldest (least recently used) first
    tokens: int           # tokens the entries stand for, summed
    capacity_tokens: int  # the instance's modelled KV capacity in tokens (0 = unknown)
    published_us: int     # when the sidecar last wrote the row, wall clock
    engine_fed: int       # 1: the prefix entries are the engine's own KV events (0: the workers')


AFFINITY_ROW_HEADER = Record(AffinityRowHeader, size=64)


class AffinityEntry(NamedTuple):
    """A key resident on the instance: its hash and an AffinityValue (kind, tokens)."""
    key: int    # never 0
    value: int  # AffinityValue


AFFINITY_ENTRY = Record(AffinityEntry, size=16)
AFFINITY_KNOWLEDGE = 1
AFFINITY_PREFIX = 2


# --- affinity claims (every worker -> every worker) ---------------------------------------------------
CLAIM_KEYS = 3  # keys one claim record carries


class ClaimRecord(NamedTuple):
    """One record of the claims ring: a worker's routing decision that keys will be resident on
    an instance (a CLAIM), or the withdrawal of such a decision (a DROP), seen by every worker at
    once; or the block keys of a chat's leading messages that one worker tokenized (a LEAD), so
    that no other worker tokenizes them again. `seq` is written last: the ring position + 1
    while the record is whole, anything else while it is being (re)written.

    A LEAD spans consecutive records: `claim` is the leading messages' hash, `slot_generation`
    packs (part, parts) as SlotGeneration packs (slot, generation), and the value's tokens are
    how many full blocks the leading messages fill."""
    seq: int
    claim: int            # the claim's id (the ring position of its first record); a DROP names it
    slot_generation: int  # SlotGeneration: the instance (a LEAD: its part and count of parts)
    value: int            # ClaimValue: op, kind (AFFINITY_KNOWLEDGE | AFFINITY_PREFIX), tokens each
    t_us: int             # when the worker wrote it, wall clock
    key_0: int            # up to CLAIM_KEYS keys, 0 = none
    key_1: int
    key_2: int


CLAIM = Record(ClaimRecord, size=64)
CLAIM_OP_CLAIM = 1
CLAIM_OP_DROP = 2
CLAIM_OP_LEAD = 3


# --- prompt homes (one table for the host; written only by the sidecar) ----------------------------
HOME_ENTRIES = 1024  # prompt homes the table lists: the busiest the sidecar knows


class HomeTableHeader(NamedTuple):
    """The fixed words of the prompt-home table; HOME_ENTRIES entries follow."""
    seq: int           # seqlock: odd while the sidecar rewrites the table
    count: int         # entries in use
    published_us: int  # when the sidecar last wrote the table, wall clock
    next_home: int     # SlotGeneration of the instance a prompt seen nowhere yet goes to; 0: none


HOME_TABLE_HEADER = Record(HomeTableHeader, size=64)


class HomeEntry(NamedTuple):
    """A prompt's home: the instance kv_aware credits with holding the prompt's blocks."""
    key: int              # the prompt's first block key, never 0
    slot_generation: int  # SlotGeneration: the instance


HOME_ENTRY = Record(HomeEntry, size=16)
