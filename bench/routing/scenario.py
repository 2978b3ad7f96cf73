"""What is measured: the instances (two fast, one slow with fewer slots), the schedule, and
the contenders. One place, so the results JSON can say exactly what ran."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from bench.harness.backends import InstanceSpec, SimInstances
from bench.harness.contenders import Contender, NginxContender, ProxyContender
from bench.routing.schedule import ScheduleSpec
from bench.routing.summary import NGINX, PER_WORKER, REFERENCE, ROUND_ROBIN, SHARED


@dataclass(frozen=True)
class Scenario:
    # Simulated time runs at this fraction of a real GPU's (0.5: twice as fast).
    time_scale: float = 0.5
    fast_instances: int = 2
    slow_factor: float = 3.0          # every duration of the slow instance x this
    slow_max_concurrency: int = 4     # and half the slots: it saturates first
    fast_max_concurrency: int = 8
    schedule: ScheduleSpec = ScheduleSpec()
    drain_timeout_s: float = 90.0     # after the last arrival, then unfinished streams are errors
    nginx_workers: int = 4
    # PROXY_LEAST_LOAD_WEIGHTS for every proxy contender. The original's default weighs 1 s of
    # predicted backlog like one request in flight, so within a
    # burst each view sends the slow instance its count share; 10x that lets the (learned)
    # backlog steer. Same for all proxy contenders: the ablation compares views, not weights.
    least_load_weights: tuple[tuple[str, float], ...] = (("predicted_total_backlog_ms", 0.01),)

    def proxy_env(self) -> dict[str, str]:
        return {"PROXY_LEAST_LOAD_WEIGHTS": json.dumps(dict(self.least_load_weights))}

    def instance_specs(self) -> list[InstanceSpec]:
        fast = InstanceSpec(slow_factor=1.0, max_concurrency=self.fast_max_concurrency)
        slow = InstanceSpec(slow_factor=self.slow_factor, max_concurrency=self.slow_max_concurrency)
        return [fast] * self.fast_instances + [slow]

    def instance_labels(self) -> list[str]:
        return [f"fast{i}" for i in range(self.fast_instances)] + ["slow"]

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["instances"] = [{"label": label, **asdict(spec)}
                            for label, spec in zip(self.instance_labels(), self.instance_specs(), strict=True)]
        return out


def quick(scenario: Scenario) -> Scenario:
    """A smoke run: the same shape, ~8 s of arrivals."""
    return replace(scenario, schedule=replace(scenario.schedule, duration_s=8.0), drain_timeout_s=60.0)


@dataclass(frozen=True)
class ContenderDef:
    name: str
    kind: str
    workers: int
    strategy: str
    load_view: str | None  # proxies only
    make: Callable[[SimInstances], Contender]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "workers": self.workers,
                "strategy": self.strategy, "load_view": self.load_view}


def _proxy(name: str, workers: int, strategy: str, view: str, env: dict[str, str]) -> ContenderDef:
    return ContenderDef(name, "proxy", workers, strategy, view,
                        lambda inst: ProxyContender(name, inst, workers, strategy, load_view=view,
                                                    extra_env=env))


def contender_defs(scenario: Scenario) -> list[ContenderDef]:
    env = scenario.proxy_env()
    return [
        _proxy(REFERENCE, 1, "least_load", "shared", env),
        _proxy(SHARED, 4, "least_load", "shared", env),
        _proxy(PER_WORKER, 4, "least_load", "per_worker", env),
        _proxy(ROUND_ROBIN, 4, "round_robin", "shared", env),
        ContenderDef(NGINX, "nginx", scenario.nginx_workers, "least_conn", None,
                     lambda inst: NginxContender(NGINX, inst, worker_processes=scenario.nginx_workers,
                                                 method="least_conn")),
    ]
