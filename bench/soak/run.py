"""One soak, start to end: start the processes, run the clients with the monitor and the chaos
beside them, let the counters settle, stop everything, and report."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.results import Run
from bench.soak.chaos import Chaos
from bench.soak.checks import FinalState, clean_stop, end_checks, settle
from bench.soak.clock import SoakClock
from bench.soak.config import SoakConfig
from bench.soak.load import LoadGenerator
from bench.soak.monitor import Monitor
from bench.soak.outcomes import summarize
from bench.soak.processes import SoakProcesses
from bench.soak.report import build_report


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="cacheroute-soak-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_wall = time.time()
        self.errors: list[str] = []  # what went wrong in the monitor, the chaos or the settling
        self.procs = SoakProcesses(cfg, self.run_dir)
        self.clock = SoakClock(cfg.duration_s)
        self.load = LoadGenerator(cfg, self.procs.dp_url, self.clock)
        self.monitor = Monitor(cfg, self.procs, self.clock, self.errors)
        self.chaos = Chaos(cfg, self.procs, self.clock, self.monitor, self.errors)
        self.final = FinalState()

    def start(self) -> None:
        self.procs.start()

    def stop(self) -> None:
        self.procs.stop()

    async def drive(self) -> None:
        cfg = self.cfg
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        control_timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as load, \
                aiohttp.ClientSession(timeout=control_timeout) as control:
            self.procs.control = control
            self.clock.start()
            clients = [asyncio.ensure_future(self.load.client(load, c)) for c in range(cfg.clients)]
            helpers = [asyncio.ensure_future(coro) for coro in (
                self.monitor.run(), self.chaos.run_flapper(), self.chaos.run_killer())]
            await asyncio.gather(*clients)
            self.clock.stopping.set()
            results = await asyncio.gather(*helpers, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    self.errors.append(f"{type(result).__name__}: {result}")
            await self.monitor.sample()
            await self.chaos.count_flapper_failures()
            await self.chaos.flapper_clean()
            self.final = await settle(cfg, self.procs, self.errors)

    def report(self, provenance: Run) -> dict[str, Any]:
        chaos = self.chaos
        outcomes = summarize(self.load.records, kills=chaos.kills, fail_windows=chaos.fail_windows,
                             restart_windows=chaos.restart_windows, flapper_id=chaos.flapper_id,
                             kill_grace_s=self.cfg.kill_grace_s, duration_s=self.cfg.duration_s,
                             worker_index_by_pid=self.monitor.worker_index_by_pid())
        rss = self.monitor.rss_summary(chaos.kills)
        checks = end_checks(self.cfg, self.final, instance_ids=self.procs.instance_ids,
                            lineages=self.monitor.lineages, sidecar_pids=self.monitor.sidecar_pids,
                            kills=chaos.kills, errors=self.errors, outcomes=outcomes, rss=rss)
        checks["clean_stop"] = clean_stop(self.procs.stop_result)
        return build_report(self, provenance, outcomes, rss, checks)


def run_soak(cfg: SoakConfig, provenance: Run) -> dict[str, Any]:
    """Start, drive, check, stop. Always stops what it started, then returns the report."""
    soak = Soak(cfg)
    try:
        soak.start()
        asyncio.run(soak.drive())
    finally:
        soak.stop()
    return soak.report(provenance)
