"""The wire format between an instance (or the agent beside it) and the proxy's control plane
(docs/protocol.md, "Instance control plane"), one msgspec Struct per payload: the sidecar
decodes them, an agent encodes them.

Decoding validates: a wrong type or a missing required field is rejected with msgspec's
message, which names the field (``Expected `int`, got `str` - at `$.port```).
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Annotated, Any

import msgspec

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# A hostname (labels of 1-63 letters, digits or inner hyphens), IPv4, or IPv6 plain or in
# brackets; no scheme, no path, no spaces. \Z, not $: "$" would also accept a trailing newline.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"^(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]+)\Z")
# What a refused host is told it should be (the pattern above, in words).
HOST_RULE = "a host name, an IPv4 address or an IPv6 address (no scheme, port, path or spaces)"
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]  # and is_host: RegisterRequest
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=112)]
KnowledgeId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_RESIDENT_KEYS = 65536  # a body limit more than a cache limit: the index keeps the 512 most recent
NonNegative = Annotated[float, msgspec.Meta(ge=0)]


# The cache feature an instance lists (capabilities.runtime.supported_cache_features) when its
# control plane can pull knowledge KV from a KDN: without it, knowledge goes in as text.
KV_INJECT_FEATURE = "kv_inject"


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ModelCapability(_Strict):
    identifier: str | None = None
    revision: str | None = None


class KvCacheCapability(_Strict):
    layout: str | None = None
    schema_version: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    layout_parameters: dict[str, Any] | None = None


class ParallelismCapability(_Strict):
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None


class RuntimeCapability(_Strict):
    vllm_version: str | None = None
    lmcache_version: str | None = None
    supported_cache_features: list[str] | None = None


class Capabilities(_Strict):
    """Like the original's pydantic model: unknown keys are rejected."""

    schema_version: str = "1"
    model: ModelCapability | None = None
    tokenizer: dict[str, Any] | None = None
    adapters: list[Any] | None = None
    kv_cache: KvCacheCapability | None = None
    parallelism: ParallelismCapability | None = None
    runtime: RuntimeCapability | None = None

    def pulls_kv(self) -> bool | None:
        """Can the instance pull knowledge KV on `POST /v1/kv/inject_ready`? True if it lists
        the KV_INJECT_FEATURE, False if it lists its cache features without it, None if it
        lists none (an instance that says nothing is tried, as the original did)."""
        features = self.runtime.supported_cache_features if self.runtime else None
        return None if features is None else KV_INJECT_FEATURE in features


class RegisterRequest(msgspec.Struct):
    host: Host
    port: Port
    instance_id: InstanceId | None = None
    endpoints: list[str] = []
    tags: list[str] = []
    weight: NonNegative = 1.0
    meta: dict[str, Any] = {}
    capabilities: Capabilities | None = None
    capability_fingerprint: str | None = None  # ignored: the server computes its own

    def __post_init__(self) -> None:
        if not is_host(self.host):  # in words: msgspec's own message would show the pattern
            raise ValueError(f"Expected {HOST_RULE}, got {self.host!r} - at `$.host`")

    @property
    def resolved_id(self) -> str:
        return self.instance_id or f"hp_{self.host}:{self.port}"


def is_host(text: str) -> bool:
    return _HOST.match(text) is not None


class RegisterReply(msgspec.Struct):
    instance_id: str
    heartbeat_interval_s: int
    ttl_s: float
    capability_fingerprint: str | None


class HeartbeatRequest(msgspec.Struct, omit_defaults=True):
    instance_id: InstanceId
    inflight: int | None = None  # accepted for compatibility, ignored: the proxy owns inflight
    qps_1m: NonNegative | None = None
    gpu_util: NonNegative | None = None
    capabilities: Capabilities | None = None
    capability_fingerprint: str | None = None
    # An extension of the original's heartbeat (absent: as before): the agent beside an
    # engine says whether the engine answers. False takes the instance out of the candidate
    # set at once, without forgetting it; the next heartbeat without it, or with true, brings
    # it back.
    healthy: bool | None = None
    # Another extension: the knowledge ids whose KV the instance holds now, its own account.
    # When present it replaces what the proxy's affinity index modelled for the instance's
    # knowledge (an empty list: none is resident); absent: the model stands.
    resident_keys: Annotated[list[KnowledgeId], msgspec.Meta(max_length=MAX_RESIDENT_KEYS)] | None = None


class UnregisterRequest(msgspec.Struct):
    instance_id: InstanceId


# --- resource snapshots ---------------------------------------------------------------------
class ReportMetadata(msgspec.Struct, omit_defaults=True):
    """About the report rather than the machine. Unknown keys are ignored, as the original did."""

    reported_instance_id: str | None = None
    report_monotonic_ms: float | None = None
    report_wall_time_ms: float | None = None
    agent_snapshot_timestamp_ms: float | None = None


