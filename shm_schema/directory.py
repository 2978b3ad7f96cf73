"""The instance directory in the segment: slot <-> instance id, address, alive flag, generation.

Only the sidecar writes it (DirectoryWriter). Every worker reads it (DirectoryReader) through a
cache keyed on the header's directory sequence: the common case is one 8-byte load. Writes are
bracketed by an odd/even sequence; a reader that sees an odd or changed sequence simply keeps
its previous snapshot and looks again on the next request, so a writer that is descheduled or
killed mid-write never makes a reader spin, and workers keep serving from the last published
directory while the sidecar restarts.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

from . import layout
from .bitfields import CounterWord, OptionalFloatWord
from .records import SLOT
from .segment import Segment


class DirectoryFull(RuntimeError):
    pass


class InstanceSlot(NamedTuple):
    slot: int
    generation: int
    instance_id: str
    host: str
    port: int
    alive: bool
    registered_at_ms: int
    last_seen_ms: int
    qps_1m: float | None
    cp_port: int = 0
    max_num_seqs: int = 0  # 0 = unknown
    kv_inject: int = layout.KV_INJECT_UNKNOWN
    unhealthy: bool = False  # out because it (or its probe) said so, not for its TTL


class DirectorySnapshot(NamedTuple):
    seq: int
    instances: tuple[InstanceSlot, ...]  # every ACTIVE slot, in registration order
    alive: tuple[InstanceSlot, ...]      # the candidate set
    slot_span: int                       # 1 + highest active slot index (0 if none)
    stable: bool                         # False if decoded while a write was in progress


def _decode_slot(seg: Segment, slot: int) -> InstanceSlot | None:
    record = SLOT.unpack_from(seg.buf, seg.geometry.slot_offset(slot))
    if record.state != layout.SLOT_ACTIVE:
        return None
    return InstanceSlot(
        slot=slot,
        generation=record.generation,
        instance_id=_text(record.instance_id, record.id_len),
        host=_text(record.host, record.host_len),
        port=record.port,
        alive=bool(record.alive),
        registered_at_ms=record.registered_at_ms,
        last_seen_ms=record.last_seen_ms,
        qps_1m=OptionalFloatWord.unpack(record.qps_1m),
        cp_port=record.cp_port,
        max_num_seqs=record.max_num_seqs,
        kv_inject=record.kv_inject,
        unhealthy=bool(record.unhealthy),
    )


def _text(field: bytes, length: int) -> str:
    """The used part of a text field (a length past its end, from a torn read, is clamped)."""
    return field[:length].decode("utf-8", "replace")


def read_all(seg: Segment) -> tuple[InstanceSlot, ...]:
    """Decode every active slot now (no caching, no consistency check)."""
    found = (_decode_slot(seg, slot) for slot in range(seg.geometry.instance_capacity))
    return tuple(sorted((s for s in found if s is not None),
                        key=lambda s: (s.registered_at_ms, s.slot)))


class DirectoryReader:
    """A worker's cached view of the directory."""

    EMPTY = DirectorySnapshot(seq=-1, instances=(), alive=(), slot_span=0, stable=False)

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._cached = self.EMPTY
        # The sequence load, prebound: it runs on every selection.
        self._load_seq = functools.partial(seg.atomic.load_u64, layout.H_DIRECTORY_SEQ)

    @property
    def segment(self) -> Segment:
        return self._seg

    def snapshot(self) -> DirectorySnapshot:
        seq = self._load_seq()
        cached = self._cached
        if seq == cached.seq and cached.stable:
            return cached
        if seq & 1 and cached.seq >= 0:
            return cached  # a write is in progress: the previous snapshot is still valid
        return self._decode(seq)

    def _decode(self, seq: int) -> DirectorySnapshot:
        instances = read_all(self._seg)
        stable = (seq & 1) == 0 and self._seg.load(layout.H_DIRECTORY_SEQ) == seq
        if not stable and self._cached.seq >= 0:
            return self._cached  # changed while we read: keep the old one, retry next call
        span = 1 + max((s.slot for s in instances), default=-1)
        snapshot = DirectorySnapshot(seq=seq, instances=instances,
                                     alive=tuple(s for s in instances if s.alive),
                                     slot_span=span, stable=stable)
        # An unstable first snapshot (sidecar died mid-write) is used but never trusted as
        # cached: the next call decodes again.
        self._cached = snapshot
        return snapshot


