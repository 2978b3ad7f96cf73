"""The instances the benchmarks route over, on free 127.0.0.1 ports, registered nowhere (the
contenders register them), one child process each, stopped by pid:

- SimInstances: simulated vLLM instances (cacheroute_sim.instance), so every contender can be
  pointed at the same instance processes;
- FakeInstances: a plain Starlette/uvicorn OpenAI fake (bench/peers/openai_fake.py) instead
  of the simulator, a second backend that is not the project's.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.processes import (HOST, START_TIMEOUT_S, Started, answers_ok, http_json, remove_dir,
                                     scratch_dir, wait_for)
from cacheroute_sim.instance.registration import register_meta
from cacheroute_sim.processes import ChildProcess, free_port

# Fast enough that a simulated instance is not what limits a non-streaming benchmark:
# prefill ~0.06 ms, one decode step ~0.024 ms.
DEFAULT_TIME_SCALE = 0.001


@dataclass
class InstanceSpec:
    slow_factor: float = 1.0
    max_concurrency: int | None = None  # None: the simulator's default (8)
    extra_args: tuple[str, ...] = ()


class Instances(Started):
    """Backend instances on free ports, one child process each, registered nowhere (contenders
    register them); a subclass says how one is started and how it says it is up."""

    kind = "backend"
    health_path = "/health"

    def __init__(self, specs: list[InstanceSpec], log_dir: Path | None = None) -> None:
        self.specs = list(specs)
        self.log_dir = log_dir or scratch_dir(self.kind)
        self._own_dir = log_dir is None
        self.ports: list[int] = []
        self.urls: list[str] = []
        self.ids: list[str] = []
        self._children: list[ChildProcess] = []

    def argv(self, spec: InstanceSpec, port: int, instance_id: str) -> list[str]:
        raise NotImplementedError

    def meta(self, spec: InstanceSpec) -> dict[str, Any]:
        """The `meta` of its registration on a proxy control plane."""
        return {}

    def start(self) -> None:
        for spec in self.specs:
            self._start_one(spec)
        for url, child in zip(self.urls, self._children):
            wait_for(lambda u=url: answers_ok(f"{u}{self.health_path}"), START_TIMEOUT_S,
                     f"instance {url}", child.running, child.tail)

    def _start_one(self, spec: InstanceSpec) -> None:
        port = free_port()
        instance_id = f"bench-{port}"
        child = ChildProcess(self.argv(spec, port, instance_id), {},
                             self.log_dir / f"{instance_id}.log", die_with_parent=True)
        self._children.append(child)
        self.ports.append(port)
        self.urls.append(f"http://{HOST}:{port}")
        self.ids.append(instance_id)

    def stop(self) -> None:
        for child in self._children:
            child.stop(signal.SIGTERM, timeout=10)
        if self._own_dir:
            remove_dir(self.log_dir)

    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def register_body(self, i: int) -> dict[str, Any]:
        """What a proxy control plane is sent to route to instance i."""
        return {"instance_id": self.ids[i], "host": HOST, "port": self.ports[i],
                "endpoints": ["/v1/chat/completions", "/v1/completions"], "tags": [],
                "weight": 1.0, "meta": self.meta(self.specs[i])}


class SimInstances(Instances):
    """Simulated vLLM instances (cacheroute_sim.instance)."""

    kind = "sim"
    health_path = "/healthz"

    def __init__(self, specs: list[InstanceSpec], time_scale: float = DEFAULT_TIME_SCALE,
                 log_dir: Path | None = None) -> None:
        super().__init__(specs, log_dir)
        self.time_scale = time_scale

    def argv(self, spec: InstanceSpec, port: int, instance_id: str) -> list[str]:
        argv = ["-m", "cacheroute_sim.instance", "--host", HOST, "--port", str(port),
                "--instance-id", instance_id, "--no-register", "--cp-port", "0",
                "--time-scale", str(self.time_scale), "--slow-factor", str(spec.slow_factor),
                "--log-level", "warning"]
        if spec.max_concurrency is not None:
            argv += ["--max-concurrency", str(spec.max_concurrency)]
        return argv + list(spec.extra_args)

    def meta(self, spec: InstanceSpec) -> dict[str, Any]:
        """As cacheroute_sim/instance/registration.py sends it."""
        return register_meta(spec.max_concurrency)

    def stats(self, i: int) -> dict[str, Any]:
        status, body = http_json("GET", f"{self.urls[i]}/sim/stats")
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"instance {self.urls[i]}: /sim/stats answered {status}")
        return body

    def reset_stats(self, i: int) -> None:
        http_json("POST", f"{self.urls[i]}/sim/stats/reset", {})


class FakeInstances(Instances):
    """Plain Starlette/uvicorn OpenAI fakes (bench/peers/openai_fake.py): a second backend that
    is not the project's simulator. No time scale, no admission: they answer at once; a spec's
    max_concurrency is only what the registration tells the proxy (max_num_seqs)."""

    kind = "starlette"

    def argv(self, spec: InstanceSpec, port: int, instance_id: str) -> list[str]:
        return ["-m", "bench.peers.openai_fake", "--host", HOST, "--port", str(port),
                *spec.extra_args]

    def meta(self, spec: InstanceSpec) -> dict[str, Any]:
        return {} if spec.max_concurrency is None else {"max_num_seqs": spec.max_concurrency}
