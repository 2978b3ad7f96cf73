"""An instance's resource snapshot, normalised into the fields the original Proxy kept
(docs/protocol.md, "Resource snapshots").

The snapshot's shape is the agent's: every level is read leniently, so a key that is missing,
of the wrong type, or a reading that is no number ("N/A", NaN, infinity, a list...) becomes
null, never 0 and never an error: null means unknown, 0 a measured zero.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import msgspec

from cacheroute_proxy.instance_wire import ReportMetadata

# The stored copy of what the agent sent (`raw_resource`) is bounded: a bigger snapshot is
# refused (413) rather than kept, so a chatty agent cannot grow the sidecar.
RAW_RESOURCE_LIMIT = 64 * 1024

# Strings nvidia-smi and friends print where a number is not available.
_NOT_A_READING = frozenset({"", "n/a", "[n/a]", "not supported", "[not supported]"})
# A GPU sample of one of these qualities (or marked not ok) says nothing about utilization.
_FAILED_QUALITIES = frozenset({"invalid", "failed", "error", "command_error", "parse_error", "unsupported"})

# Where each GPU figure may be, in order of preference (agents name them differently).
_GPU_UTIL_KEYS = ("utilization_pct_avg", "utilization_pct", "utilization_gpu_pct", "gpu_util", "util")
_GPU_CURRENT_KEYS = ("utilization_pct_current", "utilization_current", "gpu_util_current")
_GPU_MAX_KEYS = ("utilization_pct_max", "gpu_util_max")
_GPU_SOURCE_KEYS = ("utilization_source", "gpu_sample_source", "source")
_GPU_COUNT_KEYS = ("utilization_sample_count", "gpu_sample_count")
_GPU_WINDOW_KEYS = ("utilization_window_ms", "gpu_sample_window_ms")


class InstanceResource(msgspec.Struct):
    """What the registry keeps of an instance's last accepted snapshot. Every field is always on
    the wire (null when unknown)."""

    cpu_util: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    memory_free_mb: float | None = None
    memory_free_ratio: float | None = None
    gpu_util_avg: float | None = None
    gpu_util_current: float | None = None
    gpu_util_max: float | None = None
    gpu_sample_count: int | None = None
    gpu_sample_age_ms: int | None = None
    gpu_sample_source: str | None = None
    gpu_sample_quality: str | None = None
    gpu_sample_window_ms: int | None = None
    gpu_mem_used_mb: float | None = None
    gpu_mem_total_mb: float | None = None
    network_rx_mbps: float | None = None
    network_tx_mbps: float | None = None
    admission_state: str | None = None
    resource_ts_ms: int | None = None
    resource_reported_at: float | None = None  # when the sidecar accepted it, epoch seconds
    resource_report_monotonic_ms: int | None = None
    resource_report_wall_time_ms: int | None = None
    reported_instance_id: str | None = None
    raw_resource: dict[str, Any] = {}

    def summary(self) -> dict[str, Any]:
        """Every field but the raw snapshot (what `/debug/instance_resources` shows)."""
        shown = msgspec.structs.asdict(self)
        shown.pop("raw_resource")
        return shown


def normalise(snapshot: dict[str, Any], metadata: ReportMetadata, reported_at: float) -> InstanceResource:
    devices = _object(snapshot.get("devices"))
    cpu, memory = _object(devices.get("cpu")), _object(devices.get("memory"))
    capacity = _object(snapshot.get("capacity_hint"))
    network = _first_object(devices.get("network"))
    snapshot_ts = integer(snapshot.get("timestamp_ms"))
    admission = capacity.get("admission_state")
    return InstanceResource(
        cpu_util=number(cpu.get("utilization_pct")),
        memory_used_mb=number(memory.get("used_mb")),
        memory_total_mb=number(memory.get("total_mb")),
        memory_free_mb=number(memory.get("free_mb")),
        memory_free_ratio=number(capacity.get("memory_free_ratio")),
        **_gpus(_objects(devices.get("gpu")), snapshot_ts),
        network_rx_mbps=number(network.get("rx_mbps")),
        network_tx_mbps=number(network.get("tx_mbps")),
        admission_state=None if admission is None else str(admission),
        resource_ts_ms=snapshot_ts,
        resource_reported_at=reported_at,
        resource_report_monotonic_ms=integer(metadata.report_monotonic_ms),
        resource_report_wall_time_ms=integer(metadata.report_wall_time_ms),
        reported_instance_id=metadata.reported_instance_id,
        raw_resource=snapshot,
    )


def _gpus(gpus: list[dict[str, Any]], snapshot_ts: int | None) -> dict[str, Any]:
    """The GPU fields: utilizations averaged over the GPUs whose sample is valid (the highest
    for max), memory summed, sample bookkeeping from whatever the GPUs say."""
    valid = [gpu for gpu in gpus if _sample_valid(gpu)]
    averages = _known(_first_number(gpu, _GPU_UTIL_KEYS) for gpu in valid)
    currents = _known(_first_number(gpu, _GPU_CURRENT_KEYS) for gpu in valid)
    maxima = _known(_first_number(gpu, _GPU_MAX_KEYS) for gpu in valid)
    counts = _known(integer(_first_number(gpu, _GPU_COUNT_KEYS)) for gpu in gpus)
    windows = _known(integer(_first_number(gpu, _GPU_WINDOW_KEYS)) for gpu in gpus)
    sampled_at = _known(integer(gpu.get("utilization_sample_timestamp_ms")) for gpu in gpus)
    sources = [s for s in (_first_text(gpu, _GPU_SOURCE_KEYS) for gpu in gpus) if s]
    qualities = [q for q in (_quality(gpu) for gpu in gpus) if q]
    return {
        "gpu_util_avg": _mean(averages),
        "gpu_util_current": _mean(currents),
        "gpu_util_max": max(maxima, default=None),
        "gpu_sample_count": sum(counts) if counts else None,
        "gpu_sample_age_ms": (max(0, snapshot_ts - max(sampled_at))
                              if snapshot_ts is not None and sampled_at else None),
        "gpu_sample_source": sources[0] if sources else None,
        "gpu_sample_quality": "ok" if averages else (qualities[0] if qualities else None),
        "gpu_sample_window_ms": max(windows, default=None),
        "gpu_mem_used_mb": _total(number(gpu.get("memory_used_mb")) for gpu in gpus),
        "gpu_mem_total_mb": _total(number(gpu.get("memory_total_mb")) for gpu in gpus),
    }


def _sample_valid(gpu: dict[str, Any]) -> bool:
    quality = str(gpu.get("utilization_sample_quality") or gpu.get("gpu_sample_quality") or "").strip().lower()
    return gpu.get("utilization_sample_ok") is not False and quality not in _FAILED_QUALITIES


def _quality(gpu: dict[str, Any]) -> str | None:
    stated = gpu.get("utilization_sample_quality")
    if stated is not None:
        return str(stated)
    return "ok" if gpu.get("utilization_sample_ok") is True else None


# --- lenient readings -----------------------------------------------------------------------------
def number(value: Any) -> float | None:
    """A finite number, or None for anything else (bools, containers, "N/A", NaN, inf)."""
    if value is None or isinstance(value, (bool, list, dict)):
        return None
    if isinstance(value, str):
        value = value.strip()
        if value.lower() in _NOT_A_READING:
            return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) else None


def integer(value: Any) -> int | None:
    reading = number(value)
    return None if reading is None else int(reading)


def _first_number(payload: dict[str, Any], keys: Iterable[str]) -> float | None:
    for key in keys:
        reading = number(payload.get(key))
        if reading is not None:
            return reading
    return None


def _first_text(payload: dict[str, Any], keys: Iterable[str]) -> str | None:
    for key in keys:
        value = payload.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _objects(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _first_object(value: Any) -> dict[str, Any]:
    """The first entry of a list if it is an object: the network figures are the first
    interface's only, as the original's."""
    return value[0] if isinstance(value, list) and value and isinstance(value[0], dict) else {}


def _known(values: Iterable[Any]) -> list[Any]:
    return [v for v in values if v is not None]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _total(values: Iterable[float | None]) -> float | None:
    known = _known(values)
    return sum(known) if known else None
