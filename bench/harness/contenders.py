"""Start and stop what the benchmarks compare, all over the SAME instances
(bench/harness/backends.py).

- Contenders (context managers, each with .name, .kind, .url and the root pids whose process
  trees the benchmarks charge CPU and RSS to):
  DirectContender (instance 0 itself, the baseline), ProxyContender (this proxy through its
  supervisor, or as it was at a git ref), NginxContender (Debian nginx as a foreground process
  with its own config and temp dir), RouterContender (vllm-router from PyPI, the Rust LLM router
  of vllm-project), RelayFloorContender (the product's server and client, nothing between).
- `rotated`: the order of an interleaved run's repeat.

`with contender:` starts and stops one; a benchmark starting many may call launch() on each,
then wait_ready() on each, so they come up in parallel (stop() is safe in any state).
Every process is started in its own session and stopped by its pid, also when a start fails.
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any, Sequence, TypeVar

import psutil

from bench.harness.backends import Instances
from bench.harness.baseline import launcher_command
from bench.harness.processes import (HOST, START_TIMEOUT_S, Started, StartError, Supervisor, answers_ok,
                                     http_json, remove_dir, scratch_dir, wait_for)
from bench.harness.cpu import cpu_s, tree_by_role, tree_cpu_s, tree_rss_bytes
from cacheroute_sim.processes import ChildProcess, free_port

T = TypeVar("T")


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """`items` starting at `shift` (modulo their number): repeat r of an interleaved run starts
    with the r-th contender, so none always runs first, or last."""
    k = shift % len(items) if items else 0
    return [*items[k:], *items[:k]]


class Contender(Started):
    """Base of everything measured: started by the harness, stopped by pid."""

    kind = "direct"

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = ""
        self.workers: int | None = None
        self.strategy: str | None = None

    def start(self) -> None:
        """launch() then wait_ready(); a harness starting many may launch all, then wait."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the processes without waiting for them."""

    def wait_ready(self) -> None:
        """Block until it routes (StartError if it does not within START_TIMEOUT_S)."""

    def stop(self) -> None:
        pass

    def pids(self) -> list[int]:
        """Root pids; CPU and RSS are measured over their whole process trees."""
        return []

    def cpu_seconds(self) -> float:
        """user + system seconds of the process tree so far (take deltas)."""
        return tree_cpu_s(self.pids())

    def processes_by_role(self) -> dict[str, list[psutil.Process]]:
        """The live processes of the tree by role; {} when a contender has no roles worth
        telling apart."""
        return {}

    def cpu_seconds_by_role(self) -> dict[str, float]:
        """cpu_seconds() split by role (processes_by_role)."""
        return {role: sum(cpu_s(proc) for proc in procs) for role, procs in self.processes_by_role().items()}

    def rss_mb(self) -> float:
        return tree_rss_bytes(self.pids()) / 1e6

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "workers": self.workers,
                "strategy": self.strategy}


class ProcessContender(Contender):
    """A contender that is one child process (and its tree) with a scratch directory; stopped
    by pid with `stop_signal`, the directory removed."""

    stop_signal = signal.SIGTERM
    stop_timeout_s = 20.0

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.log_dir = scratch_dir(name)
        self._child: ChildProcess | None = None

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(self.stop_signal, timeout=self.stop_timeout_s)
        remove_dir(self.log_dir)

    def pids(self) -> list[int]:
        return [self._child.pid] if self._child and self._child.running() else []

    def log_tail(self) -> str:
        return self._child.tail() if self._child else ""


class DirectContender(Contender):
    """Instance 0 itself: the baseline that added latency is measured against."""

    kind = "direct"

    def __init__(self, name: str, instances: Instances, index: int = 0) -> None:
        super().__init__(name)
        self.instances = instances
        self.index = index
        self.url = instances.urls[index]

    def pids(self) -> list[int]:
        return [self.instances.pids()[self.index]]