class DirectoryWriter:
    """The sidecar's write access. Single writer: the sidecar process."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def repair(self) -> None:
        """A sidecar killed mid-write leaves the sequence odd; make it even again."""
        if self._seg.load(layout.H_DIRECTORY_SEQ) & 1:
            self._seg.fetch_add(layout.H_DIRECTORY_SEQ, 1)

    def _begin(self) -> None:
        self._seg.fetch_add(layout.H_DIRECTORY_SEQ, 1)

    def _end(self) -> None:
        self._seg.fetch_add(layout.H_DIRECTORY_SEQ, 1)

    def free_slot_index(self) -> int | None:
        seg = self._seg
        for slot in range(seg.geometry.instance_capacity):
            if seg.load(seg.geometry.slot_offset(slot) + layout.S_STATE) == layout.SLOT_FREE:
                return slot
        return None

    def allocate(self, instance_id: str, host: str, port: int, now_ms: int | None = None,
                 cp_port: int = 0, max_num_seqs: int = 0,
                 kv_inject: int = layout.KV_INJECT_UNKNOWN, unhealthy: bool = False) -> InstanceSlot:
        """Put a new instance in a free slot under a new generation: a candidate at once, or
        (`unhealthy`) registered but out of the candidate set until `set_alive`."""
        id_bytes, host_bytes = encode_identity(instance_id, host)
        slot = self.free_slot_index()
        if slot is None:
            raise DirectoryFull(
                f"the shared table is full ({self._seg.geometry.instance_capacity} instance slots); "
                f"raise PROXY_SHM_INSTANCE_CAPACITY or unregister instances")
        now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        seg = self._seg
        base = seg.geometry.slot_offset(slot)
        generation = _next_generation(seg.load(base + layout.S_GENERATION))
        self._begin()
        try:
            # The counters first: from here on only leases of the new generation count.
            _reset_counters(seg, slot, generation)
            _write_text(seg, base + layout.S_INSTANCE_ID, id_bytes, layout.MAX_ID_BYTES)
            _write_text(seg, base + layout.S_HOST, host_bytes, layout.MAX_HOST_BYTES)
            for offset, value in ((layout.S_GENERATION, generation), (layout.S_PORT, port),
                                  (layout.S_REGISTERED_AT_MS, now_ms), (layout.S_LAST_SEEN_MS, now_ms),
                                  (layout.S_QPS_1M, OptionalFloatWord.pack(None)),
                                  (layout.S_ID_LEN, len(id_bytes)), (layout.S_HOST_LEN, len(host_bytes)),
                                  (layout.S_CP_PORT, cp_port), (layout.S_MAX_NUM_SEQS, max_num_seqs),
                                  (layout.S_KV_INJECT, kv_inject), (layout.S_UNHEALTHY, int(unhealthy)),
                                  (layout.S_ALIVE, int(not unhealthy))):
                seg.store(base + offset, value)
            seg.store(base + layout.S_STATE, layout.SLOT_ACTIVE)
        finally:
            self._end()
        decoded = _decode_slot(seg, slot)
        assert decoded is not None
        return decoded

    def update_registration(self, slot: int, host: str, port: int, cp_port: int = 0,
                            max_num_seqs: int = 0, kv_inject: int = layout.KV_INJECT_UNKNOWN) -> None:
        _, host_bytes = encode_identity("x", host)
        seg = self._seg
        base = seg.geometry.slot_offset(slot)
        self._begin()
        try:
            _write_text(seg, base + layout.S_HOST, host_bytes, layout.MAX_HOST_BYTES)
            seg.store(base + layout.S_HOST_LEN, len(host_bytes))
            seg.store(base + layout.S_PORT, port)
            seg.store(base + layout.S_CP_PORT, cp_port)
            seg.store(base + layout.S_MAX_NUM_SEQS, max_num_seqs)
            seg.store(base + layout.S_KV_INJECT, kv_inject)
        finally:
            self._end()

    def set_alive(self, slot: int, alive: bool, unhealthy: bool = False) -> None:
        """In or out of the candidate set; out with `unhealthy` says why (the instance or its
        probe said so) rather than its TTL. A healthy instance is never `unhealthy`."""
        unhealthy = unhealthy and not alive
        seg = self._seg
        base = seg.geometry.slot_offset(slot)
        if (bool(seg.load(base + layout.S_ALIVE)), bool(seg.load(base + layout.S_UNHEALTHY))) \
                == (alive, unhealthy):
            return
        self._begin()
        try:
            seg.store(base + layout.S_UNHEALTHY, int(unhealthy))
            seg.store(base + layout.S_ALIVE, int(alive))
        finally:
            self._end()

    def touch(self, slot: int, last_seen_ms: int, qps_1m: float | None = None) -> None:
        """Heartbeat bookkeeping; not part of what selection reads, so no sequence bump."""
        base = self._seg.geometry.slot_offset(slot)
        self._seg.store(base + layout.S_LAST_SEEN_MS, last_seen_ms)
        if qps_1m is not None:
            self._seg.store(base + layout.S_QPS_1M, OptionalFloatWord.pack(qps_1m))

    def free(self, slot: int) -> None:
        """Remove the instance; bump the generation so every outstanding lease goes stale."""
        seg = self._seg
        base = seg.geometry.slot_offset(slot)
        generation = _next_generation(seg.load(base + layout.S_GENERATION))
        self._begin()
        try:
            seg.store(base + layout.S_STATE, layout.SLOT_FREE)
            seg.store(base + layout.S_ALIVE, 0)
            seg.store(base + layout.S_UNHEALTHY, 0)
            seg.store(base + layout.S_GENERATION, generation)
            _reset_counters(seg, slot, generation)
        finally:
            self._end()


def encode_identity(instance_id: str, host: str) -> tuple[bytes, bytes]:
    """UTF-8 of id and host, or ValueError naming the field that does not fit a slot."""
    id_bytes = instance_id.encode("utf-8")
    host_bytes = host.encode("utf-8")
    if not id_bytes:
        raise ValueError("instance_id: must not be empty")
    if len(id_bytes) > layout.MAX_ID_BYTES:
        raise ValueError(f"instance_id: {len(id_bytes)} bytes, at most {layout.MAX_ID_BYTES} fit a slot")
    if not host_bytes:
        raise ValueError("host: must not be empty")
    if len(host_bytes) > layout.MAX_HOST_BYTES:
        raise ValueError(f"host: {len(host_bytes)} bytes, at most {layout.MAX_HOST_BYTES} fit a slot")
    return id_bytes, host_bytes


def _reset_counters(seg: Segment, slot: int, generation: int) -> None:
    for lane in range(layout.LANES_USED):
        seg.atomic.exchange_u64(seg.geometry.counter_offset(slot, lane), CounterWord.pack(generation, 0))


def _next_generation(generation: int) -> int:
    nxt = (generation + 1) & CounterWord.MAX_GENERATION  # it tags every counter word of the slot
    return nxt or 1  # never 0: a zeroed word must not look like a live generation


def _write_text(seg: Segment, offset: int, data: bytes, capacity: int) -> None:
    seg.buf[offset:offset + capacity] = data.ljust(capacity, b"\0")

