"""The host's resources as the original Instances reported them (`resource_snapshot_v1`).

CPU, memory and network from psutil; GPUs through NVML when a GPU and the library (the
`nvidia-ml-py` package, not a dependency) are there, an empty list otherwise — never a crash:
a sample that fails is reported as missing, not guessed. Network rates are deltas between two
samples, so the first snapshot after start reports none. The interfaces are ordered with the
busiest non-loopback one first (the proxy normalises the first one).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import psutil

log = logging.getLogger("cacheroute.agent.resources")

REJECTING_BELOW_FREE_RATIO = 0.05   # the original agent's capacity hints
DEGRADED_ABOVE_CPU_PCT = 95.0


class Cpu(msgspec.Struct):
    utilization_pct: float
    load1: float
    load5: float
    load15: float


class Memory(msgspec.Struct):
    used_mb: float
    total_mb: float
    free_mb: float


class Gpu(msgspec.Struct, omit_defaults=True):
    index: int
    name: str | None = None
    utilization_pct: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    utilization_sample_ok: bool = True


class Network(msgspec.Struct):
    iface: str
    rx_mbps: float | None
    tx_mbps: float | None
    speed_mbps: float | None


class Devices(msgspec.Struct):
    cpu: Cpu
    memory: Memory
    gpu: list[Gpu]
    network: list[Network]


class CapacityHint(msgspec.Struct):
    memory_free_ratio: float | None
    admission_state: str   # accepting / degraded / rejecting


class ResourceSnapshot(msgspec.Struct):
    """`resource_snapshot_v1`, what the agent measures."""

    timestamp_ms: int
    devices: Devices
    capacity_hint: CapacityHint
    schema: str = "resource_snapshot_v1"


class SnapshotMetadata(msgspec.Struct):
    reported_instance_id: str
    report_monotonic_ms: int
    report_wall_time_ms: int
    agent_snapshot_timestamp_ms: int


class ResourceReport(msgspec.Struct):
    """The body of `POST /v1/instance/resource_snapshot`."""

    instance_id: str
    snapshot: ResourceSnapshot
    metadata: SnapshotMetadata


class Sampler:
    """Takes one snapshot at a time; keeps what it needs for rates between two of them."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        self._last_net: tuple[float, dict[str, Any]] | None = None
        self._nvml = _Nvml()

    def snapshot(self) -> ResourceSnapshot:
        now_ms = int(time.time() * 1000)
        cpu = Cpu(psutil.cpu_percent(interval=None), *(round(x, 2) for x in os.getloadavg()))
        vm = psutil.virtual_memory()
        memory = Memory(used_mb=_mb(vm.total - vm.available), total_mb=_mb(vm.total), free_mb=_mb(vm.available))
        free_ratio = vm.available / vm.total if vm.total else None
        devices = Devices(cpu=cpu, memory=memory, gpu=self._nvml.sample(), network=self._network())
        return ResourceSnapshot(now_ms, devices, CapacityHint(
            memory_free_ratio=None if free_ratio is None else round(free_ratio, 4),
            admission_state=admission_state(free_ratio, cpu.utilization_pct)))

    def _network(self) -> list[Network]:
        now = time.monotonic()
        counters = psutil.net_io_counters(pernic=True)
        stats = psutil.net_if_stats()
        last, self._last_net = self._last_net, (now, counters)
        rows = []
        for iface, io in counters.items():
            if iface == "lo" or iface.startswith("lo:"):
                continue
            rx = tx = None
            if last is not None and iface in last[1] and now > last[0]:
                seconds = now - last[0]
                rx = round(max(0, io.bytes_recv - last[1][iface].bytes_recv) * 8 / 1e6 / seconds, 3)
                tx = round(max(0, io.bytes_sent - last[1][iface].bytes_sent) * 8 / 1e6 / seconds, 3)
            speed = stats[iface].speed if iface in stats and stats[iface].speed > 0 else None
            rows.append((io.bytes_recv + io.bytes_sent, Network(iface, rx, tx, speed)))
        return [row for _, row in sorted(rows, key=lambda pair: -pair[0])]


def admission_state(free_ratio: float | None, cpu_pct: float) -> str:
    if free_ratio is not None and free_ratio < REJECTING_BELOW_FREE_RATIO:
        return "rejecting"
    if cpu_pct > DEGRADED_ABOVE_CPU_PCT:
        return "degraded"
    return "accepting"


def _mb(value: float) -> float:
    return round(value / (1024 * 1024), 1)


class _Nvml:
    """GPUs through NVML, if there are any and the library loads; [] otherwise."""

    def __init__(self) -> None:
        self._lib: Any = None
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self._lib = pynvml
        except Exception as exc:  # no package, no driver, no GPU: all mean "no GPUs to report"
            log.debug("no NVML (%s): reporting no GPUs", type(exc).__name__)

    def sample(self) -> list[Gpu]:
        if self._lib is None:
            return []
        nvml, gpus = self._lib, []
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception:
            return []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                name = nvml.nvmlDeviceGetName(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else str(name),
                                float(util.gpu), _mb(mem.used), _mb(mem.total)))
            except Exception:  # one GPU that cannot be read is reported as such
                gpus.append(Gpu(index, utilization_sample_ok=False))
        return gpus