class ProxyContender(ProcessContender):
    """This proxy via `python -m cacheroute_proxy run` (or, with `tree`, as it was in that
    baseline tree: bench/harness/baseline.py; with `python`, on that interpreter): free ports,
    a private segment, no simulated instances of its own; every instance of `instances`
    registered on its control plane."""

    kind = "proxy"

    def __init__(self, name: str, instances: Instances, workers: int, strategy: str,
                 load_view: str = "shared", extra_env: dict[str, str] | None = None,
                 tree: Path | None = None, python: str | None = None) -> None:
        super().__init__(name)
        self.instances = instances
        self.workers = workers
        self.strategy = strategy
        command, program = launcher_command(tree, python) if tree else (("-m", "cacheroute_proxy", "run"), python)
        env = {"PROXY_LOAD_VIEW": load_view,
               # Registered once by us, never heartbeated: a TTL longer than any run.
               "PROXY_INSTANCE_TTL_S": "86400", "PROXY_LOG_LEVEL": "warning", **(extra_env or {})}
        self.supervisor = Supervisor(workers, strategy, self.log_dir / "supervisor.log", env, name=name,
                                     command=command, program=program)
        self.url = self.supervisor.dp_url

    def launch(self) -> None:
        self.supervisor.launch()
        self._child = self.supervisor.child

    def wait_ready(self) -> None:
        self.supervisor.wait_up()
        for i in range(len(self.instances.urls)):
            self._register(i)
        self.supervisor.wait_seen(set(self.instances.ids))

    def stop(self) -> None:
        self.supervisor.stop()  # it stops its workers and sidecar and unlinks the segment
        remove_dir(self.log_dir)

    def processes_by_role(self) -> dict[str, list[psutil.Process]]:
        return tree_by_role(self.pids(), proxy_role)

    def _register(self, i: int) -> None:
        status, body = http_json("POST", f"{self.supervisor.cp_url}/v1/instance/register",
                                 self.instances.register_body(i))
        if status != 200:
            raise StartError(f"{self.name}: register {self.instances.urls[i]} -> {status} {body}")


PROXY_ROLES = (("sidecar", ("-m", "sidecar")), ("workers", ("-m", "proxy_workers")))


def proxy_role(proc: Any, roots: set[int]) -> str:
    """The role of one process of this proxy's tree: the root is the launcher (the supervisor,
    `-m cacheroute_proxy run`); its children are told apart by their command line (how
    cacheroute_proxy/supervisor/arbiter.py starts them); anything else is "other"."""
    if proc.pid in roots:
        return "launcher"
    cmdline = proc.cmdline()
    for role, marker in PROXY_ROLES:
        if any(tuple(cmdline[i:i + 2]) == marker for i in range(len(cmdline) - 1)):
            return role
    return "other"


