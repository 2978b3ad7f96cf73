"""What the soak watches while it runs, from the control plane's `/debug/status`: every worker
lineage (worker index + pid: a restarted worker is a new lineage) with its RSS samples and the
most events it had dropped while alive, and the sidecar's pid and RSS. `rss_summary` turns the
samples into growth per lineage."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from bench.soak.clock import SoakClock
from bench.soak.config import SoakConfig
from bench.soak.processes import SoakProcesses


@dataclass
class Lineage:
    worker_index: int
    pid: int
    created_at: float              # wall clock (psutil create_time)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (soak t, rss bytes)
    events_dropped_max: int = 0
    events_pending_max: int = 0


class Monitor:
    def __init__(self, cfg: SoakConfig, procs: SoakProcesses, clock: SoakClock, errors: list[str]) -> None:
        self.cfg = cfg
        self.procs = procs
        self.clock = clock
        self.errors = errors
        self.lineages: dict[tuple[int, int], Lineage] = {}
        self.sidecar_rss: list[tuple[float, int]] = []
        self.sidecar_pids: set[int] = set()

    async def run(self) -> None:
        """Sample every `status_sample_s` until the load ends; RSS from the warm-up on, every
        `rss_sample_s`."""
        next_rss = self.cfg.warmup_s
        while not self.clock.stopping.is_set():
            try:
                rss_due = self.clock.now() >= next_rss
                await self.sample(rss=rss_due)
                if rss_due:
                    next_rss += self.cfg.rss_sample_s
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                self.errors.append(f"t={self.clock.now():.1f} status sample: {exc!r}")
            if not await self.clock.sleep_until(self.clock.now() + self.cfg.status_sample_s):
                return

    async def sample(self, rss: bool = True) -> None:
        status = await self.procs.get(f"{self.procs.cp_url}/debug/status")
        t = self.clock.now()
        self.sidecar_pids.add(status["sidecar"]["pid"])
        for row in status["workers"]:
            if not row["alive"]:
                continue
            key = (row["worker_index"], row["pid"])
            lineage = self.lineages.get(key)
            if lineage is None:
                try:
                    created = psutil.Process(row["pid"]).create_time()
                except psutil.Error:
                    continue
                lineage = self.lineages[key] = Lineage(row["worker_index"], row["pid"], created)
            lineage.events_dropped_max = max(lineage.events_dropped_max, row["events_dropped"])
            lineage.events_pending_max = max(lineage.events_pending_max, row["events_pending"])
            if rss and t >= self.cfg.warmup_s:
                with contextlib.suppress(psutil.Error):
                    lineage.samples.append((t, psutil.Process(row["pid"]).memory_info().rss))
        if rss and t >= self.cfg.warmup_s:
            with contextlib.suppress(psutil.Error):
                self.sidecar_rss.append((t, psutil.Process(status["sidecar"]["pid"]).memory_info().rss))

    def last_look(self, index: int, pid: int, events_dropped: int) -> None:
        """A worker about to be killed: its events dropped so far, and a last RSS sample."""
        lineage = self.lineages.get((index, pid))
        if lineage is not None:
            lineage.events_dropped_max = max(lineage.events_dropped_max, events_dropped)
        with contextlib.suppress(psutil.Error):
            if lineage is not None and self.clock.now() >= self.cfg.warmup_s:
                lineage.samples.append((self.clock.now(), psutil.Process(pid).memory_info().rss))

    def worker_index_by_pid(self) -> dict[int, int]:
        return {pid: idx for (idx, pid) in self.lineages}

    def rss_summary(self, kills: list[dict[str, Any]]) -> dict[str, Any]:
        lineages = []
        growths = []
        for lin in sorted(self.lineages.values(), key=lambda l: (l.worker_index, l.created_at)):
            t_created = lin.created_at - self.clock.t0_wall  # soak time at which the worker started
            # Baseline: the first sample once the worker is warmup_s old (and the soak too).
            base = next(((t, rss) for t, rss in lin.samples if t - t_created >= self.cfg.warmup_s), None)
            last = lin.samples[-1] if lin.samples else None
            lived = None if last is None else last[0] - t_created
            entry: dict[str, Any] = {
                "worker_index": lin.worker_index, "pid": lin.pid,
                "started_at_s": round(t_created, 1), "lived_s": None if lived is None else round(lived, 1),
                "samples": len(lin.samples),
                "replaced": any(k["pid"] == lin.pid for k in kills),
                "events_dropped_max": lin.events_dropped_max,
                "events_pending_max": lin.events_pending_max}
            if base and last and last[0] > base[0]:
                growth = 100.0 * (last[1] - base[1]) / base[1]
                entry.update(baseline_at_s=round(base[0], 1), baseline_rss_mb=round(base[1] / 2**20, 2),
                             end_at_s=round(last[0], 1), end_rss_mb=round(last[1] / 2**20, 2),
                             peak_rss_mb=round(max(r for _, r in lin.samples) / 2**20, 2),
                             growth_pct=round(growth, 2))
                entry["reported"] = lived is not None and lived >= self.cfg.rss_min_lifetime_s
                if entry["reported"]:
                    growths.append(growth)
            else:
                entry["reported"] = False
            lineages.append(entry)
        sidecar = None
        if len(self.sidecar_rss) >= 2:
            (_, r0), (_, r1) = self.sidecar_rss[0], self.sidecar_rss[-1]
            sidecar = {"start_rss_mb": round(r0 / 2**20, 2), "end_rss_mb": round(r1 / 2**20, 2),
                       "growth_pct": round(100.0 * (r1 - r0) / r0, 2)}
        return {"lineages": lineages, "reported_lineages": len(growths),
                "max_growth_pct": None if not growths else round(max(growths), 2),
                "limit_pct": self.cfg.rss_growth_limit_pct,
                "min_lifetime_s": self.cfg.rss_min_lifetime_s, "sidecar": sidecar}
