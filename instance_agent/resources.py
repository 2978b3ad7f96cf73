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

import psutil

from cacheroute_proxy.instance_wire import (
    CapacityHint,
    CpuReading,
    Devices,
    GpuReading,
    MemoryReading,
    NetworkReading,
    ResourceSnapshotV1,
    admission_state,
)

log = logging.getLogger("cacheroute.agent.resources")

AGENT_VERSION = "cacheroute-instance-agent/1"


class Sampler:
    """Takes one snapshot at a time; keeps what it needs for rates between two of them."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        self._last_net: tuple[float, dict[str, Any]] | None = None
        self._nvml = _Nvml()

    def snapshot(self, instance_id: str) -> ResourceSnapshotV1:
        load1, load5, load15 = (round(x, 2) for x in os.getloadavg())
        cpu_pct = psutil.cpu_percent(interval=None)
        vm = psutil.virtual_memory()
        free_ratio = vm.available / vm.total if vm.total else None
        devices = Devices(
            cpu=CpuReading(utilization_pct=cpu_pct, load1=load1, load5=load5, load15=load15),
            memory=MemoryReading(used_mb=_mb(vm.total - vm.available), total_mb=_mb(vm.total),
                                 free_mb=_mb(vm.available)),
            gpu=self._nvml.sample(), network=self._network())
        return ResourceSnapshotV1(
            timestamp_ms=int(time.time() * 1000), agent_version=AGENT_VERSION, instance_id=instance_id,
            devices=devices, capacity_hint=CapacityHint(
                memory_free_ratio=None if free_ratio is None else round(free_ratio, 4),
                admission_state=admission_state(free_ratio, cpu_pct)))

    def _network(self) -> list[NetworkReading]:
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
            rows.append((io.bytes_recv + io.bytes_sent,
                         NetworkReading(iface=iface, rx_mbps=rx, tx_mbps=tx, speed_mbps=speed)))
        return [row for _, row in sorted(rows, key=lambda pair: -pair[0])]


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

    def sample(self) -> list[GpuReading]:
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
                gpus.append(GpuReading(index=index, name=name.decode() if isinstance(name, bytes) else str(name),
                                       utilization_pct=float(util.gpu), utilization_sample_ok=True,
                                       utilization_source="nvml", memory_used_mb=_mb(mem.used),
                                       memory_total_mb=_mb(mem.total)))
            except Exception:  # one GPU that cannot be read is reported as such
                gpus.append(GpuReading(index=index, utilization_sample_ok=False, utilization_source="nvml"))
        return gpus
