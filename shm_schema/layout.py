"""Byte layout of the shared load table. The only module that knows offsets.

One POSIX shared-memory segment, every field an aligned native 64-bit word (so a plain
load of a field is a single-copy-atomic read on x86-64 and aarch64), in five regions::

    offset 0            HEADER            256 bytes
    COUNTERS_OFFSET     counter lanes     instance_capacity x LANES words (one cache line a slot)
    directory_offset    instance slots    instance_capacity x SLOT_SIZE
    snapshot_offset     pressure snapshot 2 buffers x instance_capacity x SNAPSHOT_RECORD_SIZE
    worker_rows_offset  worker rows       worker_capacity x row_size

Header words (all u64)::

    0   magic              MAGIC, written last by the creator: 0 means "not initialised yet"
    8   layout_version     LAYOUT_VERSION; a reader of another version refuses to attach
    16  instance_capacity
    24  worker_capacity
    32  total_size         bytes of the whole segment
    40  creation_id        random, changes only when the segment is created anew
    48  created_at_ns      wall clock
    56  directory_seq      even = stable, odd = the sidecar is rewriting the directory
    64  sidecar_identity   process identity (see pack_identity) of the live sidecar, 0 if none
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

Counter lanes: for slot i, LANES words at COUNTERS_OFFSET + 64*i (a slot's counters share one
cache line; slots do not), each word::

    bits 63..32  generation of the slot (see below)
    bits 31..0   host-wide count: lane 0 inflight, 1 ready_active (the READY_CONCURRENCY
                 admission counter), 2 prepare_active, 3 prepare_waiting, 4 ready_waiting

Instance slot (directory, written only by the sidecar, SLOT_SIZE bytes)::

    0   generation    changes whenever the slot changes identity (allocate and free)
    8   state         SLOT_FREE or SLOT_ACTIVE
    16  alive         1 if the instance's heartbeat is within its TTL
    24  port
    32  registered_at_ms
    40  last_seen_ms  (written without the directory seqlock: not used for selection)
    48  qps_1m        IEEE double bits, NaN = unknown
    56  id_len
    64  host_len
    72  cp_port       the instance's control-plane port (KV inject), 0 = unknown
    80  instance_id   MAX_ID_BYTES bytes of UTF-8
    192 host          MAX_HOST_BYTES bytes of UTF-8
    256 max_num_seqs  how many sequences the instance runs at once (its registration's
                      meta.max_num_seqs), 0 = unknown; the sidecar's timeline models that many
                      slots. Survives a sidecar restart with the rest of the slot.
    264..319 reserved

Pressure snapshot record (written only by the sidecar, double-buffered)::

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
    56..63 reserved

Worker row (one per live worker process, claimed by CAS on its identity word)::

    0   identity      pack_identity(pid, start_ticks); 0 = free row
    8   heartbeat_ns
    16  journal       op sequence << 24 | lane << 17 | END_BIT | (slot + 1) while an update is
                      half done; op sequence << 24 when between operations
    24  worker_index  the launcher's index (private port = base + index)
    32  claimed_at_ns
    40  ring_tail     events written by the worker (single producer)
    48  ring_head     events consumed by the sidecar (single consumer)
    56  events_dropped  events lost because the ring and the worker's spill were both full
    64..127 reserved
    128 contributions instance_capacity x LANES words: generation << 32 | this worker's count
    ... event ring    ring_capacity x EVENT_SIZE bytes (see EVENT_FIELDS)

The generation-tagged words make a stale update harmless: an `end` for a slot that has since
been reused carries the old generation, and its CAS fails instead of decrementing someone
else's count.
"""

from __future__ import annotations

import math
import struct

MAGIC = 0x3159584F52505243  # b"CRPROXY1" read as a little-endian u64
LAYOUT_VERSION = 3  # 3: max_num_seqs in the slots (320 bytes), marginal backlog in the snapshot
WORD = 8

