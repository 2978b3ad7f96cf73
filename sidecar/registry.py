"""The instance directory: registration, heartbeats, resource snapshots, health, TTL
liveness and purge.

The sidecar is its single owner. What selection needs (id, address, alive, generation, and why
an instance is out) is published into the shared table through DirectoryWriter; the rest
(endpoints, meta, capabilities, qps, the last resource snapshot) lives here. After a sidecar
restart the shared table is the source of truth: `rebuild` recreates records from it (meta
keeps only what the slot stores: cp_port and max_num_seqs), without capabilities, so the next
heartbeat asks the instance to resend them (`requires_capabilities`).

An instance is in one of three states: healthy (a candidate),
unhealthy (it said so in a heartbeat, or the sidecar's probe of a static instance failed:
out at once, still registered) or expired (silent past the TTL; purged after the grace).
Static instances (PROXY_STATIC_INSTANCES) are configuration: only their probe moves them,
and they are never purged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from shm_schema import DirectoryWriter, InstanceSlot, Segment, layout, read_all

from cacheroute_proxy import instance_wire as wire
from cacheroute_proxy.health import EXPIRED, HEALTHY, UNHEALTHY, slot_health

from .resource_snapshot import InstanceResource, normalise

log = logging.getLogger("cacheroute.sidecar.registry")


@dataclass
class InstanceRecord:
    instance_id: str
    slot: int
    generation: int
    host: str
    port: int
    registered_at: float
    last_seen_at: float
    endpoints: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    weight: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)
    capabilities: wire.Capabilities | None = None
    capability_fingerprint: str | None = None
    qps_1m: float | None = None
    gpu_util: float | None = None
    health: str = HEALTHY
    cp_port: int = 0
    max_num_seqs: int = 0  # 0 = unknown
    kv_inject: int = layout.KV_INJECT_UNKNOWN
    resource: InstanceResource | None = None  # the last accepted resource snapshot
    static: bool = False  # from PROXY_STATIC_INSTANCES: probed by the sidecar, never purged

    @property
    def alive(self) -> bool:
        """A candidate for selection."""
        return self.health == HEALTHY


class InstanceRegistry:
    def __init__(self, seg: Segment, ttl_s: float, purge_grace_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._writer = DirectoryWriter(seg)
        self._seg = seg
        self.ttl_s = ttl_s
        self.purge_grace_s = purge_grace_s
        self._clock = clock
        self._records: dict[str, InstanceRecord] = {}
        # Called with the id of every instance that leaves (unregistered or purged), so what
        # is kept about it elsewhere (its topology links) goes with it.
        self.on_removed: list[Callable[[str], None]] = []
        # Called with the slot of every instance that registers (again) or leaves: its KV is
        # gone (a new engine, or none), so the affinity index forgets what it held.
        self.on_kv_reset: list[Callable[[int], None]] = []
        # Called with the record and the ids of a heartbeat's `resident_keys`.
        self.on_resident_keys: list[Callable[[InstanceRecord, list[str]], None]] = []

    # --- restart ---------------------------------------------------------------------------
    def rebuild(self) -> int:
        """Adopt the instances already in the shared table (a restarted sidecar)."""
        self._writer.repair()
        for slot in read_all(self._seg):
            self._records[slot.instance_id] = InstanceRecord(
                instance_id=slot.instance_id, slot=slot.slot, generation=slot.generation,
                host=slot.host, port=slot.port, registered_at=slot.registered_at_ms / 1000,
                last_seen_at=slot.last_seen_ms / 1000, qps_1m=slot.qps_1m, health=slot_health(slot),
                cp_port=slot.cp_port, max_num_seqs=slot.max_num_seqs, kv_inject=slot.kv_inject,
                meta=_stored_meta(slot))
        return len(self._records)

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._records.get(instance_id)

    def at(self, slot: int, generation: int) -> InstanceRecord | None:
        """The instance in (slot, generation), if it is still registered there."""
        for record in self._records.values():
            if (record.slot, record.generation) == (slot, generation):
                return record
        return None

    # --- control-plane operations --------------------------------------------------------------
    def register(self, req: wire.RegisterRequest, *, healthy: bool = True,
                 static: bool = False) -> InstanceRecord:
        """Upsert. Raises ValueError naming a field that does not fit a
        slot, DirectoryFull when no slot is free; in both cases nothing has changed. A static
        instance whose engine has not answered yet is registered out of the candidate set
        (`healthy=False`) until its probe succeeds."""
        now = self._clock()
        instance_id = req.resolved_id
        record = self._records.get(instance_id)
        meta = {**(record.meta if record else {}), **req.meta}  # merged, as the original did
        cp_port, max_num_seqs = (_meta_int(meta, key) for key in SLOT_META_LIMITS)
        kv_inject = _kv_inject(req.capabilities)
        if record is None:
            slot = self._writer.allocate(instance_id, req.host, req.port, int(now * 1000), cp_port,
                                         max_num_seqs, kv_inject, unhealthy=not healthy)
            record = InstanceRecord(instance_id=instance_id, slot=slot.slot,
                                    generation=slot.generation, host=req.host, port=req.port,
                                    registered_at=now, last_seen_at=now,
                                    health=HEALTHY if healthy else UNHEALTHY)
            self._records[instance_id] = record
            log.info("registered %s at %s:%s (slot %d, generation %d)", instance_id, req.host,
                     req.port, record.slot, record.generation)
        elif (record.host, record.port, record.cp_port, record.max_num_seqs, record.kv_inject) \
                != (req.host, req.port, cp_port, max_num_seqs, kv_inject):
            self._writer.update_registration(record.slot, req.host, req.port, cp_port, max_num_seqs,
                                             kv_inject)
            record.host, record.port = req.host, req.port
        record.cp_port = cp_port
        record.max_num_seqs = max_num_seqs
        record.kv_inject = kv_inject
        record.weight = req.weight
        if req.endpoints:
            record.endpoints = list(req.endpoints)
        if req.tags:
            record.tags = list(req.tags)
        record.meta = meta
        record.capabilities = req.capabilities
        record.capability_fingerprint = wire.fingerprint(req.capabilities)
        record.static = record.static or static
        for hook in self.on_kv_reset:
            hook(record.slot)
        if healthy:
            self._seen(record, now)
        return record

    def heartbeat(self, req: wire.HeartbeatRequest) -> dict[str, Any]:
        record = self._records.get(req.instance_id)
        if record is None:
            return {"ok": False}
        if req.capabilities is None and req.capability_fingerprint is not None \
                and req.capability_fingerprint != record.capability_fingerprint:
            reason = ("capability_fingerprint_unknown" if record.capability_fingerprint is None
                      else "capability_fingerprint_mismatch")
            return {"ok": False, "error": reason, "requires_capabilities": True,
                    "expected_fingerprint": record.capability_fingerprint,
                    "reported_fingerprint": req.capability_fingerprint}
        if req.capabilities is not None:
            record.capabilities = req.capabilities
            record.capability_fingerprint = wire.fingerprint(req.capabilities)
            self._set_kv_inject(record, _kv_inject(req.capabilities))
        if req.qps_1m is not None:
            record.qps_1m = req.qps_1m
        if req.gpu_util is not None:
            record.gpu_util = req.gpu_util
        if req.resident_keys is not None:
            for hook in self.on_resident_keys:
                hook(record, req.resident_keys)
        now = self._clock()
        if req.healthy is False:
            self._touch(record, now)
            self._unhealthy(record, "its heartbeat says healthy: false")
        else:
            self._seen(record, now)
        return {"ok": True}

    def _set_kv_inject(self, record: InstanceRecord, kv_inject: int) -> None:
        if kv_inject != record.kv_inject:
            record.kv_inject = kv_inject
            self._writer.update_registration(record.slot, record.host, record.port, record.cp_port,
                                             record.max_num_seqs, kv_inject)

    def report_resource(self, req: wire.ResourceSnapshotRequest) -> bool:
        """Keep the normalised snapshot. It refreshes liveness like a
        heartbeat, but does not overrule a heartbeat's `healthy: false`."""
        record = self._records.get(req.instance_id)
        if record is None:
            return False
        now = self._clock()
        first = record.resource is None
        record.resource = normalise(req.snapshot, req.metadata, now)
        if first:
            log.info("first resource snapshot from %s", record.instance_id)
        self._touch(record, now)
        if record.health == EXPIRED:
            self._healthy(record)
        return True

    def probe_result(self, instance_id: str, ok: bool, detail: str = "") -> None:
        """A static instance's health probe: success counts as seen, failure takes it out."""
        record = self._records.get(instance_id)
        if record is None:
            return
        if ok:
            self._seen(record, self._clock())
        else:
            self._unhealthy(record, f"its health probe failed ({detail})" if detail else "its health probe failed")

    def unregister(self, instance_id: str) -> bool:
        record = self._records.get(instance_id)
        if record is None:
            return False
        self._remove(record)
        log.info("unregistered %s (slot %d freed)", instance_id, record.slot)
        return True

    def _remove(self, record: InstanceRecord) -> None:
        self._records.pop(record.instance_id, None)
        self._writer.free(record.slot)
        for hook in self.on_removed:
            hook(record.instance_id)
        for reset in self.on_kv_reset:
            reset(record.slot)

    # --- health transitions: each logged once -------------------------------------------------------
    def _touch(self, record: InstanceRecord, now: float) -> None:
        record.last_seen_at = now
        self._writer.touch(record.slot, int(now * 1000), record.qps_1m)

    def _seen(self, record: InstanceRecord, now: float) -> None:
        self._touch(record, now)
        self._healthy(record)

    def _healthy(self, record: InstanceRecord) -> None:
        if record.health != HEALTHY:
            was, record.health = record.health, HEALTHY
            self._writer.set_alive(record.slot, True)
            log.info("%s is healthy again (was %s): back in the candidate set", record.instance_id, was)

    def _unhealthy(self, record: InstanceRecord, why: str) -> None:
        if record.health != UNHEALTHY:
            record.health = UNHEALTHY
            self._writer.set_alive(record.slot, False, unhealthy=True)
            log.warning("%s is unhealthy: %s; out of the candidate set, still registered",
                        record.instance_id, why)

    # --- liveness ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Publish TTL expiry to the alive flags; purge instances expired for longer than the
        grace. Static instances are left to their probe."""
        now = self._clock()
        for record in list(self._records.values()):
            if record.static:
                continue
            silent_for = now - record.last_seen_at
            if record.health != EXPIRED and silent_for > self.ttl_s:
                record.health = EXPIRED
                self._writer.set_alive(record.slot, False)
                log.warning("%s missed heartbeats for %.1fs (ttl %.1fs): out of the candidate set",
                            record.instance_id, silent_for, self.ttl_s)
            elif record.health == EXPIRED and silent_for > self.ttl_s + self.purge_grace_s:
                self._remove(record)
                log.warning("%s purged after %.1fs without heartbeat (slot %d freed)",
                            record.instance_id, silent_for, record.slot)

    # --- reads -----------------------------------------------------------------------------------
    def records(self, include_dead: bool = True) -> list[InstanceRecord]:
        rows = sorted(self._records.values(), key=lambda r: (r.registered_at, r.slot))
        return [r for r in rows if include_dead or r.alive]

    def row(self, record: InstanceRecord, inflight: int | None) -> dict[str, Any]:
        """A `/v1/instance/list` row."""
        return {
            "instance_id": record.instance_id, "host": record.host, "port": record.port,
            "endpoints": record.endpoints, "tags": record.tags, "weight": record.weight,
            "meta": record.meta,
            "capabilities": None if record.capabilities is None else msgspec.to_builtins(record.capabilities),
            "capability_fingerprint": record.capability_fingerprint,
            "registered_at": record.registered_at, "last_seen_at": record.last_seen_at,
            "load": {"inflight": inflight, "qps_1m": record.qps_1m, "gpu_util": record.gpu_util},
            "resource": None if record.resource is None else msgspec.to_builtins(record.resource),
            "slot": record.slot, "slot_generation": record.generation, "is_alive": record.alive,
            "health": record.health, "static": record.static,
        }

    def resource_row(self, record: InstanceRecord) -> dict[str, Any]:
        """A `/debug/instance_resources` row: the resource without its raw copy."""
        return {"instance_id": record.instance_id, "host": record.host, "port": record.port,
                "last_seen_at": record.last_seen_at,
                "resource": None if record.resource is None else record.resource.summary()}


def _kv_inject(capabilities: wire.Capabilities | None) -> int:
    """What the slot says of the instance's KV pull (layout.KV_INJECT_*), from its capabilities."""
    pulls = None if capabilities is None else capabilities.pulls_kv()
    if pulls is None:
        return layout.KV_INJECT_UNKNOWN
    return layout.KV_INJECT_YES if pulls else layout.KV_INJECT_NO


def _stored_meta(slot: InstanceSlot) -> dict[str, Any]:
    """The part of an instance's meta that its slot in the shared table keeps."""
    return {key: getattr(slot, key) for key in SLOT_META_LIMITS if getattr(slot, key)}


# Meta fields an instance's slot in the shared table keeps, with their largest valid value
# (max_num_seqs: vLLM's own ceiling is far below; anything larger is a typo, not a capacity).
SLOT_META_LIMITS = {"cp_port": 65535, "max_num_seqs": 65536}


def _meta_int(meta: dict[str, Any], key: str) -> int:
    """A positive integer the instance's meta names (cp_port: its control-plane port;
    max_num_seqs: how many sequences it runs at once), else 0: unknown. A bad value is
    ignored, not refused: the original Proxy accepted any meta."""
    value = meta.get(key)
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= SLOT_META_LIMITS[key]
    return value if valid else 0
