"""The `pool_resource` snapshot the proxy reports to the Scheduler (docs/protocol.md, "The
`pool_resource` snapshot").

Computed by the sidecar from its registry (who is alive, the instances' resource snapshots) and the shared
table (inflight and queue depths as every worker sees them), so one snapshot speaks for all
workers. Over alive instances only; a sum is null when no instance reports the metric.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.load_view import LoadView

from .registry import InstanceRecord, InstanceRegistry
from .scheduler_wire import (
    Freshness,
    InstanceCounts,
    MetricQuality,
    PoolLoad,
    PoolResource,
    Utilization,
)

ADMISSION_STATES = ("accepting", "degraded", "rejecting")
NULL_SEMANTICS = "0 means measured zero; null means unavailable, not wired, or unknown"


class ResourceReport(Protocol):
    """What the snapshot reads of an instance's normalised resource snapshot
    (sidecar/resource_snapshot.py's InstanceResource)."""

    cpu_util: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    memory_free_ratio: float | None
    gpu_util_avg: float | None
    gpu_mem_used_mb: float | None
    gpu_mem_total_mb: float | None
    network_rx_mbps: float | None
    network_tx_mbps: float | None
    admission_state: str | None
    resource_reported_at: float | None


def resource_of(record: InstanceRecord) -> ResourceReport | None:
    """The instance's last accepted resource snapshot, None before one."""
    return record.resource


@dataclass(frozen=True)
class PoolInputs:
    proxy_id: str
    capacity: int
    ttl_s: float


def build(inputs: PoolInputs, records: Sequence[InstanceRecord], view: LoadView,
          now: float | None = None) -> PoolResource:
    now = time.time() if now is None else now
    alive = [r for r in records if r.alive]
    reports = [rep for rep in (resource_of(r) for r in alive) if rep is not None]
    load = _load(alive, view, inputs.capacity)
    admission = _admission_counts(reports)
    state = _pool_state(len(alive), len(reports), admission)
    return PoolResource(
        schema_version=1, proxy_id=inputs.proxy_id, generated_at=now, ttl_s=inputs.ttl_s,
        metric_source=_sources(load, bool(reports)),
        metric_quality=MetricQuality(
            resource=_quality(len(reports), len(alive)),
            load=_load_quality(alive, load),
            queue="complete" if load.prepare_queue_depth is not None
            and load.ready_queue_depth is not None else "missing"),
        resource_freshness_s=_freshness(reports, now),
        instances=InstanceCounts(
            total=len(records), alive=len(alive), stale=len(records) - len(alive),
            with_resource=len(reports), missing_resource=len(alive) - len(reports), **admission),
        load=load, utilization=_utilization(reports), pool_admission_state=state,
        pool_admission_reason=(f"{admission['accepting']} accepting, {admission['degraded']} degraded, "
                               f"{admission['rejecting']} rejecting, {len(alive)} alive"))


# --- load: the shared table ----------------------------------------------------------------
def _load(alive: Sequence[InstanceRecord], view: LoadView, capacity: int) -> PoolLoad:
    components: dict[str, list[Any]] = view.components(alive) if alive else {}
    inflight = _sum(components.get("inflight", []))
    prepare = _sum(components.get("prepare_queue_depth", []))
    ready = _sum(components.get("ready_queue_depth", []))
    queued = None if prepare is None and ready is None else (prepare or 0) + (ready or 0)
    return PoolLoad(
        inflight_total=inflight, qps_1m_total=_sum([r.qps_1m for r in alive]),
        load_ratio=_ratio(inflight, capacity), capacity=capacity,
        prepare_queue_depth=prepare, ready_queue_depth=ready,
        queue_pressure=_ratio(queued, capacity))


def _load_quality(alive: Sequence[InstanceRecord], load: PoolLoad) -> str:
    # As the original: inflight and qps per alive instance are the two expected load metrics.
    if not alive:
        return "missing"
    known = (len(alive) if load.inflight_total is not None else 0) + \
        sum(1 for r in alive if r.qps_1m is not None)
    return _quality(known, 2 * len(alive))


def _sources(load: PoolLoad, reporting: bool) -> dict[str, str]:
    def known(value: Any, source: str) -> str:
        return source if value is not None else "unavailable"
    resource = "instance_resource_snapshot" if reporting else "unavailable"
    return {
        "instances": "sidecar_registry_ttl",
        "resource": resource,
        "inflight_total": known(load.inflight_total, "shared_table_inflight"),
        "qps_1m_total": known(load.qps_1m_total, "instance_heartbeat"),
        "load_ratio": known(load.load_ratio, "derived_from_inflight_capacity"),
        "capacity": "proxy_config",
        "prepare_queue_depth": known(load.prepare_queue_depth, "shared_table_queue_lanes"),
        "ready_queue_depth": known(load.ready_queue_depth, "shared_table_queue_lanes"),
        "queue_pressure": known(load.queue_pressure, "derived_from_queue_depth_capacity"),
        "utilization": resource,
        "pool_admission_state": "derived_from_instance_resource_admission",
        "resource_freshness_s": "derived_from_instance_resource_report_time" if reporting else "unavailable",
    }


# --- resources and admission: instance reports ------------------------------------------------
def _admission_counts(reports: Sequence[ResourceReport]) -> dict[str, int]:
    counts = dict.fromkeys(ADMISSION_STATES, 0)
    for rep in reports:
        state = (rep.admission_state or "").strip().lower()
        if state in counts:
            counts[state] += 1
    return counts


def _pool_state(alive: int, reporting: int, counts: dict[str, int]) -> str:
    """Nothing alive, or every instance reports rejecting -> rejecting;
    any degraded or rejecting one, or an alive instance without a report -> degraded; else
    accepting."""
    if alive == 0:
        return "rejecting"
    if reporting and counts["rejecting"] == reporting and reporting == alive:
        return "rejecting"
    if counts["degraded"] or counts["rejecting"] or reporting < alive:
        return "degraded"
    return "accepting"


def _utilization(reports: Sequence[ResourceReport]) -> Utilization:
    def values(name: str) -> list[float]:
        return [float(v) for v in (getattr(rep, name, None) for rep in reports) if v is not None]
    cpu, gpu = values("cpu_util"), values("gpu_util_avg")
    mem_used, mem_total = _sum(values("memory_used_mb")), _sum(values("memory_total_mb"))
    gmem_used, gmem_total = _sum(values("gpu_mem_used_mb")), _sum(values("gpu_mem_total_mb"))
    free_ratios = values("memory_free_ratio")
    return Utilization(
        cpu_avg=_avg(cpu), cpu_max=max(cpu, default=None),
        memory_used_mb=mem_used, memory_total_mb=mem_total,
        memory_used_ratio=_ratio(mem_used, mem_total),
        memory_free_ratio_min=min(free_ratios, default=None),
        gpu_util_avg=_avg(gpu), gpu_util_max=max(gpu, default=None),
        gpu_mem_used_mb=gmem_used, gpu_mem_total_mb=gmem_total,
        gpu_mem_used_ratio=_ratio(gmem_used, gmem_total),
        network_rx_mbps_total=_sum(values("network_rx_mbps")),
        network_tx_mbps_total=_sum(values("network_tx_mbps")))


def _freshness(reports: Sequence[ResourceReport], now: float) -> Freshness:
    ages = [max(0.0, now - float(rep.resource_reported_at)) for rep in reports
            if rep.resource_reported_at is not None]
    if not ages:
        return Freshness()
    return Freshness(min=min(ages), avg=sum(ages) / len(ages), max=max(ages))


# --- arithmetic with unknowns -------------------------------------------------------------------
def _sum(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _avg(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _quality(populated: int, expected: int) -> str:
    if expected <= 0 or populated <= 0:
        return "missing"
    return "complete" if populated >= expected else "partial"


def snapshot_of(registry: InstanceRegistry, view: LoadView, settings: Settings,
                proxy_id: str) -> PoolResource:
    """The snapshot as the sidecar reports it now (heartbeats, `/debug/pool_resource`)."""
    inputs = PoolInputs(proxy_id, settings.max_capacity, settings.instance_ttl_s)
    return build(inputs, registry.records(include_dead=True), view)
