"""Header words shared by every process: cursors, sidecar presence, debug counters.

Other modules read and change the header through these named accessors, never by offset.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from . import layout, process_identity
from .bitfields import ProcessIdentity
from .records import HEADER
from .segment import Segment


def next_round_robin(seg: Segment) -> int:
    """A host-wide round-robin cursor: N workers together rotate like one process."""
    return seg.atomic.fetch_add_u64(layout.H_RR_COUNTER, 1)


def next_tie_break(seg: Segment) -> int:
    return seg.atomic.fetch_add_u64(layout.H_TIE_COUNTER, 1)


def sidecar_epoch_reader(seg: Segment) -> Callable[[], int]:
    """The sidecar epoch of `seg` (+1 at every sidecar start: events written under an older
    epoch are discarded), read by one C call: a worker reads it before every event."""
    return functools.partial(seg.atomic.load_u64, layout.H_SIDECAR_EPOCH)


def claim_sidecar(seg: Segment) -> int:
    """Record this process as the sidecar; returns the new sidecar epoch."""
    seg.store(layout.H_SIDECAR_IDENTITY, process_identity.own_identity())
    sidecar_heartbeat(seg)
    return seg.fetch_add(layout.H_SIDECAR_EPOCH, 1) + 1


def other_live_sidecar(seg: Segment) -> int | None:
    """The pid of a live sidecar other than this process that owns the segment, if any."""
    identity = seg.load(layout.H_SIDECAR_IDENTITY)
    if identity and identity != process_identity.own_identity() and process_identity.is_alive(identity):
        return ProcessIdentity.pid(identity)
    return None


def release_sidecar(seg: Segment) -> None:
    seg.store(layout.H_SIDECAR_IDENTITY, 0)


def sidecar_heartbeat(seg: Segment) -> None:
    seg.store(layout.H_SIDECAR_HEARTBEAT_NS, time.time_ns())


def set_sidecar_sleeping(seg: Segment, sleeping: bool) -> None:
    """The sidecar stops polling the rings (True) until a worker's doorbell wakes it, or polls
    again (False). A full barrier: the sidecar looks at the rings once more after saying it sleeps,
    and a worker looks at the flag after publishing its event, so one of them sees the other."""
    seg.store(layout.H_SIDECAR_SLEEPING, int(sleeping))


def sidecar_sleeping(seg: Segment) -> bool:
    return bool(seg.load(layout.H_SIDECAR_SLEEPING))


def count_reaped_worker(seg: Segment) -> None:
    seg.fetch_add(layout.H_REAPED_WORKERS, 1)


def count_reconcile_correction(seg: Segment) -> None:
    seg.fetch_add(layout.H_RECONCILE_COUNT, 1)


def events_dropped_gone(seg: Segment) -> int:
    """Events dropped by workers whose rows have since been freed (see repair.free_row)."""
    return seg.load(layout.H_EVENTS_DROPPED_GONE)


def add_events_dropped_gone(seg: Segment, dropped: int) -> None:
    seg.fetch_add(layout.H_EVENTS_DROPPED_GONE, dropped)


def describe(seg: Segment) -> dict[str, Any]:
    """The header as JSON-friendly values, for /debug/status."""
    words = HEADER.unpack_from(seg.buf)
    identity = words.sidecar_identity
    heartbeat_ns = words.sidecar_heartbeat_ns
    return {
        "name": seg.name,
        "layout_version": words.layout_version,
        "creation_id": f"{seg.creation_id:016x}",
        "created_at_ms": words.created_at_ns // 1_000_000,
        "instance_capacity": seg.geometry.instance_capacity,
        "worker_capacity": seg.geometry.worker_capacity,
        "total_size": seg.geometry.total_size,
        "directory_seq": words.directory_seq,
        "sidecar_pid": ProcessIdentity.pid(identity) if identity else None,
        "sidecar_alive": bool(identity) and process_identity.is_alive(identity),
        "sidecar_epoch": words.sidecar_epoch,
        "sidecar_heartbeat_age_ms": (time.time_ns() - heartbeat_ns) // 1_000_000 if heartbeat_ns else None,
        "reconcile_corrections": words.reconcile_count,
        "reaped_workers": words.reaped_workers,
        "claims_written": words.claims_cursor,  # kv_aware's routing decisions, in claim records
    }
