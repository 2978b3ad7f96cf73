"""Where everything sits in the shared load table, and the byte map of the whole segment.

The records themselves (which word is which) are declared once in `records`, the bit-packed
words in `bitfields`; this module places them: region offsets, sizes, the named offsets every
module uses, and `Geometry` for the offsets that depend on a segment's capacities. The map
below is checked against the declarations by tests/test_shm_records.py.

One POSIX shared-memory segment, every numeric field an aligned native 64-bit word (so a plain
load of a field is a single-copy-atomic read on x86-64 and aarch64), in eight regions::

    offset 0            HEADER            256 bytes
    COUNTERS_OFFSET     counter lanes     instance_capacity x LANES words (one cache line a slot)
    directory_offset    instance slots    instance_capacity x SLOT_SIZE
    snapshot_offset     pressure snapshot 2 buffers x instance_capacity x SNAPSHOT_RECORD_SIZE
    worker_rows_offset  worker rows       worker_capacity x row_size
    affinity_offset     affinity index    instance_capacity x AFFINITY_ROW_SIZE (layout 4)
    claims_offset       claims ring       CLAIM_RING_CAPACITY x CLAIM_SIZE (layout 5)
    homes_offset        prompt homes      HOME_TABLE_SIZE (layout 6)

Header words (HeaderWords, all u64)::

    0   magic              MAGIC, written last by the creator: 0 means "not initialised yet"
    8   layout_version     LAYOUT_VERSION; a reader of another version refuses to attach
    16  instance_capacity
    24  worker_capacity
    32  total_size         bytes of the whole segment
    40  creation_id        random, changes only when the segment is created anew
    48  created_at_ns      wall clock
    56  directory_seq      even = stable, odd = the sidecar is rewriting the directory
    64  sidecar_identity   ProcessIdentity of the live sidecar, 0 if none
    72  sidecar_heartbeat_ns
    80  sidecar_epoch      +1 at every sidecar start
    88  rr_counter         shared round-robin cursor (fetch_add by every worker)
    96  tie_counter        shared tie-break cursor for least_load
    104 reconcile_count    corrections made by the sidecar's audit (debug)
    112 reaped_workers     dead worker rows reclaimed (debug)
    120 snapshot_gen       pressure snapshot generation; buffer gen % 2 is the readable one
    128 snapshot_published_us  when the sidecar last published (wall clock, microseconds)
    136 ring_capacity      events per worker ring
    144 events_dropped_gone  events dropped by workers whose rows have since been freed
    152 claims_cursor      claim records ever reserved (fetch_add by every worker; layout 5)
    160 sidecar_sleeping   1 while the sidecar, idle, waits to be woken instead of polling the
                           rings: a worker that writes an event then rings its doorbell (layout 6)
    168..255 reserved

Counter lanes (CounterLanes): for slot i, LANES words at COUNTERS_OFFSET + 64*i (a slot's
counters share one cache line; slots do not), each a CounterWord::

    bits 63..32  generation of the slot (see below)
    bits 31..0   host-wide count: lane 0 inflight, 1 active_ready (the READY_CONCURRENCY
                 admission counter), 2 active_prepare, 3 prepare_queue_depth,
                 4 ready_queue_depth; lanes 5..7 reserved

Instance slot (SlotRecord; the directory, written only by the sidecar, SLOT_SIZE bytes)::

    0   generation    changes whenever the slot changes identity (allocate and free)
    8   state         SLOT_FREE or SLOT_ACTIVE
    16  alive         1 if the instance is a candidate: seen within its TTL and not unhealthy
    24  port
    32  registered_at_ms
    40  last_seen_ms  (written without the directory seqlock: not used for selection)
    48  qps_1m        OptionalFloatWord: IEEE double bits, NaN = unknown
    56  id_len
    64  host_len
    72  cp_port       the instance's control-plane port (KV inject), 0 = unknown
    80  instance_id   MAX_ID_BYTES bytes of UTF-8
    192 host          MAX_HOST_BYTES bytes of UTF-8
    256 max_num_seqs  how many sequences the instance runs at once (its registration's
                      meta.max_num_seqs), 0 = unknown; the sidecar's timeline models that many
                      slots. Survives a sidecar restart with the rest of the slot.
    264 kv_inject     whether the instance can pull knowledge KV (its capabilities name the
                      "kv_inject" cache feature): KV_INJECT_UNKNOWN 0 (it said nothing: tried,
                      as before), KV_INJECT_YES 1, KV_INJECT_NO 2 (knowledge goes in as text)
    272 unhealthy     1 when the instance is out of the candidate set because it (its
                      heartbeat's `healthy: false`) or the sidecar's probe of it said so,
                      0 otherwise; alive is 0 whenever this is 1. Written with alive, under
                      the directory seqlock. An older segment has 0 here (reserved bytes).
    280..319 reserved

Pressure snapshot record (SnapshotRecord; written only by the sidecar, double-buffered)::

    0   generation           slot generation the record describes (0 = nothing published)
    8   pending_prefill_count
    16  active_decode_count
    24  next_slot_free_at_us absolute wall-clock times: readers subtract their own "now"
    32  prefill_free_at_us
    40  decode_free_at_us
    48  marginal_backlog_us  the backlog one more request adds (the timeline's recent pace-scaled
                         service, or service + decode shared by the slots if that is more);
                         readers charge it for each request in flight that the timeline has not
                         seen yet (inflight - pending - decoding), which bridges the snapshot's lag
                         when a burst lands on several workers at once
    56  pace_ppm             the instance's learned pace x 1e6: observed / profile-predicted time
                         (cacheroute_proxy/pace.py); 0 = not learned yet, read as 1 (layout 5)

Worker row (RowHeader, then contributions and ring; one per live worker process, claimed by
CAS on its identity word)::

    0   identity      ProcessIdentity of the owner; 0 = free row
    8   heartbeat_ns
    16  journal       JournalWord: which (slot, lane) an update is half done on, if any
    24  worker_index  the launcher's index (private port = base + index)
    32  claimed_at_ns
    40  ring_tail     events written by the worker (single producer)
    48  ring_head     events consumed by the sidecar (single consumer)
    56  events_dropped  events lost because the ring and the worker's spill were both full
    64..127 reserved
    128 contributions instance_capacity x LANES CounterWords: this worker's own counts
    ... event ring    ring_capacity x EVENT_SIZE bytes

Event record (EventRecord; in a worker's ring, EVENT_SIZE bytes)::

    0   tag              EventTag: kind (EventKind) and the sidecar epoch it was written under
    8   request_key      RequestKey: the worker's row and its sequence; RESIDENT: 0; PREFIX:
                         the request's prompt blocks in the event whose key_0 is the prompt's
                         first block (the event that names the prompt), 0 in the others
    16  slot_generation  SlotGeneration: the instance it is about
    24  t_us             when (RESYNC: when the request was reserved), wall clock
    32  payload_0        RESERVE, RESYNC: ReservePayload (service_us, decode_us, decode_tokens,
    40  payload_1        prompt_tokens); COMPLETE: CompletePayload (failed); RESIDENT, PREFIX:
    48  payload_2        ResidencyPayload (key_0, key_1, key_2, tokens_each); FIRST_TOKEN: none;
    56  payload_3        unused words are 0

Affinity row (AffinityRowHeader, then AFFINITY_ENTRIES AffinityEntry records of 16 bytes; one
row per instance slot, written only by the sidecar, read by every worker; layout version 4)::

    0   generation       the slot generation the entries describe; 0 = none. A reader that
                         holds another generation (the slot was freed or reused) sees nothing
    8   seq              seqlock: the sidecar makes it odd, rewrites the row, makes it even
                         again; a reader copies the row and keeps the copy only if seq was even
                         and unchanged around it
    16  count            entries in use, the least recently used first
    24  tokens           tokens the entries stand for, summed
    32  capacity_tokens  the instance's modelled KV capacity in tokens (0 = unknown)
    40  published_us     when the row was last written (wall clock)
    48  engine_fed       1: the prefix entries are the engine's own KV cache events, so a
                         worker's guess of them is not read; 0 (also in a row written before
                         the field was taken from the reserved words): the workers' guesses
    56..63 reserved
    64  entries          AFFINITY_ENTRIES x (key: 64-bit hash, never 0; value: AffinityValue)

Claim record (ClaimRecord; the claims ring, written by every worker, read by every worker;
layout version 5)::

    0   seq              the record's ring position + 1 once it is whole; written last, and
                         cleared first when the record is rewritten a lap later. A reader
                         keeps a record only if seq was its position + 1 before and after it
                         copied the record
    8   claim            the claim's id: the ring position of its first record. A DROP names
                         the claim it withdraws; a LEAD holds its leading messages' hash
    16  slot_generation  SlotGeneration: the instance the keys will be resident on (a LEAD:
                         part << 32 | parts, its records being consecutive)
    24  value            ClaimValue: op (CLAIM_OP_CLAIM, CLAIM_OP_DROP, CLAIM_OP_LEAD), kind,
                         tokens each (a LEAD: the full blocks its leading messages fill)
    32  t_us             when it was written (wall clock): a claim lapses after the readers' TTL
    40  key_0            up to three keys (0 = none), as in the affinity index
    48  key_1
    56  key_2

A writer reserves its records with one fetch_add on the header's claims_cursor, so every worker
appends to one ring without a lock; record i sits at claims_offset + CLAIM_SIZE x (i mod
CLAIM_RING_CAPACITY). A reader follows the cursor: a record not whole yet is looked at again
on its next pass (a writer killed between reserve and publish leaves a hole that is passed over
after a bound), and one the writers have lapped is gone (its claim lapses as if its TTL had).

Prompt-home table (HomeTableHeader, then HOME_ENTRIES HomeEntry records of 16 bytes; one for
the host, written only by the sidecar, read by every worker; layout version 6)::

    0   seq              seqlock, as an affinity row's
    8   count            entries in use
    16  published_us     when the table was last written (wall clock)
    24  next_home        SlotGeneration of the instance where a prompt that no candidate holds
                         and the table does not list goes (its first request), 0 = none; one
                         word, stored on its own (no seqlock) whenever the sidecar's choice
                         changes. An older segment has 0 here (reserved bytes).
    32..63 reserved
    64  entries          HOME_ENTRIES x (key: a prompt's first block key, never 0;
                         slot_generation: SlotGeneration of the instance that is its home)

A prompt missing from the table lives where it is held; held nowhere, at next_home; with no
next_home, at its rendezvous home among the request's candidates.

Bit-packed words (bitfields)::

    CounterWord     generation << 32 | count
    JournalWord     op sequence << 24 | lane << 17 | END_BIT (1 << 16) | (slot + 1) mid-update,
                    op sequence << 24 between operations
    RequestKey      row << 48 | sequence
    ProcessIdentity start_ticks << 22 | pid
    EventTag        kind | epoch << 8
    SlotGeneration  slot << 32 | generation
    AffinityValue   kind << 32 | tokens (kind: AFFINITY_KNOWLEDGE 1, AFFINITY_PREFIX 2)
    ClaimValue      op << 48 | AffinityValue (op: CLAIM_OP_CLAIM 1, CLAIM_OP_DROP 2,
                    CLAIM_OP_LEAD 3)

The generation-tagged words make a stale update harmless: an `end` for a slot that has since
been reused carries the old generation, and its CAS fails instead of decrementing someone
else's count.
"""

