"""A rolling restart under load, end to end; prints one JSON result.

    unshare --net -- sh -c 'ip link set lo up && sysctl -qw net.ipv4.tcp_migrate_req=1 &&
        exec .venv/bin/python -m tests.rolling_restart_scenario --log-dir DIR'

Meant for a private network namespace (tests/test_rolling_restart.py makes one), so the
`tcp_migrate_req` setting it runs with is the namespace's own and the host's stays untouched.
Starts `python -m cacheroute_proxy run` (sidecar + N workers) and simulated instances, drives the
mixed load of tests/rolling_load.py, sends SIGHUP, waits until every worker answers from a new
pid and every old one has exited (the "restart window"), keeps the load on 2 s more, then checks
inflight and lanes are 0 everywhere, stops the
cluster and looks for anything left behind (processes carrying our segment name, the segment).
Every process is started with PDEATHSIG, so a killed scenario leaves nothing running either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cacheroute_sim.processes import ChildProcess, SupervisorPorts, free_port_pair
from tests.harness import http, wait_until
from tests.rolling_load import LoadGenerator

LANES = ("inflight", "active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth")
DRAINING_RE = re.compile(r"worker\d+\[(\d+)\].*draining: stopped accepting; (\d+) requests in flight "
                         r"\((\d+) streams\)")
DRAINED_RE = re.compile(r"worker\d+\[(\d+)\].*drained: (\d+) requests finished.*; (\d+) cut at the deadline")


class Scenario:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log_dir = Path(args.log_dir)
        self.ports = SupervisorPorts(args.workers, "cacheroute_roll")
        self.env = {**self.ports.supervisor_env("round_robin"),
                    "READY_CONCURRENCY": "256", "PROXY_DRAIN_TIMEOUT_S": str(args.drain_timeout),
                    "PROXY_KEEPALIVE_TIMEOUT_S": str(args.server_keepalive), "PROXY_LOG_LEVEL": "info"}
        self.launcher: ChildProcess | None = None
        self.instances: list[ChildProcess] = []

    # --- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        self.launcher = ChildProcess(["-m", "cacheroute_proxy", "run"], self.env, self.log_dir / "launcher.log",
                                     die_with_parent=True)
        for i in range(self.args.workers):
            wait_until(lambda i=i: self.healthz_pid(i), 60, message=f"worker {i} healthy")
        for i in range(self.args.instances):
            self.instances.append(self._instance(i))

    def _instance(self, i: int) -> ChildProcess:
        port, instance_id = free_port_pair(), f"sim-{i}"
        proc = ChildProcess(["-m", "cacheroute_sim.instance", "--host", "127.0.0.1", "--port", str(port),
                             "--instance-id", instance_id, "--proxy-cp-url", self.ports.cp_url,
                             "--time-scale", str(self.args.time_scale), "--max-concurrency", "256"],
                            {}, self.log_dir / f"{instance_id}.log", die_with_parent=True)
        wait_until(lambda: any(r["instance_id"] == instance_id and r["is_alive"]
                               for r in self.loads(self.ports.cp_url)), 30, message=f"{instance_id} registered")
        return proc

    def stop(self) -> int | None:
        for proc in self.instances:
            proc.stop()
        return self.launcher.stop(signal.SIGINT, timeout=60) if self.launcher else None

    # --- observations ---------------------------------------------------------------------------
    def healthz_pid(self, index: int) -> int | None:
        status, body, _ = http("GET", f"{self.ports.worker_url(index)}/healthz", timeout=2)
        return body["pid"] if status == 200 else None

    def pids(self) -> dict[int, int | None]:
        return {i: self._pid_or_none(i) for i in range(self.args.workers)}

    def _pid_or_none(self, index: int) -> int | None:
        try:
            return self.healthz_pid(index)
        except OSError:
            return None  # between the old listener closing and the new one opening

    def loads(self, base: str) -> list[dict[str, Any]]:
        status, body, _ = http("GET", f"{base}/debug/instance_loads", timeout=5)
        assert status == 200, body
        return body["instances"]

    def busy_lanes(self) -> list[str]:
        sources = {"control plane": self.ports.cp_url,
                   **{f"worker{i}": self.ports.worker_url(i) for i in range(self.args.workers)}}
        return [f"{name}: {row['instance_id']} {lane}={row[lane]}"
                for name, base in sources.items() for row in self.loads(base)
                for lane in LANES if row.get(lane)]

    def log(self) -> str:
        return self.launcher.log() if self.launcher else ""

    # --- the run --------------------------------------------------------------------------------
    async def drive(self) -> dict[str, Any]:
        a = self.args
        load = LoadGenerator(self.ports.dp_url, fresh=a.fresh, keepalive=a.keepalive, sse=a.sse,
                             short_tokens=a.short_tokens, stream_tokens=a.stream_tokens,
                             client_keepalive_s=a.client_keepalive, keepalive_think_s=a.keepalive_think)
        running = asyncio.create_task(load.run())
        await asyncio.sleep(a.warmup)
        before = self.pids()
        hup_at = time.monotonic()
        os.kill(self.launcher.pid, signal.SIGHUP)
        done_at = await self._wait_replaced(before)
        await asyncio.sleep(a.after)
        load.stop()
        result = await asyncio.wait_for(running, timeout=90)
        return {"pids_before": before, "pids_after": self.pids(),
                "restart_window_s": round(done_at - hup_at, 2),
                "load": result.summary((hup_at, done_at))}

    async def _wait_replaced(self, before: dict[int, int | None]) -> float:
        """When the restart is over: every replacement answers and every old worker has exited."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            log = self.log()
            if "rolling restart done" in log and all(f"(pid {p}) exited" in log for p in before.values()):
                return time.monotonic()
            await asyncio.sleep(0.2)
        raise AssertionError(f"rolling restart did not finish (pids before {before})\n{self.log()[-4000:]}")

    def after_checks(self, summary: dict[str, Any]) -> dict[str, Any]:
        old = {pid for pid in summary["pids_before"].values() if pid}
        wait_until(lambda: self.log().count("retired worker") >= len(old) and
                   all(f"(pid {p}) exited" in self.log() for p in old), 60,
                   message="every retired worker exited")
        lanes_zero = True
        try:
            wait_until(lambda: not self.busy_lanes(), 15, message="inflight and lanes 0 everywhere")
        except AssertionError:
            lanes_zero = False
        busy = self.busy_lanes()
        log = self.log()
        return {
            "old_workers_exit_codes": re.findall(r"retired worker\d+ \(pid \d+\) exited with code (-?\d+)", log),
            "drains": [dict(zip(("pid", "in_flight", "streams"), map(int, m)))
                       for m in DRAINING_RE.findall(log)],
            "drained": [dict(zip(("pid", "finished", "cut"), map(int, m))) for m in DRAINED_RE.findall(log)],
            "leftover_inflight_at_exit": log.count("released inflight still held at exit"),
            "inflight_and_lanes_zero": lanes_zero, "busy_lanes": busy,
            "private_port_waits": log.count("is busy (a draining predecessor?)"),
        }