class ResourceSnapshotRequest(msgspec.Struct, omit_defaults=True):
    """`POST /v1/instance/resource_snapshot`. The snapshot's inner shape is the agent's
    (`resource_snapshot_v1` below is what ours sends): any JSON object is accepted and read
    leniently, so the proxy keeps taking reports from agents it does not know."""

    instance_id: InstanceId
    snapshot: dict[str, Any]
    metadata: ReportMetadata = msgspec.field(default_factory=ReportMetadata)


# What an agent measures: a number, or None for "not measured" (never 0 for unknown).
Reading = float | None


class _Lenient(msgspec.Struct, omit_defaults=True):
    """An agent-defined shape: readers ignore keys they do not know."""


class CpuReading(_Lenient):
    utilization_pct: Reading = None
    load1: Reading = None
    load5: Reading = None
    load15: Reading = None


class MemoryReading(_Lenient):
    used_mb: Reading = None
    total_mb: Reading = None
    free_mb: Reading = None


class GpuReading(_Lenient):
    """One GPU. The utilization is a windowed average (`utilization_pct_avg`) with the latest
    and the highest sample of the window; `utilization_sample_ok: false` or a failed quality
    makes the proxy skip this GPU's utilization."""

    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    utilization_pct: Reading = None
    utilization_pct_avg: Reading = None
    utilization_pct_current: Reading = None
    utilization_pct_max: Reading = None
    utilization_sample_count: int | None = None
    utilization_window_ms: int | None = None
    utilization_sample_ok: bool | None = None
    utilization_sample_quality: str | None = None
    utilization_source: str | None = None
    utilization_sample_timestamp_ms: int | None = None
    memory_used_mb: Reading = None
    memory_total_mb: Reading = None
    memory_free_mb: Reading = None


class NetworkReading(_Lenient):
    iface: str | None = None
    rx_mbps: Reading = None
    tx_mbps: Reading = None
    speed_mbps: Reading = None


class Devices(_Lenient):
    cpu: CpuReading | None = None
    memory: MemoryReading | None = None
    gpu: list[GpuReading] = []
    network: list[NetworkReading] = []  # the first one is the instance's link


class CapacityHint(_Lenient):
    memory_free_ratio: Reading = None
    admission_state: str | None = None  # "accepting" | "degraded" | "rejecting"


REJECTING_BELOW_FREE_RATIO = 0.05   # the original agent's capacity hints
DEGRADED_ABOVE_CPU_PCT = 95.0


def admission_state(free_ratio: float | None, cpu_pct: float) -> str:
    """The capacity hint an agent sends for a machine with this share of its memory free and
    this CPU utilization (the original agent's rule; ours and the simulated instance's)."""
    if free_ratio is not None and free_ratio < REJECTING_BELOW_FREE_RATIO:
        return "rejecting"
    if cpu_pct > DEGRADED_ABOVE_CPU_PCT:
        return "degraded"
    return "accepting"


class ResourceSnapshotV1(msgspec.Struct):
    """`resource_snapshot_v1`, the shape the original's agent sent and ours sends (every
    top-level key on the wire, `schema_version` included)."""

    timestamp_ms: int | None = None
    schema_version: str = "resource_snapshot_v1"
    agent_version: str | None = None
    instance_id: str | None = None
    devices: Devices = msgspec.field(default_factory=Devices)
    capacity_hint: CapacityHint | None = None
    runtime: dict[str, Any] | None = None


def resource_snapshot_request(instance_id: str, snapshot: ResourceSnapshotV1,
                              metadata: ReportMetadata | None = None) -> ResourceSnapshotRequest:
    """The body an agent sends for `snapshot` (the request keeps the snapshot as a plain object)."""
    return ResourceSnapshotRequest(instance_id=instance_id, snapshot=msgspec.to_builtins(snapshot),
                                   metadata=metadata or ReportMetadata())


def stamped_metadata(instance_id: str, snapshot: ResourceSnapshotV1) -> ReportMetadata:
    """The metadata an agent sends with `snapshot` now: who reports, when (both clocks)."""
    return ReportMetadata(reported_instance_id=instance_id, report_monotonic_ms=int(time.monotonic() * 1000),
                          report_wall_time_ms=int(time.time() * 1000),
                          agent_snapshot_timestamp_ms=snapshot.timestamp_ms)


# --- topology -----------------------------------------------------------------------------
class TopologyReportRequest(msgspec.Struct):
    """`POST /v1/topology/report`: this instance's links, keyed by KDN key (the KDN's `kdn_id`
    and `kdn://host:port`), each an object of metrics (`bandwidth_mbps`, `latency_ms`,
    `iface`, `measured_by`, ...). An entry that is not an object is dropped, as the original did."""

    instance_id: InstanceId
    links: dict[str, Any]


def fingerprint(capabilities: Capabilities | None) -> str | None:
    """sha256 of the canonical JSON: nulls dropped, cache features sorted and deduplicated,
    keys sorted, compact separators (the original's definition)."""
    if capabilities is None:
        return None
    data = _drop_nulls(msgspec.to_builtins(capabilities))
    features = data.get("runtime", {}).get("supported_cache_features")
    if features is not None:
        data["runtime"]["supported_cache_features"] = sorted(set(features))
    canonical = msgspec.json.encode(_sorted(data))
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value

