"""Processes on 127.0.0.1 for the demo, the tests and the benchmarks: free listening ports
outside the ephemeral range (none handed out twice), private segment names, the ports and
segment name of one `cacheroute-proxy run`, and a child process started from the repository
root and stopped by its pid.

Parallel test workers (pytest-xdist) cannot see what each other handed out: each picks its ports
from its own share of the window and puts its name in its segments' names, and so does every
process it starts (they inherit the worker's environment)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from cacheroute_proxy.supervisor import children

ROOT = Path(__file__).resolve().parent.parent


# --- parallel test workers -----------------------------------------------------------------------
def parallel_worker() -> tuple[int, int]:
    """(index, count) of the pytest-xdist worker this process is or was started by; (0, 1)
    outside one."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if name.startswith("gw") and name[2:].isdigit() and count.isdigit() and int(name[2:]) < int(count):
        return int(name[2:]), int(count)
    return 0, 1


def segment_prefix(prefix: str) -> str:
    """What every segment `segment_name(prefix)` names starts with: the prefix and, in a parallel
    test worker, the worker's name (a worker's leftover-segment check watches only its own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if parallel_worker()[1] > 1 else ""
    return f"{prefix}_{worker}_" if worker else f"{prefix}_"


def segment_name(prefix: str) -> str:
    """A private shared-memory segment name, `/<segment_prefix(prefix)><random>`."""
    return f"/{segment_prefix(prefix)}{uuid.uuid4().hex[:10]}"


# --- ports -----------------------------------------------------------------------------------
LISTEN_PORTS_FROM = 10000  # listeners are picked from here up to the kernel's ephemeral range
# The ports this process handed out lately, never handed out again: a port is free when it is
# picked but taken only when its server binds it, and two picks in that gap (a supervisor's
# ports, then an engine's, before either has started) could otherwise name the same port.
# At most half the window is remembered, so that a free range is still found quickly in a
# parallel test worker's share.
_RECENT_LIMIT = 4096
_recent: dict[int, None] = {}  # in the order handed out (a dict: ordered, and a set)


def recent_limit(window: range) -> int:
    """How many of the ports handed out last are never handed out again."""
    return min(_RECENT_LIMIT, len(window) // 2)


def _remember(ports: range, window: range) -> None:
    _recent.update(dict.fromkeys(ports))
    while len(_recent) > recent_limit(window):
        del _recent[next(iter(_recent))]


def _listen_window() -> range:
    """Where listeners are picked: below the kernel's ephemeral range, or above it where the
    range starts too low to leave room below; in a parallel test worker, its share of that."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    window = range(LISTEN_PORTS_FROM, low) if low - LISTEN_PORTS_FROM >= 1000 else range(high + 1, 65536)
    index, count = parallel_worker()
    share = len(window) // count
    return range(window.start + index * share, window.start + (index + 1) * share)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now and was not handed out lately, outside the
    ephemeral range: a port the kernel hands out as port 0 can be taken by any outgoing
    connection's source port before our server binds it (seen as "address already in use"
    under load); one outside it is not."""
    return free_port_range(1)


def free_port_pair() -> int:
    """A port P such that P and P + 1 are both free right now: for a simulated instance, whose
    control plane listens on its port + 1 unless told otherwise. Were only P reserved, P + 1
    could be any other listener, and the Proxy's KV pulls would go to it."""
    return free_port_range(2)


def free_port_range(count: int) -> int:
    """A base port such that base .. base+count-1 are all free right now, outside the ephemeral
    range, and none of them handed out lately by this process."""
    rng = random.Random()  # not the tests' seeded global one
    window = _listen_window()
    for _ in range(400):
        base = rng.randrange(window.start, window.stop - count + 1)
        ports = range(base, base + count)
        if not _recent.keys().isdisjoint(ports) or not _all_free(ports):
            continue
        _remember(ports, window)
        return base
    raise RuntimeError(f"no {count} free ports in a row in {window.start}..{window.stop - 1}")


def _all_free(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


class SupervisorPorts:
    """Free 127.0.0.1 ports and a private segment name for one `cacheroute-proxy run` with
    `workers` workers, the environment that tells it so, and the URLs to reach it."""

    def __init__(self, workers: int, shm_prefix: str) -> None:
        self.workers = workers
        # One range for all of them: ports picked one by one can collide with each other (seen:
        # the control plane on worker 1's private port, whose bind then waited behind it).
        base = free_port_range(workers + 2)
        self.dp_port, self.cp_port = base, base + 1
        self.private_base = base + 2  # worker i answers on private_base + i
        self.shm_name = segment_name(shm_prefix)

    def supervisor_env(self, strategy: str) -> dict[str, str]:
        """Room for 32 instances and 16 workers (instances register themselves)."""
        return {
            "PROXY_DP_PORT": str(self.dp_port), "PROXY_CP_PORT": str(self.cp_port),
            "PROXY_WORKER_PRIVATE_PORT_BASE": str(self.private_base),
            "PROXY_SHM_NAME": self.shm_name,
            "PROXY_INSTANCE_STRATEGY": strategy, "PROXY_WORKERS": str(self.workers),
            "PROXY_SHM_INSTANCE_CAPACITY": "32", "PROXY_SHM_WORKER_CAPACITY": "16",
            # No dashboard listener of its own: the demo's default (:8202) is one per machine.
            "PROXY_UI_LISTEN": "",
        }

    @property
    def dp_url(self) -> str:
        return f"http://127.0.0.1:{self.dp_port}"

    @property
    def cp_url(self) -> str:
        return f"http://127.0.0.1:{self.cp_port}"

    def worker_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.private_base + index}"


# --- child processes -----------------------------------------------------------------------------
class ChildProcess:
    """`python <argv>` run from the repository root (or `cwd`) with `env` added to ours, stdout and stderr
    to `log_path`, in its own session (a Ctrl-C reaches only us); stopped by its pid.

    append_log: add to the log instead of starting it afresh (a process restarted on one log).
    die_with_parent: the child gets SIGTERM when the thread that started it ends (PDEATHSIG
    follows the creating thread, so start such children from the main thread).
    program: run this executable (e.g. "nginx") instead of our Python interpreter."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *,
                 append_log: bool = False, die_with_parent: bool = False,
                 program: str | None = None, cwd: Path = ROOT) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab" if append_log else "wb")  # noqa: SIM115 - lives as long as the child
        self.popen = subprocess.Popen([program or sys.executable, *argv], cwd=cwd, env={**os.environ, **env},
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=children.die_with_parent if die_with_parent else None)  # noqa: PLW1509

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Send `signum` and wait up to `timeout` s, then SIGKILL; the exit code (negative:
        the signal that ended it)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log()[-chars:]
        except OSError:
            return ""