from __future__ import annotations

import struct

from .records import (AFFINITY_ENTRIES, AFFINITY_ENTRY, AFFINITY_ROW_HEADER, CLAIM, COUNTER_LANES,
                      EVENT, HEADER, HOME_ENTRIES, HOME_ENTRY, HOME_TABLE_HEADER, ROW_HEADER, SLOT,
                      SNAPSHOT, WORD)

MAGIC = 0x3159584F52505243  # b"CRPROXY1" read as a little-endian u64
# 3: max_num_seqs in the slots (320 bytes), marginal backlog in the snapshot;
# 4: the affinity index after the worker rows (every earlier offset unchanged);
# 5: the claims ring after it, the claims cursor in the header, the pace in the snapshot;
# 6: the prompt-home table after the claims ring, the sidecar's sleeping flag in the header.
LAYOUT_VERSION = 6

# --- header ------------------------------------------------------------------------------
HEADER_SIZE = HEADER.size
H_MAGIC = HEADER.offset.magic
H_LAYOUT_VERSION = HEADER.offset.layout_version
H_INSTANCE_CAPACITY = HEADER.offset.instance_capacity
H_WORKER_CAPACITY = HEADER.offset.worker_capacity
H_TOTAL_SIZE = HEADER.offset.total_size
H_CREATION_ID = HEADER.offset.creation_id
H_CREATED_AT_NS = HEADER.offset.created_at_ns
H_DIRECTORY_SEQ = HEADER.offset.directory_seq
H_SIDECAR_IDENTITY = HEADER.offset.sidecar_identity
H_SIDECAR_HEARTBEAT_NS = HEADER.offset.sidecar_heartbeat_ns
H_SIDECAR_EPOCH = HEADER.offset.sidecar_epoch
H_RR_COUNTER = HEADER.offset.rr_counter
H_TIE_COUNTER = HEADER.offset.tie_counter
H_RECONCILE_COUNT = HEADER.offset.reconcile_count
H_REAPED_WORKERS = HEADER.offset.reaped_workers
H_SNAPSHOT_GEN = HEADER.offset.snapshot_gen
H_SNAPSHOT_PUBLISHED_US = HEADER.offset.snapshot_published_us
H_RING_CAPACITY = HEADER.offset.ring_capacity
H_EVENTS_DROPPED_GONE = HEADER.offset.events_dropped_gone
H_CLAIMS_CURSOR = HEADER.offset.claims_cursor
H_SIDECAR_SLEEPING = HEADER.offset.sidecar_sleeping

