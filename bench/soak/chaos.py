"""The chaos, timed from the start of the load and never in its last `chaos_quiet_tail_s`:
- the flapper (instance 0): every `flap_interval_s` its `fail_status` toggles 503 / none, and
  every `restart_every`-th time its process is stopped and started again instead;
- a worker SIGKILLed every `kill_interval_s` (seeded jitter), in rotation, after checking its
  pid against `/debug/status`; then waiting for its replacement and for the reaper.
It keeps the log of what it did (`log`) and the windows the outcomes are judged against
(`kills`, `fail_windows`, `restart_windows`), and the 503s the flapper says it answered."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from typing import Any

import aiohttp
import psutil

from bench.soak.clock import SoakClock
from bench.soak.config import SoakConfig
from bench.soak.monitor import Monitor
from bench.soak.processes import SoakProcesses


class Chaos:
    def __init__(self, cfg: SoakConfig, procs: SoakProcesses, clock: SoakClock, monitor: Monitor,
                 errors: list[str]) -> None:
        self.cfg = cfg
        self.procs = procs
        self.clock = clock
        self.monitor = monitor
        self.errors = errors
        self.flapper = 0                 # index of the flapping instance
        self.log: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.fail_windows: list[tuple[float, float]] = []     # soak times its 503 knob was on
        self.restart_windows: list[tuple[float, float]] = []  # stopped .. re-registered + 1 s
        self.flapper_failed: dict[int, int] = {}  # flapper pid -> 503s it answered

    @property
    def flapper_id(self) -> str:
        return self.procs.instance_ids[self.flapper]

    def _allowed(self, t: float) -> bool:
        return t <= self.cfg.duration_s - self.cfg.chaos_quiet_tail_s

    # --- the flapper ---------------------------------------------------------------------------
    async def run_flapper(self) -> None:
        cfg, clock = self.cfg, self.clock
        fail_on_since: float | None = None
        k = 0
        while True:
            k += 1
            t = k * cfg.flap_interval_s
            if not self._allowed(t) or not await clock.sleep_until(t):
                break
            try:
                if cfg.restart_every and k % cfg.restart_every == 0:
                    if fail_on_since is not None:
                        self.fail_windows.append((fail_on_since, clock.now()))
                        fail_on_since = None
                    await self._restart_flapper()
                else:
                    if fail_on_since is None:
                        await self._set_fail(True)
                        fail_on_since = clock.now()
                        self.log.append({"t": round(fail_on_since, 2), "event": "flap_fail_503_on"})
                    else:
                        await self._set_fail(False)
                        self.fail_windows.append((fail_on_since, clock.now()))
                        self.log.append({"t": round(clock.now(), 2), "event": "flap_fail_off"})
                        fail_on_since = None
            except (aiohttp.ClientError, OSError, TimeoutError, AssertionError, RuntimeError) as exc:
                self.errors.append(f"t={clock.now():.1f} flap: {exc!r}")
        if fail_on_since is not None:
            # The last 503 window lasts until the next event would have come, or the quiet tail.
            await clock.sleep_until(min(k * cfg.flap_interval_s, cfg.duration_s - cfg.chaos_quiet_tail_s))
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AssertionError):
                await self._set_fail(False)
            self.fail_windows.append((fail_on_since, clock.now()))
            self.log.append({"t": round(clock.now(), 2), "event": "flap_fail_off"})

    async def _set_fail(self, on: bool) -> None:
        await self.procs.post(f"{self.procs.instance_url(self.flapper)}/sim/config",
                              {"fail_status": 503 if on else None})

    async def flapper_clean(self) -> None:
        """The flapper answers normally again (its knob off) before the end checks."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AssertionError):
            await self._set_fail(False)

    async def count_flapper_failures(self) -> None:
        """The flapper's own count of 503s answered, per process (a restart resets it)."""
        proc = self.procs.instances[self.flapper]
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            stats = await self.procs.get(f"{self.procs.instance_url(self.flapper)}/sim/stats")
            if proc is not None:
                self.flapper_failed[proc.pid] = stats["failed"]

    async def _restart_flapper(self) -> None:
        i, clock = self.flapper, self.clock
        t_stop = clock.now()
        proc = self.procs.instances[i]
        old_pid = proc.pid if proc else None
        await self.count_flapper_failures()
        code = await self.procs.stop_instance(i)
        t_stopped = clock.now()
        await asyncio.sleep(self.cfg.restart_down_s)
        self.procs.start_instance(i)  # main thread: the event loop runs on it
        registered = await self.procs.wait_registered(i, 30)
        t_registered = clock.now()
        new = self.procs.instances[i]
        self.restart_windows.append((t_stop, t_registered + 1.0))
        self.log.append({"t": round(t_stop, 2), "event": "flap_restart", "old_pid": old_pid,
                         "exit_code": code, "stopped_after_s": round(t_stopped - t_stop, 2),
                         "new_pid": None if new is None else new.pid,
                         "registered": registered,
                         "registered_after_s": round(t_registered - t_stop, 2)})
        if not registered:
            raise RuntimeError(f"{self.procs.instance_ids[i]} did not re-register within 30 s")

    # --- the worker kills ------------------------------------------------------------------------
    async def run_killer(self) -> None:
        cfg = self.cfg
        n = 0
        jitter = random.Random(cfg.seed + 7)
        while cfg.max_kills is None or n < cfg.max_kills:
            t = cfg.kill_offset_s + n * cfg.kill_interval_s + jitter.uniform(-cfg.kill_jitter_s, cfg.kill_jitter_s)
            if not self._allowed(t) or not await self.clock.sleep_until(t):
                return
            index = n % cfg.workers
            n += 1
            try:
                await self._kill_worker(index)
            except (aiohttp.ClientError, OSError, TimeoutError, AssertionError, RuntimeError,
                    psutil.Error) as exc:
                self.errors.append(f"t={self.clock.now():.1f} kill worker {index}: {exc!r}")

    async def _kill_worker(self, index: int) -> None:
        procs, clock = self.procs, self.clock
        health = await procs.get(f"{procs.worker_url(index)}/healthz")
        pid = health["pid"]
        status = await procs.get(f"{procs.cp_url}/debug/status")
        rows = [r for r in status["workers"] if r["pid"] == pid and r["alive"]]
        assert rows and rows[0]["worker_index"] == index, (index, pid, status["workers"])
        cmdline = " ".join(psutil.Process(pid).cmdline())
        assert "proxy_workers" in cmdline, (pid, cmdline)
        self.monitor.last_look(index, pid, rows[0]["events_dropped"])
        t_kill = clock.now()
        os.kill(pid, signal.SIGKILL)
        kill = {"t": t_kill, "worker_index": index, "pid": pid,
                "events_dropped_before": rows[0]["events_dropped"]}
        self.kills.append(kill)
        deadline = time.monotonic() + 30
        new_pid = None
        while time.monotonic() < deadline and new_pid is None:
            await asyncio.sleep(0.1)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                got = (await procs.get(f"{procs.worker_url(index)}/healthz"))["pid"]
                new_pid = got if got != pid else None
        kill["new_pid"] = new_pid
        kill["replaced_after_s"] = None if new_pid is None else round(clock.now() - t_kill, 2)
        reaped = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and reaped is None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                status = await procs.get(f"{procs.cp_url}/debug/status")
                reaped = next((r for r in status["reaper"]["last_reaped"] if r["pid"] == pid), None)
            if reaped is None:
                await asyncio.sleep(0.1)
        kill["reaped"] = reaped is not None
        kill["subtracted_inflight"] = None if reaped is None else reaped["subtracted"]
        kill["died_mid_update"] = None if reaped is None else reaped["died_mid_update"]
        self.log.append({"event": "worker_sigkill", **{k: (round(v, 2) if isinstance(v, float) else v)
                                                       for k, v in kill.items()}})
        if new_pid is None:
            raise RuntimeError(f"worker {index} was not replaced within 30 s")
