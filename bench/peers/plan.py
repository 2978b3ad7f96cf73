"""What one bench-peers run compares and with what load: the settings and the contender list."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.harness.backends import FakeInstances, InstanceSpec, Instances, SimInstances
from bench.harness.contenders import (Contender, DirectContender, NginxContender, ProxyContender,
                              RelayFloorContender, RouterContender)

SCENARIOS = ("c1", "c32", "stream32", "stream256")
# sim: the project's simulated vLLM instances; starlette: a plain Starlette/uvicorn OpenAI fake
# (bench/peers/openai_fake.py), so the figures do not depend on the simulator's shape.
BACKENDS = ("sim", "starlette")


@dataclass
class RunConfig:
    out: str
    repeats: int = 3
    duration_s: float = 5.0
    warmup_s: float = 2.0
    warmup_streams: bool = True  # --quick warms up with wrk only
    isolate: bool = False  # start each contender for its own points only
    contenders: list[str] = field(default_factory=list)  # empty: DEFAULT_CONTENDERS
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))  # run one after the other
    instances: int = 2
    # Simulated time x0.001: an instance answers in ~0.15 ms of simulated work, so the proxies,
    # not the simulated GPU, decide the numbers (the instances' Python still costs CPU).
    time_scale: float = 0.001
    # Admission at the instance and, for this proxy, host-wide READY_CONCURRENCY set to the same
    # capacity: neither side queues below what the instance accepts.
    instance_max_concurrency: int = 64
    max_tokens: int = 4        # content chunks per answer (a few SSE chunks per stream)
    high_concurrency: int = 32
    # The long-stream leg: what relaying costs per token, when the stream's fixed costs fade.
    long_stream_tokens: int = 256
    long_stream_concurrency: int = 16


@dataclass(frozen=True)
class ContenderPlan:
    name: str
    kind: str                  # "direct" | "proxy" | "nginx" | "router" | "floor"
    workers: int | None = None
    strategy: str | None = None

    def build(self, instances: Instances, cfg: RunConfig) -> Contender:
        if self.kind == "direct":
            return DirectContender(self.name, instances)
        if self.kind == "nginx":
            return NginxContender(self.name, instances, worker_processes=self.workers or 2,
                                  method=self.strategy or "least_conn")
        if self.kind == "router":
            return RouterContender(self.name, instances, policy=self.strategy or "round_robin")
        if self.kind == "floor":
            return RelayFloorContender(self.name, instances, workers=self.workers or 2)
        env = {"READY_CONCURRENCY": str(cfg.instance_max_concurrency),
               "PREPARE_CONCURRENCY": str(cfg.instance_max_concurrency)}
        return ProxyContender(self.name, instances, workers=self.workers or 1,
                              strategy=self.strategy or "round_robin", extra_env=env)


def _proxy(workers: int, strategy: str) -> ContenderPlan:
    short = {"round_robin": "rr", "least_load": "ll"}[strategy]
    return ContenderPlan(f"proxy-w{workers}-{short}", "proxy", workers, strategy)


KNOWN: dict[str, ContenderPlan] = {p.name: p for p in [
    ContenderPlan("direct", "direct"),
    *(_proxy(n, s) for s in ("round_robin", "least_load") for n in (1, 2, 4)),
    ContenderPlan("nginx", "nginx", 2, "least_conn"),
    ContenderPlan("vllm-router-p2", "router", None, "power_of_two"),
    # The product's server and forward client with nothing of the product between them
    # (bench/peers/relay_floor.py): what the stack costs before the product does anything.
    ContenderPlan("relay-floor-w2", "floor", 2),
    # Not in the default run; ask for them with --contenders.
    ContenderPlan("vllm-router-rr", "router", None, "round_robin"),
    ContenderPlan("nginx-rr", "nginx", 2, "round_robin"),
    ContenderPlan("vllm-router-cache-aware", "router", None, "cache_aware"),
]}
# The default set: what the targets compare (bench/peers/targets.py), and the floor under the
# proxy; small enough that both backends take about the time one took with all six proxy variants.
DEFAULT_CONTENDERS = ["direct", "proxy-w2-ll", "nginx", "vllm-router-p2", "relay-floor-w2"]


def instances_for(backend: str, cfg: RunConfig) -> Instances:
    """The backend's instances (not started): cfg.instances of them, same admission."""
    specs = [InstanceSpec(max_concurrency=cfg.instance_max_concurrency)] * cfg.instances
    if backend == "sim":
        return SimInstances(specs, time_scale=cfg.time_scale)
    if backend == "starlette":
        return FakeInstances(specs)
    raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")


def chosen(cfg: RunConfig) -> list[ContenderPlan]:
    """The plans to run; `direct` is always included (added latency is measured against it)."""
    names = cfg.contenders or DEFAULT_CONTENDERS
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(f"unknown contender(s) {unknown}; choose from {sorted(KNOWN)}")
    names = ["direct", *(n for n in names if n != "direct")]  # first: the runner relies on it
    return [KNOWN[n] for n in dict.fromkeys(names)]
