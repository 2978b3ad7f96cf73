"""Proxy -> Scheduler control-plane bodies (docs/protocol.md, "Scheduler control plane"), one
msgspec Struct each.

The `pool_resource` snapshot keeps its nulls on the wire: null means "unknown / not reported",
0 means a measured zero (the original's null semantics), so no field is omitted.
"""

from __future__ import annotations

from typing import Any

import msgspec

ENDPOINTS = ["chat/completions", "completions"]
PROXY_VERSION = "proxy_v1"


class MetricQuality(msgspec.Struct):
    resource: str
    load: str
    queue: str


class Freshness(msgspec.Struct):
    min: float | None = None
    avg: float | None = None
    max: float | None = None


class InstanceCounts(msgspec.Struct):
    total: int
    alive: int
    stale: int
    with_resource: int
    missing_resource: int
    accepting: int
    degraded: int
    rejecting: int


class PoolLoad(msgspec.Struct):
    inflight_total: int | None
    qps_1m_total: float | None
    load_ratio: float | None
    capacity: int
    prepare_queue_depth: int | None
    ready_queue_depth: int | None
    queue_pressure: float | None


class Utilization(msgspec.Struct):
    cpu_avg: float | None = None
    cpu_max: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    memory_used_ratio: float | None = None
    memory_free_ratio_min: float | None = None
    gpu_util_avg: float | None = None
    gpu_util_max: float | None = None
    gpu_mem_used_mb: float | None = None
    gpu_mem_total_mb: float | None = None
    gpu_mem_used_ratio: float | None = None
    network_rx_mbps_total: float | None = None
    network_tx_mbps_total: float | None = None


class PoolResource(msgspec.Struct):
    """The `pool_resource` snapshot, schema_version 1."""

    schema_version: int
    proxy_id: str
    generated_at: float
    ttl_s: float
    metric_source: dict[str, str]
    metric_quality: MetricQuality
    resource_freshness_s: Freshness
    instances: InstanceCounts
    load: PoolLoad
    utilization: Utilization
    pool_admission_state: str
    pool_admission_reason: str


class ProxyMeta(msgspec.Struct, omit_defaults=True):
    version: str  # required, so omit_defaults never drops it
    kdn_links: dict[str, Any] | None = None  # only when there are some


class RegisterBody(msgspec.Struct):
    proxy_id: str
    host: str
    port: int
    endpoints: list[str]
    tags: list[str]
    weight: float
    meta: ProxyMeta
    max_capacity: int
    instance_count: int
    kv_mem_per_instance_gb: float
    kv_cache_update_policy: str
    pool_resource: PoolResource


class RegisterReply(msgspec.Struct):
    """Only what the proxy uses; the Scheduler may add more."""

    proxy_id: str | None = None
    heartbeat_interval_s: float | None = None
    ttl_s: float | None = None


class MetaPatch(msgspec.Struct):
    kdn_links: dict[str, Any]


class HeartbeatBody(msgspec.Struct, omit_defaults=True):
    proxy_id: str
    pool_resource: PoolResource
    meta_patch: MetaPatch | None = None


class UnregisterBody(msgspec.Struct):
    proxy_id: str
