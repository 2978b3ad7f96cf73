"""The wire format between an instance (or the agent beside it) and the proxy's control plane
(docs/protocol.md §3), one msgspec Struct per payload: the sidecar decodes them, an agent
encodes them.

Decoding validates: a wrong type or a missing required field is rejected with msgspec's
message, which names the field (``Expected `int`, got `str` - at `$.port```).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import msgspec

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# A hostname (labels of 1-63 letters, digits or inner hyphens), IPv4, or IPv6 plain or in
# brackets; no scheme, no path, no spaces. \Z, not $: "$" would also accept a trailing newline.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_PATTERN = rf"^(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]+)\Z"
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=HOST_PATTERN)]
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=112)]
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

    @property
    def resolved_id(self) -> str:
        return self.instance_id or f"hp_{self.host}:{self.port}"


class RegisterReply(msgspec.Struct):
    instance_id: str
    heartbeat_interval_s: int
    ttl_s: float
    capability_fingerprint: str | None


class HeartbeatRequest(msgspec.Struct):
    instance_id: InstanceId
    inflight: int | None = None  # accepted for compatibility, ignored: the proxy owns inflight
    qps_1m: NonNegative | None = None
    gpu_util: NonNegative | None = None
    capabilities: Capabilities | None = None
    capability_fingerprint: str | None = None
    # An extension of the original's heartbeat (absent: as before): the agent beside an engine
    # says whether the engine answers. False takes the instance out of the candidate set at
    # once, without forgetting it; the next heartbeat without it, or with true, brings it back.
    healthy: bool | None = None


class UnregisterRequest(msgspec.Struct):
    instance_id: InstanceId


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

