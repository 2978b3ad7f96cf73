"""Byte layout of the shared load table. The only module that knows offsets.

One POSIX shared-memory segment, every field an aligned native 64-bit word (so a plain
load of a field is a single-copy-atomic read on x86-64 and aarch64), in four regions::

    offset 0            HEADER            256 bytes
    INFLIGHT_OFFSET     inflight words    instance_capacity x 8 bytes
    directory_offset    instance slots    instance_capacity x SLOT_SIZE
    worker_rows_offset  worker rows       worker_capacity x row_size(instance_capacity)

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

Inflight word of slot i (at INFLIGHT_OFFSET + 8*i), kept contiguous so one struct call reads
every instance's load::

    bits 63..32  generation of the slot (see below)
    bits 31..0   requests in flight on that instance, host-wide

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
    72  reserved
    80  instance_id   MAX_ID_BYTES bytes of UTF-8
    192 host          MAX_HOST_BYTES bytes of UTF-8

Worker row (one per live worker process, claimed by CAS on its identity word)::

    0   identity      pack_identity(pid, start_ticks); 0 = free row
    8   heartbeat_ns
    16  journal       op sequence << 16 | END_BIT if the op is an end | (slot + 1) while a
                      begin/end is half done; op sequence << 16 when between operations
    24  worker_index  the launcher's index (private port = base + index)
    32  claimed_at_ns
    40..63 reserved
    64  contributions instance_capacity words: generation << 32 | this worker's count

The generation-tagged words make a stale update harmless: an `end` for a slot that has since
been reused carries the old generation, and its CAS fails instead of decrementing someone
else's count.
"""

from __future__ import annotations

import math
import struct

MAGIC = 0x3159584F52505243  # b"CRPROXY1" read as a little-endian u64
LAYOUT_VERSION = 1
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

# The fixed part that identifies a layout: read as one struct before trusting anything else.
HEADER_IDENTITY = struct.Struct("@6Q")  # magic, version, inst cap, worker cap, size, creation id

# --- inflight words ----------------------------------------------------------------------
INFLIGHT_OFFSET = HEADER_SIZE
GEN_SHIFT = 32
COUNT_MASK = (1 << GEN_SHIFT) - 1
GEN_MASK = (1 << 32) - 1

# --- instance slots ----------------------------------------------------------------------
SLOT_SIZE = 256
S_GENERATION = 0
S_STATE = 8
S_ALIVE = 16
S_PORT = 24
S_REGISTERED_AT_MS = 32
S_LAST_SEEN_MS = 40
S_QPS_1M = 48
S_ID_LEN = 56
S_HOST_LEN = 64
S_INSTANCE_ID = 80
S_HOST = 192
MAX_ID_BYTES = S_HOST - S_INSTANCE_ID
MAX_HOST_BYTES = SLOT_SIZE - S_HOST
SLOT_FREE = 0
SLOT_ACTIVE = 1
# generation, state, alive, port, registered_at_ms, last_seen_ms, qps bits, id_len, host_len
SLOT_FIELDS = struct.Struct("@9Q")

# --- worker rows ---------------------------------------------------------------------------
ROW_HEADER_SIZE = 64
R_IDENTITY = 0
R_HEARTBEAT_NS = 8
R_JOURNAL = 16
R_WORKER_INDEX = 24
R_CLAIMED_AT_NS = 32
ROW_FIELDS = struct.Struct("@5Q")  # identity, heartbeat, journal, index, claimed_at
JOURNAL_SLOT_BITS = 16
JOURNAL_END_BIT = 1 << 15  # instance capacity is at most 4096, so slot + 1 needs 13 bits
JOURNAL_SLOT_MASK = JOURNAL_END_BIT - 1

# --- process identity (pid + start time, so a reused pid is never mistaken for the dead one)
PID_BITS = 22  # Linux pid_max is at most 2**22
PID_MASK = (1 << PID_BITS) - 1


def _align(offset: int, to: int = 64) -> int:
    return (offset + to - 1) // to * to


class Geometry:
    """Offsets that depend on the capacities of one segment."""

    __slots__ = ("instance_capacity", "worker_capacity", "directory_offset",
                 "worker_rows_offset", "row_size", "total_size")

    def __init__(self, instance_capacity: int, worker_capacity: int) -> None:
        self.instance_capacity = instance_capacity
        self.worker_capacity = worker_capacity
        self.directory_offset = _align(INFLIGHT_OFFSET + WORD * instance_capacity)
        self.worker_rows_offset = _align(self.directory_offset + SLOT_SIZE * instance_capacity)
        self.row_size = _align(ROW_HEADER_SIZE + WORD * instance_capacity)
        self.total_size = self.worker_rows_offset + self.row_size * worker_capacity

    def inflight_offset(self, slot: int) -> int:
        return INFLIGHT_OFFSET + WORD * slot

    def slot_offset(self, slot: int) -> int:
        return self.directory_offset + SLOT_SIZE * slot

    def row_offset(self, row: int) -> int:
        return self.worker_rows_offset + self.row_size * row

    def contribution_offset(self, row: int, slot: int) -> int:
        return self.row_offset(row) + ROW_HEADER_SIZE + WORD * slot

    def contributions_struct(self, count: int) -> struct.Struct:
        return struct.Struct(f"@{count}Q")

    def contributions_base(self, row: int) -> int:
        return self.row_offset(row) + ROW_HEADER_SIZE


def pack_word(generation: int, count: int) -> int:
    return ((generation & GEN_MASK) << GEN_SHIFT) | (count & COUNT_MASK)


def word_generation(word: int) -> int:
    return word >> GEN_SHIFT


def word_count(word: int) -> int:
    return word & COUNT_MASK


def pack_journal(op_seq: int, slot: int | None, is_end: bool = False) -> int:
    if slot is None:
        return op_seq << JOURNAL_SLOT_BITS
    return (op_seq << JOURNAL_SLOT_BITS) | (JOURNAL_END_BIT if is_end else 0) | (slot + 1)


def journal_pending_is_end(journal: int) -> bool:
    return bool(journal & JOURNAL_END_BIT) and journal_pending_slot(journal) is not None


def journal_pending_slot(journal: int) -> int | None:
    """The slot of a half-done begin/end, or None when the row is between operations."""
    slot_plus_one = journal & JOURNAL_SLOT_MASK
    return None if slot_plus_one == 0 else slot_plus_one - 1


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