# --- counter lanes -----------------------------------------------------------------------
COUNTERS_OFFSET = HEADER_SIZE
LANES = COUNTER_LANES.size // WORD  # 8 words = 64 bytes: one cache line per slot
LANES_USED = COUNTER_LANES.count
LANE_NAMES = COUNTER_LANES.fields
LANE_INFLIGHT = COUNTER_LANES.index.inflight
LANE_READY_ACTIVE = COUNTER_LANES.index.active_ready
LANE_PREPARE_ACTIVE = COUNTER_LANES.index.active_prepare
LANE_PREPARE_WAITING = COUNTER_LANES.index.prepare_queue_depth
LANE_READY_WAITING = COUNTER_LANES.index.ready_queue_depth

# --- instance slots ----------------------------------------------------------------------
SLOT_SIZE = SLOT.size  # a multiple of 64: slots never share a cache line
S_GENERATION = SLOT.offset.generation
S_STATE = SLOT.offset.state
S_ALIVE = SLOT.offset.alive
S_PORT = SLOT.offset.port
S_REGISTERED_AT_MS = SLOT.offset.registered_at_ms
S_LAST_SEEN_MS = SLOT.offset.last_seen_ms
S_QPS_1M = SLOT.offset.qps_1m
S_ID_LEN = SLOT.offset.id_len
S_HOST_LEN = SLOT.offset.host_len
S_CP_PORT = SLOT.offset.cp_port
S_INSTANCE_ID = SLOT.offset.instance_id
S_HOST = SLOT.offset.host
S_MAX_NUM_SEQS = SLOT.offset.max_num_seqs
S_KV_INJECT = SLOT.offset.kv_inject
S_UNHEALTHY = SLOT.offset.unhealthy
MAX_ID_BYTES = SLOT.text["instance_id"]
MAX_HOST_BYTES = SLOT.text["host"]
SLOT_FREE = 0
SLOT_ACTIVE = 1
KV_INJECT_UNKNOWN = 0
KV_INJECT_YES = 1
KV_INJECT_NO = 2