def leftovers(shm_name: str) -> dict[str, Any]:
    """Processes whose environment names our segment, and the segment itself."""
    marker = f"PROXY_SHM_NAME={shm_name}".encode()
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    procs.append(int(entry))
            except OSError:
                continue
    return {"processes": procs, "segment_exists": os.path.exists(f"/dev/shm{shm_name}")}


def read_migrate_req() -> str | None:
    try:
        return Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--fresh", type=int, default=6, help="clients with a new connection per request")
    parser.add_argument("--keepalive", type=int, default=6, help="clients sharing a keep-alive pool")
    parser.add_argument("--sse", type=int, default=6, help="clients holding long streams")
    parser.add_argument("--short-tokens", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=400, help="~2.5 s at time scale 0.25")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=2.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    # Shorter on the client than on the server, as it must be. Reversing them (e.g. server 0.2)
    # measures HTTP/1.1's idle-close race, which no server can remove.
    parser.add_argument("--client-keepalive", type=float, default=2.0)
    parser.add_argument("--server-keepalive", type=float, default=5.0)
    parser.add_argument("--keepalive-think", type=float, default=0.0,
                        help="keepalive clients pause 0..S between requests")
    args = parser.parse_args(argv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    scenario = Scenario(args)
    result: dict[str, Any] = {"tcp_migrate_req": read_migrate_req(), "workers": args.workers}
    try:
        scenario.start()
        summary = asyncio.run(scenario.drive())
        result.update(summary)
        result.update(scenario.after_checks(summary))
    except AssertionError as exc:
        result["error"] = str(exc)[-3000:]
    finally:
        result["launcher_exit"] = scenario.stop()
        result["leftovers"] = leftovers(scenario.ports.shm_name)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
