"""The processes the soak starts, on 127.0.0.1 with free ports and a private segment name:
`python -m cacheroute_proxy run` (sidecar + workers, the soak's strategy, no simulated instances of its
own: bench/harness/processes.py's Supervisor) and the simulated instances that register with it.
Starting them (from the main thread, so each dies with the soak), reaching them over HTTP, and
stopping each by its pid."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.harness.processes import Supervisor
from bench.soak.config import SoakConfig
from cacheroute_sim.processes import ChildProcess, free_port_pair

REGISTER_TIMEOUT_S = 30.0


class SoakProcesses(Supervisor):
    """The supervisor on its ports and segment, and the instances on theirs."""

    def __init__(self, cfg: SoakConfig, run_dir: Path) -> None:
        super().__init__(cfg.workers, cfg.strategy, run_dir / "supervisor.log", name="the soak's proxy",
                         shm_prefix="cacheroute_soak", append_log=True, stop_timeout_s=60.0)
        self.cfg = cfg
        self.run_dir = run_dir
        self.instance_ports = [free_port_pair() for _ in range(cfg.instances)]
        self.instance_ids = [f"soak-sim-{i}" for i in range(cfg.instances)]
        self.instances: list[ChildProcess | None] = [None] * cfg.instances
        # The soak's own short requests (status, knobs, health); open while the soak drives.
        self.control: aiohttp.ClientSession | None = None
        self.stop_result: dict[str, Any] = {}

    # --- addresses (and those of SupervisorPorts) --------------------------------------------
    def instance_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.instance_ports[i]}"

    # --- asking them (asynchronous, while the soak drives) ------------------------------------
    async def get(self, url: str) -> Any:
        assert self.control is not None
        async with self.control.get(url) as response:
            return await response.json(content_type=None)

    async def post(self, url: str, body: Any) -> Any:
        assert self.control is not None
        async with self.control.post(url, json=body) as response:
            assert response.status == 200, (url, response.status, await response.text())
            return await response.json(content_type=None)

    # --- start (synchronous, main thread) ------------------------------------------------------
    def start(self) -> None:
        """The supervisor until it answers everywhere, then every instance until every worker
        sees it alive."""
        super().start()
        for i in range(self.cfg.instances):
            self.start_instance(i)
        self.wait_seen(set(self.instance_ids), REGISTER_TIMEOUT_S)

    def start_instance(self, i: int) -> None:
        """Instance i on its own port and id (again, after a restart); main thread only."""
        argv = ["-m", "cacheroute_sim.instance", "--host", "127.0.0.1", "--port", str(self.instance_ports[i]),
                "--cp-port", str(self.instance_ports[i] + 1), "--instance-id", self.instance_ids[i],
                "--proxy-cp-url", self.cp_url, "--time-scale", str(self.cfg.time_scale),
                "--seed", str(self.cfg.seed + i)]
        # A restarted instance writes on after its predecessor in the same log.
        self.instances[i] = ChildProcess(argv, {}, self.run_dir / f"{self.instance_ids[i]}.log",
                                         append_log=True, die_with_parent=True)

    # --- restart an instance (asynchronous: the load goes on meanwhile) ---------------------------
    async def stop_instance(self, i: int) -> int | None:
        """SIGTERM (it unregisters, then shuts down), up to 20 s for it to exit, then SIGKILL;
        its exit code (None if it was not running)."""
        proc = self.instances[i]
        if proc is None:
            return None
        proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while proc.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return proc.stop(signal.SIGKILL, 5)  # no-op if it already exited

    async def wait_registered(self, i: int, timeout: float = REGISTER_TIMEOUT_S) -> bool:
        """Whether instance i is registered and alive at the control plane within `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                loads = await self.get(f"{self.cp_url}/debug/instance_loads")
                if any(r["instance_id"] == self.instance_ids[i] and r["is_alive"] for r in loads["instances"]):
                    return True
            await asyncio.sleep(0.1)
        return False

    # --- stop (synchronous, main thread) ---------------------------------------------------------
    def stop(self) -> dict[str, Any]:  # type: ignore[override]
        """Instances first (they unregister), then the supervisor (SIGINT: workers, sidecar,
        segment); each by its pid; whatever does not stop in time is SIGKILLed. What was left
        behind, also kept as `stop_result`."""
        codes: dict[str, Any] = {}
        for i, proc in enumerate(self.instances):
            if proc is not None:
                codes[self.instance_ids[i]] = proc.stop(signal.SIGTERM, 20)
        worker_pids = []
        if self.child is not None:
            with contextlib.suppress(psutil.Error):
                worker_pids = [c.pid for c in psutil.Process(self.child.pid).children()]
            codes["supervisor"] = super().stop()
        time.sleep(0.2)
        leftovers = [pid for pid in worker_pids if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        self.stop_result = {
            "exit_codes": codes, "supervisor_children_left": leftovers,
            "segment_removed": not os.path.exists(f"/dev/shm{self.shm_name}")}
        return self.stop_result