# --- pressure snapshot ---------------------------------------------------------------------
SNAPSHOT_RECORD_SIZE = SNAPSHOT.size

# --- worker rows ---------------------------------------------------------------------------
ROW_HEADER_SIZE = ROW_HEADER.size
R_IDENTITY = ROW_HEADER.offset.identity
R_HEARTBEAT_NS = ROW_HEADER.offset.heartbeat_ns
R_JOURNAL = ROW_HEADER.offset.journal
R_WORKER_INDEX = ROW_HEADER.offset.worker_index
R_CLAIMED_AT_NS = ROW_HEADER.offset.claimed_at_ns
R_RING_TAIL = ROW_HEADER.offset.ring_tail
R_RING_HEAD = ROW_HEADER.offset.ring_head
R_EVENTS_DROPPED = ROW_HEADER.offset.events_dropped

# --- events (worker -> sidecar rings) --------------------------------------------------------
EVENT_SIZE = EVENT.size
DEFAULT_RING_CAPACITY = 1024

# --- the affinity index (sidecar -> workers) -------------------------------------------------
# 512 entries a row: 1 + 512 x 16 bytes ~ 8 KB an instance (2.1 MB for the default 256 slots).
# Enough for what one instance's KV holds of what the proxy can name: a few hundred knowledge
# documents of ~1-4k tokens, or a few dozen shared system prompts of 64-token blocks; the
# sidecar's model evicts least recently used entries beyond it as it does beyond the capacity.
AFFINITY_ROW_SIZE = AFFINITY_ROW_HEADER.size + AFFINITY_ENTRIES * AFFINITY_ENTRY.size
A_GENERATION = AFFINITY_ROW_HEADER.offset.generation
A_SEQ = AFFINITY_ROW_HEADER.offset.seq
A_COUNT = AFFINITY_ROW_HEADER.offset.count

