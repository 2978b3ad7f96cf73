"""The bodies the Scheduler accepts, validated with msgspec.

Written from the protocol, not imported from the proxy, so a drift between what the proxy sends
and what docs/protocol.md, "Scheduler control plane", says fails here. The top level is lenient
about extra keys (the original's pydantic models ignore them); ``pool_resource`` is exact: every
key of the schema present, no other, values null or of the right type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Quality = Literal["complete", "partial", "missing"]
Admission = Literal["accepting", "degraded", "rejecting"]


class _Exact(msgspec.Struct, forbid_unknown_fields=True):
    pass


class MetricQuality(_Exact):
    resource: Quality
    load: Quality
    queue: Quality


class Freshness(_Exact):
    min: NonNegative | None
    avg: NonNegative | None
    max: NonNegative | None


class Instances(_Exact):
    total: Count
    alive: Count
    stale: Count
    with_resource: Count
    missing_resource: Count
    accepting: Count
    degraded: Count
    rejecting: Count


class Load(_Exact):
    inflight_total: Count | None
    qps_1m_total: NonNegative | None
    load_ratio: NonNegative | None
    capacity: Count
    prepare_queue_depth: Count | None
    ready_queue_depth: Count | None
    queue_pressure: NonNegative | None


class Utilization(_Exact):
    cpu_avg: float | None
    cpu_max: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    memory_used_ratio: float | None
    memory_free_ratio_min: float | None
    gpu_util_avg: float | None
    gpu_util_max: float | None
    gpu_mem_used_mb: float | None
    gpu_mem_total_mb: float | None
    gpu_mem_used_ratio: float | None
    network_rx_mbps_total: float | None
    network_tx_mbps_total: float | None


class PoolResource(_Exact):
    schema_version: Literal[1]
    proxy_id: NonEmpty
    generated_at: float
    ttl_s: float
    metric_source: dict[str, str]
    metric_quality: MetricQuality
    resource_freshness_s: Freshness
    instances: Instances
    load: Load
    utilization: Utilization
    pool_admission_state: Admission
    pool_admission_reason: str


class RegisterRequest(msgspec.Struct):
    host: NonEmpty
    port: Port
    proxy_id: NonEmpty | None = None
    endpoints: list[str] = msgspec.field(default_factory=lambda: ["chat/completions", "completions"])
    tags: list[str] = []
    weight: NonNegative = 1.0
    meta: dict[str, Any] = {}
    max_capacity: Count = 0
    instance_count: Count = 0
    kv_mem_per_instance_gb: NonNegative = 0.0
    kv_cache_update_policy: str = "lru"
    pool_resource: PoolResource | None = None


class RegisterReply(msgspec.Struct):
    proxy_id: str
    heartbeat_interval_s: float
    ttl_s: float


class HeartbeatRequest(msgspec.Struct):
    proxy_id: NonEmpty
    meta_patch: dict[str, Any] | None = None
    pool_resource: PoolResource | None = None


class UnregisterRequest(msgspec.Struct):
    proxy_id: NonEmpty