# --- header ------------------------------------------------------------------------------
HEADER_SIZE = 256
H_MAGIC = 0
H_LAYOUT_VERSION = 8
H_INSTANCE_CAPACITY = 16
H_WORKER_CAPACITY = 24
H_TOTAL_SIZE = 32
H_CREATION_ID = 40
H_CREATED_AT_NS = 48
H_DIRECTORY_SEQ = 56
H_SIDECAR_IDENTITY = 64
H_SIDECAR_HEARTBEAT_NS = 72
H_SIDECAR_EPOCH = 80
H_RR_COUNTER = 88
H_TIE_COUNTER = 96
H_RECONCILE_COUNT = 104
H_REAPED_WORKERS = 112
H_SNAPSHOT_GEN = 120
H_SNAPSHOT_PUBLISHED_US = 128
H_RING_CAPACITY = 136
H_EVENTS_DROPPED_GONE = 144

# The fixed part that identifies a layout: read as one struct before trusting anything else.
HEADER_IDENTITY = struct.Struct("@6Q")  # magic, version, inst cap, worker cap, size, creation id

# --- counter lanes -----------------------------------------------------------------------
COUNTERS_OFFSET = HEADER_SIZE
LANES = 8  # 8 words = 64 bytes: one cache line per slot
LANE_INFLIGHT = 0
LANE_READY_ACTIVE = 1
LANE_PREPARE_ACTIVE = 2
LANE_PREPARE_WAITING = 3
LANE_READY_WAITING = 4
LANES_USED = 5
LANE_NAMES = ("inflight", "active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth")
# Reads every used lane of `span` consecutive slots in one call, skipping the reserved words.
_LANE_RECORD = f"{LANES_USED}Q{(LANES - LANES_USED) * 8}x"
INFLIGHT_OFFSET = COUNTERS_OFFSET  # lane 0 of slot 0
GEN_SHIFT = 32
COUNT_MASK = (1 << GEN_SHIFT) - 1
GEN_MASK = (1 << 32) - 1

# --- instance slots ----------------------------------------------------------------------
SLOT_SIZE = 320  # a multiple of 64: slots never share a cache line
S_GENERATION = 0
S_STATE = 8
S_ALIVE = 16
S_PORT = 24
S_REGISTERED_AT_MS = 32
S_LAST_SEEN_MS = 40
S_QPS_1M = 48
S_ID_LEN = 56
S_HOST_LEN = 64
S_CP_PORT = 72
S_INSTANCE_ID = 80
S_HOST = 192
S_MAX_NUM_SEQS = 256
MAX_ID_BYTES = S_HOST - S_INSTANCE_ID
MAX_HOST_BYTES = S_MAX_NUM_SEQS - S_HOST
SLOT_FREE = 0
SLOT_ACTIVE = 1
# generation, state, alive, port, registered_at_ms, last_seen_ms, qps bits, id_len, host_len, cp_port
SLOT_FIELDS = struct.Struct("@10Q")

# --- pressure snapshot ---------------------------------------------------------------------
SNAPSHOT_RECORD_SIZE = 64
SNAPSHOT_FIELDS = 7  # generation, pending, decode, next slot free, prefill free, decode free, marginal
SNAPSHOT_RECORD = f"{SNAPSHOT_FIELDS}Q{SNAPSHOT_RECORD_SIZE - 8 * SNAPSHOT_FIELDS}x"

# --- worker rows ---------------------------------------------------------------------------
ROW_HEADER_SIZE = 128
R_IDENTITY = 0
R_HEARTBEAT_NS = 8
R_JOURNAL = 16
R_WORKER_INDEX = 24
R_CLAIMED_AT_NS = 32
R_RING_TAIL = 40
R_RING_HEAD = 48
R_EVENTS_DROPPED = 56
ROW_FIELDS = struct.Struct("@8Q")  # identity .. events_dropped
JOURNAL_SEQ_SHIFT = 24
JOURNAL_LANE_SHIFT = 17
JOURNAL_END_BIT = 1 << 16
JOURNAL_SLOT_MASK = (1 << 16) - 1  # slot + 1; instance capacity is at most 4096
JOURNAL_SLOT_BITS = JOURNAL_SEQ_SHIFT  # kept for readers of the sequence part