NGINX_CONF = """\
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream backends {{
        zone backends 64k;
        {method}
{servers}
        keepalive 64;
        keepalive_timeout 4s;
    }}
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            proxy_pass http://backends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
# keepalive_timeout: nginx must close an idle upstream connection before the instance's uvicorn
# does (5 s); otherwise a request sent on it as it closes is a 502 (a POST is not retried). The
# proxy's pool closes them after 4 s for the same reason (proxy_workers/upstream.py).
NGINX_METHODS = {"least_conn": "least_conn;", "round_robin": "", "random_two": "random two least_conn;"}


class NginxContender(ProcessContender):
    """Debian nginx as a foreground process: its own config, pid file, temp paths and error log
    in a temp dir; never the system service."""

    kind = "nginx"

    def __init__(self, name: str, instances: Instances, worker_processes: int = 2,
                 method: str = "least_conn") -> None:
        super().__init__(name)
        if method not in NGINX_METHODS:
            raise ValueError(f"nginx method {method!r}: choose one of {sorted(NGINX_METHODS)}")
        self.instances = instances
        self.workers = worker_processes
        self.strategy = method
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"

    def config_text(self) -> str:
        servers = "\n".join(f"        server {HOST}:{p} max_fails=0;" for p in self.instances.ports)
        return NGINX_CONF.format(workers=self.workers, dir=self.log_dir, method=NGINX_METHODS[self.strategy],
                                 servers=servers, host=HOST, port=self.port)

    def launch(self) -> None:
        program = shutil.which("nginx") or "/usr/sbin/nginx"
        # nginx's workers run as an unprivileged user when we are root: they must reach the dir.
        self.log_dir.chmod(0o755)
        conf = self.log_dir / "nginx.conf"
        conf.write_text(self.config_text())
        self._child = ChildProcess(["-p", str(self.log_dir), "-c", str(conf), "-g", "daemon off;"],
                                   {}, self.log_dir / "stdout.log", die_with_parent=True, program=program)

    def wait_ready(self) -> None:
        assert self._child is not None, "launch() first"
        child = self._child
        wait_for(lambda: answers_ok(f"{self.url}{self.instances.health_path}"), START_TIMEOUT_S,
                 self.name, child.running, lambda: child.tail() + self._error_log())

    def _error_log(self) -> str:
        try:
            return (self.log_dir / "error.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def router_available() -> str | None:
    """None when vllm-router can run here, else why not (for the results' notes)."""
    try:
        import vllm_router.router  # noqa: F401 - the Rust extension behind it
    except ImportError as exc:
        return f"vllm-router not importable: {exc} (pip install -e '.[bench]')"
    return None


class RouterContender(ProcessContender):
    """vllm-router (PyPI, the Rust router of vllm-project) in front of the instances:
    `python -m vllm_router.launch_router --worker-urls ... --policy P --port N`."""

    kind = "router"

    def __init__(self, name: str, instances: Instances, policy: str = "round_robin",
                 extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(name)
        self.instances = instances
        self.strategy = policy
        self.extra_args = extra_args
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://{HOST}:{self.port}"

    def argv(self) -> list[str]:
        # It waits for GET /health on every worker before routing (the simulator answers it,
        # like vLLM); its own Prometheus listener would take port 29000: a free port instead.
        return ["-m", "vllm_router.launch_router", "--host", HOST, "--port", str(self.port),
                "--worker-urls", *self.instances.urls, "--policy", self.strategy,
                "--worker-startup-check-interval", "1",
                "--prometheus-host", HOST, "--prometheus-port", str(self.metrics_port),
                "--log-level", "warning", *self.extra_args]

    def launch(self) -> None:
        why = router_available()
        if why:
            raise StartError(why)
        self._child = ChildProcess(self.argv(), {}, self.log_dir / "router.log", die_with_parent=True)

    def wait_ready(self) -> None:
        assert self._child is not None, "launch() first"
        child = self._child
        wait_for(self._routes, START_TIMEOUT_S, self.name, child.running, child.tail)

    def _routes(self) -> bool:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": False}
        return http_json("POST", f"{self.url}/v1/chat/completions", body)[0] == 200


class RelayFloorContender(ProcessContender):
    """The product's own HTTP server and forward client with nothing of the product between
    them (bench/peers/relay_floor.py), `workers` processes on one port: the floor under this
    proxy's figures."""

    kind = "floor"

    def __init__(self, name: str, instances: Instances, workers: int = 2) -> None:
        super().__init__(name)
        self.instances = instances
        self.workers = workers
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"

    def launch(self) -> None:
        upstreams = [arg for url in self.instances.urls for arg in ("--upstream", url)]
        self._child = ChildProcess(["-m", "bench.peers.relay_floor", "--port", str(self.port),
                                    "--processes", str(self.workers), *upstreams],
                                   {}, self.log_dir / "relay_floor.log", die_with_parent=True)

    def wait_ready(self) -> None:
        assert self._child is not None, "launch() first"
        child = self._child
        wait_for(lambda: answers_ok(f"{self.url}/healthz"), START_TIMEOUT_S, self.name,
                 child.running, child.tail)
