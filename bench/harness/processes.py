"""What starting and stopping a benchmark's processes shares: the address, small HTTP calls,
waiting for a process to be ready, scratch directories, `Started` (a context manager that stops
what did start when a start fails) and `Supervisor`, this proxy's launcher on its own ports and
segment. bench/harness/backends.py starts the instances, bench/harness/contenders.py what is
measured over them."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Self

from cacheroute_sim.processes import ChildProcess, SupervisorPorts

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0


class StartError(RuntimeError):
    """A contender did not come up; the message carries the end of its log."""


# --- small HTTP helpers ------------------------------------------------------------------------
def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, decoded JSON or None); never raises for an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             alive: Callable[[], bool] = lambda: True, log: Callable[[], str] = lambda: "") -> None:
    """Poll until `predicate()` is true; StartError on timeout or when `alive()` turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise StartError(f"{what}: the process ended\n{log()}")
        try:
            if predicate():
                return
        except (OSError, ValueError, KeyError):
            pass  # not listening yet, or not answering in full yet
        time.sleep(0.1)
    raise StartError(f"{what}: not ready after {timeout:.0f} s\n{log()}")


def answers_ok(url: str) -> bool:
    return http_json("GET", url, timeout=2.0)[0] == 200


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))


def remove_dir(path: Path) -> None:
    """A stopped contender's temp dir goes (a failed start already put its log tail in the
    StartError)."""
    shutil.rmtree(path, ignore_errors=True)


class Started:
    """A context manager that starts in __enter__ (stopping what did start if that fails) and
    stops, by pid, in __exit__."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Supervisor(SupervisorPorts, Started):
    """This proxy's launcher (`python -m cacheroute_proxy run`, or `command` run by `program`: the
    demo's, a baseline tree's) on free ports and a private segment name (SupervisorPorts), its
    log at `log_path`; stopped by its pid with SIGINT, on which it stops its workers and its
    sidecar and unlinks the segment."""

    def __init__(self, workers: int, strategy: str, log_path: Path, env: dict[str, str] | None = None, *,
                 name: str = "the proxy", shm_prefix: str = "cacheroute_bench",
                 command: tuple[str, ...] = ("-m", "cacheroute_proxy", "run"), program: str | None = None,
                 append_log: bool = False, stop_timeout_s: float = 45.0) -> None:
        super().__init__(workers, shm_prefix)
        self.name, self.stop_timeout_s = name, stop_timeout_s
        self.env = {**self.supervisor_env(strategy), **(env or {})}
        self.log_path, self.command, self.program, self.append_log = log_path, command, program, append_log
        self.child: ChildProcess | None = None

    def start(self) -> None:
        self.launch()
        self.wait_up()

    def launch(self) -> None:
        """Start the launcher without waiting for it."""
        self.child = ChildProcess(list(self.command), self.env, self.log_path, append_log=self.append_log,
                                  die_with_parent=True, program=self.program)

    def running(self) -> bool:
        return self.child is not None and self.child.running()

    def tail(self) -> str:
        return self.child.tail() if self.child is not None else ""

    def wait_up(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the control plane, every worker's private port and the shared data-plane port
        answer /healthz (a request sent before a worker listens would be refused)."""
        for url in (self.cp_url, *(self.worker_url(i) for i in range(self.workers)), self.dp_url):
            wait_for(lambda url=url: answers_ok(f"{url}/healthz"), timeout, f"{self.name} at {url}",
                     self.running, self.tail)

    def alive_seen_by(self, worker: int) -> set[str]:
        """The ids of the instances worker `worker` sees alive."""
        status, loads = http_json("GET", f"{self.worker_url(worker)}/debug/instance_loads")
        if status != 200 or not isinstance(loads, dict):
            return set()
        return {r["instance_id"] for r in loads.get("instances", []) if r.get("is_alive")}

    def wait_seen(self, wanted: set[str] | int, timeout: float = START_TIMEOUT_S) -> None:
        """Until every worker sees these instances (or this many) alive."""
        def seen(worker: int) -> bool:
            alive = self.alive_seen_by(worker)
            return len(alive) >= wanted if isinstance(wanted, int) else wanted <= alive
        for i in range(self.workers):
            wait_for(lambda i=i: seen(i), timeout, f"{self.name} worker {i} sees every instance",
                     self.running, self.tail)

    def stop(self) -> int | None:
        """SIGINT, up to stop_timeout_s for the workers to drain, then SIGKILL; its exit code."""
        return None if self.child is None else self.child.stop(signal.SIGINT, self.stop_timeout_s)