# --- events (worker -> sidecar rings) --------------------------------------------------------
EVENT_SIZE = 64
# kind | epoch << 8, request key, slot << 32 | generation, t_us, and four payload words
EVENT_FIELDS = struct.Struct("@8Q")
DEFAULT_RING_CAPACITY = 1024

# --- process identity (pid + start time, so a reused pid is never mistaken for the dead one)
PID_BITS = 22  # Linux pid_max is at most 2**22
PID_MASK = (1 << PID_BITS) - 1


def _align(offset: int, to: int = 64) -> int:
    return (offset + to - 1) // to * to


class Geometry:
    """Offsets that depend on the capacities of one segment."""

    __slots__ = ("instance_capacity", "worker_capacity", "ring_capacity", "directory_offset",
                 "snapshot_offset", "worker_rows_offset", "contributions_size", "row_size",
                 "total_size")

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
        self.total_size = self.worker_rows_offset + self.row_size * worker_capacity

    def counter_offset(self, slot: int, lane: int = LANE_INFLIGHT) -> int:
        return COUNTERS_OFFSET + WORD * (LANES * slot + lane)

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



def lanes_struct(span: int) -> struct.Struct:
    """Every used lane of slots 0 .. span-1 as one flat tuple (LANES_USED values a slot)."""
    return struct.Struct("@" + _LANE_RECORD * span)


def inflight_struct(span: int) -> struct.Struct:
    """Lane 0 (inflight) of slots 0 .. span-1."""
    return struct.Struct("@" + f"Q{(LANES - 1) * 8}x" * span)


def snapshot_struct(span: int) -> struct.Struct:
    return struct.Struct("@" + SNAPSHOT_RECORD * span)


def pack_word(generation: int, count: int) -> int:
    return ((generation & GEN_MASK) << GEN_SHIFT) | (count & COUNT_MASK)


def word_generation(word: int) -> int:
    return word >> GEN_SHIFT


def word_count(word: int) -> int:
    return word & COUNT_MASK


def pack_journal(op_seq: int, slot: int | None, is_end: bool = False, lane: int = LANE_INFLIGHT) -> int:
    if slot is None:
        return op_seq << JOURNAL_SEQ_SHIFT
    return ((op_seq << JOURNAL_SEQ_SHIFT) | (lane << JOURNAL_LANE_SHIFT)
            | (JOURNAL_END_BIT if is_end else 0) | (slot + 1))


def journal_pending_slot(journal: int) -> int | None:
    """The slot of a half-done update, or None when the row is between operations."""
    slot_plus_one = journal & JOURNAL_SLOT_MASK
    return None if slot_plus_one == 0 else slot_plus_one - 1


def journal_pending_lane(journal: int) -> int:
    return (journal >> JOURNAL_LANE_SHIFT) & 0x7F


def journal_pending_is_end(journal: int) -> bool:
    return bool(journal & JOURNAL_END_BIT) and journal_pending_slot(journal) is not None


def pack_identity(pid: int, start_ticks: int) -> int:
    return (start_ticks << PID_BITS) | (pid & PID_MASK)


def unpack_identity(identity: int) -> tuple[int, int]:
    return identity & PID_MASK, identity >> PID_BITS


def qps_to_bits(qps: float | None) -> int:
    value = math.nan if qps is None else float(qps)
    return struct.unpack("@Q", struct.pack("@d", value))[0]


def bits_to_qps(bits: int) -> float | None:
    value = struct.unpack("@d", struct.pack("@Q", bits))[0]
    return None if math.isnan(value) else value
