"""Real processes for end-to-end tests: the launcher (sidecar + N workers) and simulated
instances, on free 127.0.0.1 ports and a private segment name; stopped by pid in teardown."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ROOT, Process, free_port and free_port_range are re-exported: the tests take them from here.
from cacheroute_sim.processes import ROOT, SupervisorPorts, free_port, free_port_pair, free_port_range, segment_name
from cacheroute_sim.processes import ChildProcess as Process

__all__ = ["ROOT", "Agent", "Cluster", "Engine", "Process", "SimInstance", "SimKdn", "alive", "chat_body",
           "free_port", "free_port_range", "get", "http", "listed", "post", "private_segment_name", "wait_until"]

# Every segment a test creates is named `/cacheroute_test_...` (in a parallel test worker,
# `/cacheroute_test_gwN_...`): tests/segment_guard.py and .ci/run look for them.
TEST_SEGMENTS = "cacheroute_test"


def private_segment_name() -> str:
    return segment_name(TEST_SEGMENTS)


def http(method: str, url: str, body: Any = None, timeout: float = 10.0,
         raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """(status, decoded JSON or text, headers); never raises for HTTP error statuses."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload, headers = response.status, response.read(), _lower(response.headers)
    except urllib.error.HTTPError as exc:
        status, payload, headers = exc.code, exc.read(), _lower(exc.headers)
    try:
        return status, json.loads(payload), headers
    except ValueError:
        return status, payload.decode("utf-8", "replace"), headers


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def get(url: str, **kw: Any) -> Any:
    status, payload, _ = http("GET", url, **kw)
    assert status == 200, (url, status, payload)
    return payload


def post(url: str, body: Any, **kw: Any) -> Any:
    status, payload, _ = http("POST", url, body, **kw)
    assert status == 200, (url, status, payload)
    return payload


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05,
               message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, AssertionError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message} (last: {last!r})")


class SimInstance:
    """A simulated instance process registered with a cluster's control plane."""

    def __init__(self, cp_url: str, log_dir: Path, *args: str, port: int | None = None,
                 instance_id: str | None = None) -> None:
        self.port = port or free_port_pair()  # and its control plane's, port + 1
        self.instance_id = instance_id or f"sim-{self.port}"
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["-m", "cacheroute_sim.instance", "--host", "127.0.0.1", "--port", str(self.port),
                "--instance-id", self.instance_id, "--proxy-cp-url", cp_url, *args]
        self.process = Process(argv, {}, log_dir / f"{self.instance_id}.log")

    def configure(self, **knobs: Any) -> Any:
        return post(f"{self.url}/sim/config", knobs)

    def release(self) -> Any:
        return post(f"{self.url}/sim/release", {})

    def stats(self) -> dict[str, Any]:
        return get(f"{self.url}/sim/stats")

    def stop(self) -> None:
        self.process.stop()


