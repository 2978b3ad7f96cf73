"""Why an instance is or is not a candidate for selection, as every process reads it from the
instance's slot (docs/protocol.md, "Liveness, purge and restarts")."""

from __future__ import annotations

from shm_schema import InstanceSlot

HEALTHY = "healthy"      # a candidate
UNHEALTHY = "unhealthy"  # out: its heartbeat said `healthy: false`, or its probe failed
EXPIRED = "expired"      # out: silent for longer than the TTL


def slot_health(slot: InstanceSlot) -> str:
    if slot.alive:
        return HEALTHY
    return UNHEALTHY if slot.unhealthy else EXPIRED
