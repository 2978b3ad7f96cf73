"""The contenders of the real-engine leg, each started over the same two engines and stopped
by pid (bench.harness.contenders.Contender: url, pids for CPU, describe()):

- this proxy (`cacheroute-proxy run`, WORKERS workers) with an instance agent per engine, as
  deployed: `kv_aware` on the engines' KV cache events (the agents find each engine's publisher
  in its /kv_event_sources; the workers tokenize with the model's tokenizer in 128-token
  blocks), and `least_load`;
- vllm-router (`--policy cache_aware`, its default, and `--policy kv_aware` subscribed to both
  engines' KV events) and the SGLang router (`--policy cache_aware`), each from its own venv
  under PEERS_DIR (`make peers`), pinned in PEER_REQUIREMENTS;
- and, to measure the ceiling, no router (`planned placement`): the client sends each request
  straight to the engine that a placement made from the whole run's requests gives its system
  prompt, balanced and fitting each cache, with nothing in between to cost time or CPU. No
  router can know the future or cost nothing; its TTFT is what routing alone could reach here.

Nothing here is tuned per contender beyond what the benchmark names: the peers run with their
defaults, at log level warning like the proxy, and this proxy with PROXY_ENV."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

from bench.harness.contenders import Contender, proxy_role
from bench.harness.processes import HOST, START_TIMEOUT_S, StartError, answers_ok, http_json, wait_for
from bench.harness.cpu import tree_by_role
from cacheroute_sim.processes import ROOT, ChildProcess, SupervisorPorts, free_port
from tests.real_engine.engines import MAX_NUM_SEQS, TINY_MODEL, VllmEngine
from tests.real_engine.registration import AgentRegistration

from bench.harness.cli import name_values

from .engine_side import KV_BLOCKS
from .workload import BLOCK_TOKENS, SERVED_MODEL, SYSTEM_TOKENS, Planned

WORKERS = 4
PROFILE = "vllm-cpu-tiny"
PEERS_DIR = ROOT / ".venv-peers"
PEER_REQUIREMENTS = Path(__file__).parent / "peers"  # <package>.txt: the pin `make peers` installs
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(ROOT / ".cache" / "hf")}


@dataclass(frozen=True)
class Spec:
    """One contender: `kind` "proxy" (strategy = a PROXY_INSTANCE_STRATEGY) or a peer package
    ("vllm-router", "sglang-router"; strategy = its --policy)."""
    name: str
    kind: str
    strategy: str
    env: tuple[tuple[str, str], ...] = ()  # the proxy's settings of this contender alone


# Every proxy contender's settings: the host-wide ready gate (READY_CONCURRENCY, 8 by default)
# sized above what the engines hold (max_num_seqs 4 each, the rest in their own queues), since the
# peers forward every request at once: the engines queue alike behind every contender. At 8, the
# engine kv_aware gives most prompts made its requests wait in the proxy (affinity_vllm_ready64.json).
PROXY_ENV = (("READY_CONCURRENCY", "64"),)
KV_AWARE_ENV = (("PROXY_AFFINITY_TOKENIZER", str(TINY_MODEL)),
                ("PROXY_AFFINITY_BLOCK_TOKENS", str(BLOCK_TOKENS)))
SPECS = (
    Spec("kv_aware", "proxy", "kv_aware", KV_AWARE_ENV),
    Spec("least_load", "proxy", "least_load"),
    Spec("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Spec("vllm-router kv_aware", "vllm-router", "kv_aware"),
    Spec("sglang-router cache_aware", "sglang-router", "cache_aware"),
    Spec("planned placement", "ceiling", "by the whole run"),
)
BASELINE = "least_load"
OURS = "kv_aware"
PEERS = tuple(s.name for s in SPECS if s.kind in ("vllm-router", "sglang-router"))


def variant(text: str) -> Spec:
    """`NAME:SETTING=VALUE,...` (--variant): kv_aware with these settings as well, run as the
    contender "kv_aware NAME" beside the default one, so a weight's candidate values meet on the
    same engines in the same interleaved run."""
    label, sep, settings = text.partition(":")
    if not sep or not label.strip():
        raise SystemExit(f"expected NAME:SETTING=VALUE,..., got {text!r}")
    pairs = tuple(name_values([item for item in settings.split(",") if item]).items())
    return Spec(f"{OURS} {label.strip()}", "proxy", "kv_aware", KV_AWARE_ENV + pairs)


def spec(name: str, variants: Sequence[Spec] = ()) -> Spec:
    for candidate in (*SPECS, *variants):
        if candidate.name == name:
            return candidate
    known = ", ".join(s.name for s in (*SPECS, *variants))
    raise ValueError(f"unknown contender {name!r}; choose from {known}")


def build(which: Spec, engines: Sequence[VllmEngine], log_dir: Path, proxy_env: dict[str, str],
          kv_aware_env: dict[str, str]) -> Contender:
    if which.kind == "proxy":
        env = {**dict(which.env), **proxy_env, **(kv_aware_env if which.strategy == "kv_aware" else {})}
        return ProxyWithAgents(which.name, which.strategy, engines, log_dir, env)
    if which.kind == "ceiling":
        return PlannedPlacement(which.name, engines)
    return PeerRouter(which, engines, log_dir)


def _slug(name: str) -> str:
    return name.replace(" ", "-")


# --- this proxy ----------------------------------------------------------------------------------
class ProxyWithAgents(Contender):
    """`cacheroute-proxy run` and an instance agent per engine (instance ids vllm-0, vllm-1).
    CPU is charged to the supervisor's tree (launcher, sidecar, workers) and the agents."""

    kind = "proxy"

    def __init__(self, name: str, strategy: str, engines: Sequence[VllmEngine], log_dir: Path,
                 env: dict[str, str]) -> None:
        super().__init__(name)
        self.engines = engines
        # WORKERS, unless a variant names its own count (--variant w2:PROXY_WORKERS=2).
        self.workers = int(env.get("PROXY_WORKERS", WORKERS))
        self.strategy = strategy
        self.ports = SupervisorPorts(self.workers, "cacheroute_bench_affv")
        self.env = {**self.ports.supervisor_env(strategy), "PROXY_PREDICTOR_PROFILE": PROFILE,
                    "PROXY_LOG_LEVEL": "warning", **env}
        self.url = self.ports.dp_url
        self.log_dir = log_dir
        self._child: ChildProcess | None = None
        self._agents: list[AgentRegistration] = []

    def launch(self) -> None:
        self._child = ChildProcess(["-m", "cacheroute_proxy", "run"], self.env,
                                   self.log_dir / f"{_slug(self.name)}.log", append_log=True, die_with_parent=True)

    def wait_ready(self) -> None:
        assert self._child is not None, "launch() first"
        child = self._child
        for url in (self.ports.cp_url, *(self.ports.worker_url(i) for i in range(self.workers)), self.ports.dp_url):
            wait_for(lambda url=url: answers_ok(f"{url}/healthz"), START_TIMEOUT_S, f"{self.name} {url}",
                     child.running, child.tail)
        # The agents report at their defaults, as deployed (a test's faster reports would be
        # charged to this proxy's CPU).
        self._agents = [AgentRegistration(self.ports.cp_url, engine, f"vllm-{i}",
                                          self.log_dir / f"agent-{_slug(self.name)}-{i}.log", reports=())
                        for i, engine in enumerate(self.engines)]
        wait_for(self._every_worker_sees_every_engine, START_TIMEOUT_S,
                 f"{self.name}: both engines registered with every worker", child.running, child.tail)
        if "PROXY_AFFINITY_TOKENIZER" in self.env:
            wanted = {f"vllm-{i}": e.kv_events_endpoint for i, e in enumerate(self.engines)}
            wait_for(lambda: self.followed_feeds() == wanted, START_TIMEOUT_S,
                     f"{self.name}: the sidecar subscribed to every engine's KV events", child.running, child.tail)

    def _every_worker_sees_every_engine(self) -> bool:
        for i in range(self.workers):
            status, loads = http_json("GET", f"{self.ports.worker_url(i)}/debug/instance_loads")
            if status != 200 or sum(1 for row in loads["instances"] if row["is_alive"]) < len(self.engines):
                return False
        return True

    def status(self) -> dict[str, Any]:
        status, body = http_json("GET", f"{self.ports.cp_url}/debug/status")
        if status != 200:
            raise StartError(f"{self.name}: /debug/status -> {status}")
        return body

    def followed_feeds(self) -> dict[str, str]:
        return {iid: feed["endpoint"] for iid, feed in (self.status().get("kv_event_feeds") or {}).items()}

    def stop(self) -> None:
        for agent in self._agents:
            agent.stop()
        if self._child is not None:
            self._child.stop(signal.SIGINT, 60)  # the supervisor stops its children, unlinks the segment

    def pids(self) -> list[int]:
        roots = [self._child.pid] if self._child and self._child.running() else []
        return roots + [a.process.pid for a in self._agents if a.process.running()]

    def processes_by_role(self) -> dict[str, list[psutil.Process]]:
        agents = {a.process.pid for a in self._agents}
        return tree_by_role(self.pids(), lambda proc, roots: "agents" if proc.pid in agents
                            else proxy_role(proc, roots - agents))

    def describe(self) -> dict[str, Any]:
        env = {k: v for k, v in self.env.items()
               if k not in self.ports.supervisor_env(self.strategy) or k == "PROXY_INSTANCE_STRATEGY"}
        return {**super().describe(), "command": f"{sys.executable} -m cacheroute_proxy run", "env": env,
                "agents": [a.process.popen.args[1:] for a in self._agents]}


