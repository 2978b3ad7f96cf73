"""Header words shared by every process: cursors, sidecar presence, debug counters."""

from __future__ import annotations

import time
from typing import Any

from . import layout, process_identity
from .segment import Segment


def next_round_robin(seg: Segment) -> int:
    """A host-wide round-robin cursor: N workers together rotate like one process."""
    return seg.atomic.fetch_add_u64(layout.H_RR_COUNTER, 1)


def next_tie_break(seg: Segment) -> int:
    return seg.atomic.fetch_add_u64(layout.H_TIE_COUNTER, 1)


def claim_sidecar(seg: Segment) -> int:
    """Record this process as the sidecar; returns the new sidecar epoch."""
    seg.store(layout.H_SIDECAR_IDENTITY, process_identity.own_identity())
    sidecar_heartbeat(seg)
    return seg.fetch_add(layout.H_SIDECAR_EPOCH, 1) + 1


def other_live_sidecar(seg: Segment) -> int | None:
    """The pid of a live sidecar other than this process that owns the segment, if any."""
    identity = seg.load(layout.H_SIDECAR_IDENTITY)
    if identity and identity != process_identity.own_identity() and process_identity.is_alive(identity):
        return layout.unpack_identity(identity)[0]
    return None


def release_sidecar(seg: Segment) -> None:
    seg.store(layout.H_SIDECAR_IDENTITY, 0)


def sidecar_heartbeat(seg: Segment) -> None:
    seg.store(layout.H_SIDECAR_HEARTBEAT_NS, time.time_ns())


def count_reaped_worker(seg: Segment) -> None:
    seg.fetch_add(layout.H_REAPED_WORKERS, 1)


def describe(seg: Segment) -> dict[str, Any]:
    """The header as JSON-friendly values, for /debug/status."""
    identity = seg.load(layout.H_SIDECAR_IDENTITY)
    heartbeat_ns = seg.load(layout.H_SIDECAR_HEARTBEAT_NS)
    return {
        "name": seg.name,
        "layout_version": seg.load(layout.H_LAYOUT_VERSION),
        "creation_id": f"{seg.creation_id:016x}",
        "created_at_ms": seg.load(layout.H_CREATED_AT_NS) // 1_000_000,
        "instance_capacity": seg.geometry.instance_capacity,
        "worker_capacity": seg.geometry.worker_capacity,
        "total_size": seg.geometry.total_size,
        "directory_seq": seg.load(layout.H_DIRECTORY_SEQ),
        "sidecar_pid": layout.unpack_identity(identity)[0] if identity else None,
        "sidecar_alive": bool(identity) and process_identity.is_alive(identity),
        "sidecar_epoch": seg.load(layout.H_SIDECAR_EPOCH),
        "sidecar_heartbeat_age_ms": (time.time_ns() - heartbeat_ns) // 1_000_000 if heartbeat_ns else None,
        "reconcile_corrections": seg.load(layout.H_RECONCILE_COUNT),
        "reaped_workers": seg.load(layout.H_REAPED_WORKERS),
    }