class SimKdn:
    """A simulated KDN process on a free port, answering once constructed."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.addr}"
        self.process = Process(["-m", "cacheroute_sim.kdn", "--port", str(self.port), "--time-scale",
                                "0.05"], {}, log_dir / "kdn.log")
        try:
            wait_until(lambda: get(f"{self.url}/healthz", timeout=1), 15, message="kdn up")
        except AssertionError:
            self.process.stop()
            raise

    def kv_ready_id(self) -> str:
        """A knowledge id whose KV this KDN holds: a kvcache request for it has its KV injected."""
        found = post(f"{self.url}/knowledge/search/text",
                     {"knowledge_ids": [f"k{i:04d}" for i in range(20)], "need_fields": ["kv_ready"]})
        return next(item["id"] for item in found["items"] if item["kv_ready"])

    def hang_injects(self) -> None:
        """KV injects wait until `release()`: a kvcache request holds in prepare meanwhile."""
        post(f"{self.url}/sim/config", {"hang": True, "fault_on": "inject"})

    def held(self) -> int:
        return get(f"{self.url}/sim/stats")["held"]

    def release(self) -> None:
        post(f"{self.url}/sim/release", {})

    def stop(self) -> None:
        self.process.stop()


class Cluster(SupervisorPorts):
    """`python -m cacheroute_proxy run` with its own ports and segment (addresses: SupervisorPorts),
    plus simulated instances."""

    def __init__(self, tmp_path: Path, workers: int = 4, strategy: str = "round_robin",
                 env: dict[str, str] | None = None) -> None:
        super().__init__(workers, TEST_SEGMENTS)
        self.tmp_path = tmp_path
        self.env = {**self.supervisor_env(strategy), **(env or {})}
        self.instances: list[SimInstance] = []
        self.launcher: Process | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Cluster:
        self.launcher = Process(["-m", "cacheroute_proxy", "run"], self.env, self.tmp_path / "launcher.log")
        for index in range(self.workers):
            wait_until(lambda i=index: self._healthz(i, timeout=1)["role"] == "worker", 30,
                       message=f"worker {index} healthy\n{self.launcher_log()}")
        return self

    def add_instance(self, *args: str, time_scale: float = 0.05, headers: dict[str, str] | None = None,
                     **kw: Any) -> SimInstance:
        inst = SimInstance(self.cp_url, self.tmp_path, "--time-scale", str(time_scale), *args, **kw)
        self.instances.append(inst)

        def registered() -> bool:
            status, loads, _ = http("GET", f"{self.cp_url}/debug/instance_loads", headers=headers)
            return status == 200 and any(r["instance_id"] == inst.instance_id and r["is_alive"]
                                         for r in loads["instances"])
        wait_until(registered, 20, message=f"{inst.instance_id} registered")
        return inst

    def stop(self) -> int | None:
        for inst in self.instances:
            inst.stop()
        code = self.launcher.stop(signal.SIGINT, timeout=45) if self.launcher else None
        return code

    def launcher_log(self) -> str:
        return self.launcher.log() if self.launcher else ""

    # --- observations -----------------------------------------------------------------------------
    def loads(self, worker: int | None = None) -> dict[str, Any]:
        base = self.cp_url if worker is None else self.worker_url(worker)
        return get(f"{base}/debug/instance_loads")

    def inflight(self, worker: int | None = None) -> dict[str, int]:
        return {r["instance_id"]: r["inflight"] for r in self.loads(worker)["instances"]}

    def status(self) -> dict[str, Any]:
        return get(f"{self.cp_url}/debug/status")

    def worker_pids(self) -> dict[int, int]:
        return {i: self._healthz(i, timeout=2)["pid"] for i in range(self.workers)}

    def _healthz(self, worker: int, timeout: float) -> dict[str, Any]:
        return get(f"{self.worker_url(worker)}/healthz", timeout=timeout)


def chat_body(content: str = "hello there", stream: bool = True, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": content}],
            "stream": stream, "max_tokens": max_tokens}


# --- an engine that registers nothing, and the agent beside it -------------------------------------
class Engine:
    """A simulated instance that does not register itself: what a plain engine (a bare
    `vllm serve`) is to the proxy. Started and stopped as often as a test likes, on one port."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_dir / f"engine-{self.port}.log"
        self.process: Process | None = None

    def start(self) -> "Engine":
        self.process = Process(["-m", "cacheroute_sim.instance", "--host", "127.0.0.1", "--port",
                                str(self.port), "--no-register", "--cp-port", "0", "--time-scale", "0.05"],
                               {}, self._log, append_log=True)
        return self

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.stop(signum)


class Agent:
    """`cacheroute-proxy instance-agent` beside an Engine, heartbeating every 0.5 s."""

    def __init__(self, cluster: Cluster, engine: Engine, *args: str) -> None:
        self.instance_id = f"hp_127.0.0.1:{engine.port}"
        self.process = Process(["-m", "cacheroute_proxy", "instance-agent", "--instance-url", engine.url,
                                "--proxy-cp-url", cluster.cp_url, "--heartbeat-interval", "0.5", *args],
                               {}, cluster.tmp_path / f"agent-{engine.port}.log")

    def log(self) -> str:
        return self.process.log()


def listed(cluster: Cluster, instance_id: str) -> dict[str, Any] | None:
    rows = get(f"{cluster.cp_url}/v1/instance/list?include_dead=true")
    return next((row for row in rows if row["instance_id"] == instance_id), None)


def alive(cluster: Cluster, instance_id: str) -> bool:
    rows = get(f"{cluster.cp_url}/debug/instance_loads")["instances"]
    return any(row["instance_id"] == instance_id and row["is_alive"] for row in rows)