# --- the peers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerPackage:
    module: str  # python -m <module>
    log_level: str  # what its --log-level calls warning


PEER_PACKAGES = {"vllm-router": PeerPackage("vllm_router.launch_router", "warning"),
                 "sglang-router": PeerPackage("sglang_router.launch_router", "warn")}


def peer_python(package: str) -> Path:
    return PEERS_DIR / package / "bin" / "python"


def pinned_version(package: str) -> str:
    """The version PEER_REQUIREMENTS/<package>.txt pins (`package==version`)."""
    for line in (PEER_REQUIREMENTS / f"{package}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1]
    raise ValueError(f"{PEER_REQUIREMENTS / package}.txt pins no {package}")


def installed_version(package: str) -> str | None:
    """The version installed in the peer's venv, None when the venv or the package is missing."""
    python = peer_python(package)
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


def peer_problem(package: str) -> str | None:
    """None when the pinned peer is installed, else what is wrong (run `make peers`)."""
    installed, pinned = installed_version(package), pinned_version(package)
    if installed is None:
        return f"{package} is not installed in {PEERS_DIR / package}: run `make peers`"
    if installed != pinned:
        return f"{PEERS_DIR / package} has {package} {installed}, the benchmark pins {pinned}: run `make peers`"
    return None


def peer_argv(which: Spec, engines: Sequence[VllmEngine], port: int, metrics_port: int) -> list[str]:
    """The router's command line: its address, both engines, the policy, a private Prometheus
    listener (both default to :29000), and for vllm-router's kv_aware each engine's KV event
    publisher with the engines' block size and the served model's name (it refuses static
    sources without a model identity)."""
    package = PEER_PACKAGES[which.kind]
    argv = ["-m", package.module, "--host", HOST, "--port", str(port),
            "--worker-urls", *(e.url for e in engines), "--policy", which.strategy,
            "--worker-startup-check-interval", "1",
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
            "--log-level", package.log_level]
    if which.kind == "vllm-router" and which.strategy == "kv_aware":
        for engine in engines:
            argv += ["--kv-event-source", f"{engine.url}={engine.kv_events_endpoint}"]
        argv += ["--kv-event-block-size", str(BLOCK_TOKENS), "--kv-event-model", SERVED_MODEL]
    return argv


class PeerRouter(Contender):
    """A router from its venv under PEERS_DIR, offline (HF_HUB_OFFLINE=1: nothing from a hub),
    ready once a chat through it is answered 200."""

    def __init__(self, which: Spec, engines: Sequence[VllmEngine], log_dir: Path) -> None:
        super().__init__(which.name)
        self.kind = which.kind
        self.strategy = which.strategy
        self.spec = which
        self.engines = engines
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_dir / f"{_slug(which.name)}.log"
        self.argv = peer_argv(which, engines, self.port, self.metrics_port)
        self.version: str | None = None
        self._child: ChildProcess | None = None

    def launch(self) -> None:
        problem = peer_problem(self.kind)
        if problem:
            raise StartError(problem)
        self.version = pinned_version(self.kind)
        self._child = ChildProcess(self.argv, OFFLINE_ENV, self.log_path, append_log=True,
                                   die_with_parent=True, program=str(peer_python(self.kind)))

    def wait_ready(self) -> None:
        assert self._child is not None, "launch() first"
        child = self._child
        body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
        wait_for(lambda: http_json("POST", f"{self.url}/v1/chat/completions", body, timeout=30)[0] == 200,
                 START_TIMEOUT_S, self.name, child.running, child.tail)

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(signal.SIGTERM, 30)

    def pids(self) -> list[int]:
        return [self._child.pid] if self._child and self._child.running() else []

    def log_lines(self, *needles: str) -> list[str]:
        """The lines of its log that hold any of `needles` (what it said of the engines)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if any(n in line for n in needles)]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "package": self.kind, "version": self.version,
                "command": " ".join([str(peer_python(self.kind)), *self.argv]),
                "env": OFFLINE_ENV}


# --- the ceiling ---------------------------------------------------------------------------------
class PlannedPlacement(Contender):
    """No router: `sender(planned)` sends each request straight to its system prompt's engine in
    `placement` of the requests about to be sent. Nothing to start, stop or charge CPU to."""

    kind = "ceiling"

    def __init__(self, name: str, engines: Sequence[VllmEngine]) -> None:
        super().__init__(name)
        self.engines = engines
        self.homes: dict[int, int] = {}

    def sender(self, planned: Sequence[Planned]) -> Callable[[Planned], str]:
        counts = Counter(request.system for request in planned)
        self.homes = placement(counts, len(self.engines), PROMPTS_AN_ENGINE_HOLDS)
        return lambda request: self.engines[self.homes[request.system]].url

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "prompts_an_engine_holds": PROMPTS_AN_ENGINE_HOLDS,
                "placement": {str(system): engine for system, engine in sorted(self.homes.items())}}


# The system prompts an engine's cache keeps whole: its blocks less one a running request holds
# of its own (a user turn), over a prompt's blocks (64 - 4 = 60 blocks, 8 prompts of 7).
PROMPTS_AN_ENGINE_HOLDS = (KV_BLOCKS - MAX_NUM_SEQS) // (SYSTEM_TOKENS // BLOCK_TOKENS)


def placement(counts: Mapping[int, int], engines: int, room: int) -> dict[int, int]:
    """Each prompt's engine: the most requested first, each to the engine with the fewest
    requests so far among those with room for another prompt (longest processing time first,
    within the caches); if no engine has room, to the one with the fewest requests."""
    load, held = [0] * engines, [0] * engines
    homes: dict[int, int] = {}
    for system, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        fits = [e for e in range(engines) if held[e] < room] or list(range(engines))
        engine = min(fits, key=lambda e: (load[e], e))
        homes[system] = engine
        load[engine] += count
        held[engine] += 1
    return homes