# --- the claims ring (every worker -> every worker) ---------------------------------------------
# 4,096 records of 64 bytes (256 KB): a request claims its knowledge ids and prompt blocks in
# ceil(keys / 3) records, 1-11 of them, so the ring holds the decisions of the last several
# hundred requests; a reader polls it at every kv_aware selection, long before a lap.
CLAIM_SIZE = CLAIM.size
CLAIM_RING_CAPACITY = 4096
C_SEQ = CLAIM.offset.seq

# --- prompt homes (sidecar -> workers) ---------------------------------------------------------
# 1,024 entries of 16 bytes (16 KB): the busiest prompts the sidecar knows; a prompt not listed
# lives where it is held (a one-off conversation's, a prompt of a workload with more).
HOME_TABLE_SIZE = HOME_TABLE_HEADER.size + HOME_ENTRIES * HOME_ENTRY.size
HT_SEQ = HOME_TABLE_HEADER.offset.seq
HT_NEXT_HOME = HOME_TABLE_HEADER.offset.next_home


def _align(offset: int, to: int = 64) -> int:
    return (offset + to - 1) // to * to


class Geometry:
    """Offsets that depend on the capacities of one segment."""

    __slots__ = ("instance_capacity", "worker_capacity", "ring_capacity", "directory_offset",
                 "snapshot_offset", "worker_rows_offset", "contributions_size", "row_size",
                 "affinity_offset", "claims_offset", "homes_offset", "total_size")

    def __init__(self, instance_capacity: int, worker_capacity: int,
                 ring_capacity: int = DEFAULT_RING_CAPACITY) -> None:
        self.instance_capacity = instance_capacity
        self.worker_capacity = worker_capacity
        self.ring_capacity = ring_capacity
        self.directory_offset = _align(COUNTERS_OFFSET + WORD * LANES * instance_capacity)
        self.snapshot_offset = _align(self.directory_offset + SLOT_SIZE * instance_capacity)
        self.worker_rows_offset = _align(self.snapshot_offset + 2 * SNAPSHOT_RECORD_SIZE * instance_capacity)
        self.contributions_size = WORD * LANES * instance_capacity
        self.row_size = _align(ROW_HEADER_SIZE + self.contributions_size + EVENT_SIZE * ring_capacity)
        self.affinity_offset = self.worker_rows_offset + self.row_size * worker_capacity
        self.claims_offset = self.affinity_offset + AFFINITY_ROW_SIZE * instance_capacity
        self.homes_offset = self.claims_offset + CLAIM_SIZE * CLAIM_RING_CAPACITY
        self.total_size = self.homes_offset + HOME_TABLE_SIZE

    def counter_offset(self, slot: int, lane: int = LANE_INFLIGHT) -> int:
        return counter_offset(slot, lane)

    def inflight_offset(self, slot: int) -> int:
        return self.counter_offset(slot, LANE_INFLIGHT)

    def slot_offset(self, slot: int) -> int:
        return self.directory_offset + SLOT_SIZE * slot

    def snapshot_record_offset(self, buffer: int, slot: int) -> int:
        return self.snapshot_offset + SNAPSHOT_RECORD_SIZE * (buffer * self.instance_capacity + slot)

    def row_offset(self, row: int) -> int:
        return self.worker_rows_offset + self.row_size * row

    def contributions_base(self, row: int) -> int:
        return self.row_offset(row) + ROW_HEADER_SIZE

    def contribution_offset(self, row: int, slot: int, lane: int = LANE_INFLIGHT) -> int:
        return self.contributions_base(row) + WORD * (LANES * slot + lane)

    def contributions_struct(self, count: int) -> struct.Struct:
        """All LANES words of `count` slots (used lanes and reserved ones)."""
        return struct.Struct(f"@{count * LANES}Q")

    def ring_offset(self, row: int) -> int:
        return self.contributions_base(row) + self.contributions_size

    def affinity_row_offset(self, slot: int) -> int:
        return self.affinity_offset + AFFINITY_ROW_SIZE * slot

    def affinity_entries_offset(self, slot: int) -> int:
        return self.affinity_row_offset(slot) + AFFINITY_ROW_HEADER.size

    def claim_offset(self, position: int) -> int:
        return self.claims_offset + CLAIM_SIZE * (position % CLAIM_RING_CAPACITY)

    def home_entries_offset(self) -> int:
        return self.homes_offset + HOME_TABLE_HEADER.size


def counter_offset(slot: int, lane: int = LANE_INFLIGHT) -> int:
    """The byte offset of (slot, lane)'s counter word: the same in every geometry."""
    return COUNTERS_OFFSET + WORD * (LANES * slot + lane)


def lanes_struct(span: int) -> struct.Struct:
    """Every used lane of slots 0 .. span-1 as one flat tuple (LANES_USED values a slot;
    `lane_index` finds one)."""
    return COUNTER_LANES.array(span)


def lane_index(slot: int, lane: int) -> int:
    """Where (slot, lane) is in the flat tuple that `lanes_struct` unpacks."""
    return LANES_USED * slot + lane


def inflight_struct(span: int) -> struct.Struct:
    """The inflight lane of slots 0 .. span-1, one word a slot."""
    before = COUNTER_LANES.offset.inflight
    after = COUNTER_LANES.size - before - WORD
    one_slot = (f"{before}x" if before else "") + f"Q{after}x"
    return struct.Struct("@" + one_slot * span)
