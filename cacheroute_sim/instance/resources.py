"""What a simulated instance reports of its machine: `resource_snapshot_v1`
in the product's wire types, as the instance agent reports a real machine's
(instance_agent/resources.py), with readings derived from the simulated engine's own load, so
the dashboard's resource charts and the pool's admission state follow the traffic:

- one simulated GPU: its utilization is how busy the engine's slots are, sampled every
  SAMPLE_INTERVAL_S and reported as the window's average, latest and highest sample (as an
  agent sampling NVML reports it); its memory is the model's weights plus the KV held
  (residency.py), out of the weights plus the KV capacity;
- CPU: a little at rest plus what the busy slots cost over the same window (a vLLM host's CPU
  mostly feeds the GPU);
- memory: the serving process's base plus a little per request in flight, out of a fixed host;
- no network reading: null, not measured.

The capacity hint's admission state is the agent's rule (instance_wire.admission_state).
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from cacheroute_proxy.instance_wire import (
    CapacityHint,
    CpuReading,
    Devices,
    GpuReading,
    MemoryReading,
    ResourceSnapshotV1,
    admission_state,
)
from cacheroute_sim.instance.engine import Engine
from cacheroute_sim.instance.residency import PREFIX_BLOCK_TOKENS
from cacheroute_sim.instance.timing import KV_GB_PER_TOKEN

AGENT_VERSION = "cacheroute-sim-instance/1"
SAMPLE_INTERVAL_S = 0.5
GPU_NAME = "simulated GPU"
GPU_SOURCE = "simulated"
GPU_WEIGHTS_MB = 16_384.0     # an 8B-parameter model in 16-bit weights
GPU_BUSY_FLOOR_PCT = 35.0     # one sequence running keeps the GPU this busy; a full batch, 100
CPU_IDLE_PCT = 2.0
CPU_BUSY_PCT = 30.0           # added when every slot is busy
HOST_MEMORY_TOTAL_MB = 65_536.0
HOST_MEMORY_BASE_MB = 6_144.0  # the serving process at rest
HOST_MEMORY_PER_REQUEST_MB = 48.0
KV_MB_PER_TOKEN = KV_GB_PER_TOKEN * 1024


class Sample(NamedTuple):
    at_ms: int
    busy_share: float  # the engine's slots in use, 0..1


def gpu_utilization_pct(busy_share: float) -> float:
    return 0.0 if busy_share <= 0 else GPU_BUSY_FLOOR_PCT + (100.0 - GPU_BUSY_FLOOR_PCT) * min(1.0, busy_share)


class SimulatedResources:
    """Samples the engine's load while it runs (`run`); each `snapshot` reports the window of
    samples since the previous one."""

    def __init__(self, engine: Engine, max_concurrency: int) -> None:
        self._engine = engine
        self._slots = max_concurrency
        self._samples: list[Sample] = []
        self._window_started_ms = _now_ms()

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def sample(self) -> None:
        self._samples.append(Sample(_now_ms(), min(1.0, self._engine.stats.active / self._slots)))

    def snapshot(self, instance_id: str) -> ResourceSnapshotV1:
        if not self._samples:
            self.sample()
        samples, self._samples = self._samples, []
        now_ms = _now_ms()
        window_ms, self._window_started_ms = max(0, now_ms - self._window_started_ms), now_ms
        busy = sum(s.busy_share for s in samples) / len(samples)
        cpu_pct = round(CPU_IDLE_PCT + CPU_BUSY_PCT * busy, 1)
        memory_used = min(HOST_MEMORY_TOTAL_MB,
                          HOST_MEMORY_BASE_MB + HOST_MEMORY_PER_REQUEST_MB * self._engine.stats.inflight)
        free_ratio = (HOST_MEMORY_TOTAL_MB - memory_used) / HOST_MEMORY_TOTAL_MB
        return ResourceSnapshotV1(
            timestamp_ms=now_ms, agent_version=AGENT_VERSION, instance_id=instance_id,
            devices=Devices(
                cpu=CpuReading(utilization_pct=cpu_pct),
                memory=MemoryReading(used_mb=round(memory_used, 1), total_mb=HOST_MEMORY_TOTAL_MB,
                                     free_mb=round(HOST_MEMORY_TOTAL_MB - memory_used, 1)),
                gpu=[self._gpu(samples, window_ms)]),
            capacity_hint=CapacityHint(memory_free_ratio=round(free_ratio, 4),
                                       admission_state=admission_state(free_ratio, cpu_pct)))

    def _gpu(self, samples: list[Sample], window_ms: int) -> GpuReading:
        utilizations = [gpu_utilization_pct(s.busy_share) for s in samples]
        held = self._engine.residency.snapshot(self._engine.knobs.current)
        kv_tokens = held["kv_resident_tokens"] + held["prefix_cache_blocks"] * PREFIX_BLOCK_TOKENS
        total = GPU_WEIGHTS_MB + held["kv_capacity_tokens"] * KV_MB_PER_TOKEN
        used = min(total, GPU_WEIGHTS_MB + kv_tokens * KV_MB_PER_TOKEN)
        return GpuReading(
            index=0, name=GPU_NAME,
            utilization_pct_avg=round(sum(utilizations) / len(utilizations), 1),
            utilization_pct_current=round(utilizations[-1], 1), utilization_pct_max=round(max(utilizations), 1),
            utilization_sample_count=len(samples), utilization_window_ms=window_ms,
            utilization_sample_ok=True, utilization_source=GPU_SOURCE,
            utilization_sample_timestamp_ms=samples[-1].at_ms,
            memory_used_mb=round(used, 1), memory_total_mb=round(total, 1), memory_free_mb=round(total - used, 1))


def _now_ms() -> int:
    return int(time.time() * 1000)
