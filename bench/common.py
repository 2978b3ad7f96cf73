"""What the bench scripts and the end-to-end tests share: free 127.0.0.1 ports (and the ports,
segment name and environment of one supervisor), a percentile, the Scheduler-shaped request
example, and a child process started and stopped by its pid."""

from __future__ import annotations

import copy
import math
import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from supervisor.children import _die_with_parent

ROOT = Path(__file__).resolve().parent.parent


# --- ports -----------------------------------------------------------------------------------
LISTEN_PORTS_FROM = 10000  # listeners are picked from here up to the kernel's ephemeral range


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, below the ephemeral range: a port the
    kernel hands out as port 0 can be taken by any outgoing connection's source port before our
    server binds it (seen as "address already in use" under load); one below is not."""
    rng = random.Random()  # not the tests' seeded global one
    high = _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(LISTEN_PORTS_FROM, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # an exotic port range: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int) -> int:
    """A base port such that base .. base+count-1 are all free right now."""
    low = _ephemeral_low()
    for _ in range(200):
        base = free_port()
        if base + count >= 65000 or base < low < base + count:  # not into the ephemeral range
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


class SupervisorPorts:
    """Free 127.0.0.1 ports and a private segment name for one `python -m supervisor run` with
    `workers` workers, the environment that tells it so, and the URLs to reach it."""

    def __init__(self, workers: int, shm_prefix: str) -> None:
        self.workers = workers
        self.dp_port, self.cp_port = free_port(), free_port()
        self.private_base = free_port_range(workers)  # worker i answers on private_base + i
        self.shm_name = f"/{shm_prefix}_{uuid.uuid4().hex[:10]}"

    def supervisor_env(self, strategy: str) -> dict[str, str]:
        """No simulated instances of its own; room for 32 instances and 16 workers."""
        return {
            "PROXY_DP_PORT": str(self.dp_port), "PROXY_CP_PORT": str(self.cp_port),
            "PROXY_WORKER_PRIVATE_PORT_BASE": str(self.private_base),
            "PROXY_SHM_NAME": self.shm_name, "PROXY_SIM_INSTANCES": "0",
            "PROXY_INSTANCE_STRATEGY": strategy, "PROXY_WORKERS": str(self.workers),
            "PROXY_SHM_INSTANCE_CAPACITY": "32", "PROXY_SHM_WORKER_CAPACITY": "16",
        }

    @property
    def dp_url(self) -> str:
        return f"http://127.0.0.1:{self.dp_port}"

    @property
    def cp_url(self) -> str:
        return f"http://127.0.0.1:{self.cp_port}"

    def worker_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.private_base + index}"


# --- statistics ------------------------------------------------------------------------------
def percentile(values: list[float], q: float, *, method: str = "nearest_rank") -> float:
    """The q-quantile (0..1) of a non-empty list, one of its values.

    "nearest_rank": the ceil(q*n)-th smallest, the usual definition (the soak).
    "floor_index": sorted(values)[int(q*n)], one rank higher whenever q*n is a whole number;
    bench_pressure has always reported this one, so its numbers stay comparable.
    """
    ordered = sorted(values)
    if method == "nearest_rank":
        index = math.ceil(q * len(ordered)) - 1
    elif method == "floor_index":
        index = int(q * len(ordered))
    else:
        raise ValueError(f"unknown percentile method {method!r}")
    return ordered[min(len(ordered) - 1, max(0, index))]


# --- the Scheduler request example -------------------------------------------------------------
SCHEDULER_BODY: dict[str, Any] = {  # read only: scheduler_body() gives a copy to change
    "Request_ID": 0, "Request_type": "request",
    "Prompt": {"model": "llama3-70b", "user_prompt": "Who wrote X?", "token_length": 42, "bs": 1,
               "max_tokens": 4, "stream": True, "temperature": 0.7, "top_p": 0.95},
    "Service": {"Enable_PD_Disaggregation": True, "Enable_know_injection": False,
                "Injection_type": "text", "Enable_compress": False, "Compress_factor": 0.3,
                "Enable_security": False, "Knowledge_block_num": 0, "Knowledge_List": [],
                "Knowledge_length": 0, "SLO_TTFT": 15000, "SLO_E2E": 215000, "SLO_TPOT": 200,
                "Endpoint_type": "chat/completions"},
    "Task": {"User_addr": "127.0.0.1", "KDN_server_addr": "", "default_know_addr": "",
             "P_proxy_id": "hp_127.0.0.1:8001", "P_proxy_addr": "127.0.0.1", "P_proxy_port": 8001,
             "D_proxy_addr": "", "D_proxy_port": 0, "prefill_instance": "0", "decode_instance": "",
             "batch_order": 0, "User_url_path": "/v1/chat/completions"},
}


def scheduler_body(request_id: int, **prompt: Any) -> dict[str, Any]:
    """A fresh copy of SCHEDULER_BODY with this `Request_ID` and these `Prompt` fields set
    (e.g. `stream=False`)."""
    body = copy.deepcopy(SCHEDULER_BODY)
    body["Request_ID"] = request_id
    body["Prompt"].update(prompt)
    return body


# --- child processes -----------------------------------------------------------------------------
class ChildProcess:
    """`python <argv>` run from the repository root with `env` added to ours, stdout and stderr
    to `log_path`, in its own session (a Ctrl-C reaches only us); stopped by its pid.

    append_log: add to the log instead of starting it afresh (a process restarted on one log).
    die_with_parent: the child gets SIGTERM when the thread that started it ends (PDEATHSIG
    follows the creating thread, so start such children from the main thread).
    program: run this executable (e.g. "nginx") instead of our Python interpreter."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *,
                 append_log: bool = False, die_with_parent: bool = False,
                 program: str | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab" if append_log else "wb")  # noqa: SIM115 - lives as long as the child
        self.popen = subprocess.Popen([program or sys.executable, *argv], cwd=ROOT, env={**os.environ, **env},
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=_die_with_parent if die_with_parent else None)  # noqa: PLW1509

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


# --- process trees (a contender's cost) ----------------------------------------------------------
def process_tree(pids: list[int]) -> list["psutil.Process"]:
    """The processes of these roots and all their descendants that are alive right now."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue  # a root that already ended costs nothing more
    return list(found.values())


def tree_cpu_s(pids: list[int]) -> float:
    """user + system CPU seconds of every live process in the trees (take a delta over a window:
    a child that ends inside the window takes its seconds with it)."""
    import psutil

    total = 0.0
    for proc in process_tree(pids):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def tree_rss_bytes(pids: list[int]) -> int:
    """Resident set size summed over the trees (shared pages are counted once per process)."""
    import psutil

    total = 0
    for proc in process_tree(pids):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


# --- machine and versions (what a results file records) -------------------------------------------
def machine_info() -> dict[str, Any]:
    """nproc, CPU model, kernel, memory, load average and CPU pressure right now."""
    import platform

    info: dict[str, Any] = {"nproc": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "kernel": platform.release(), "machine": platform.machine(),
                            "python": sys.version.split()[0],
                            "loadavg": [round(x, 2) for x in os.getloadavg()]}
    for key, path, pick in (("cpu_model", "/proc/cpuinfo", "model name"),
                            ("mem_total", "/proc/meminfo", "MemTotal")):
        try:
            line = next(ln for ln in Path(path).read_text().splitlines() if ln.startswith(pick))
            info[key] = line.split(":", 1)[1].strip()
        except (OSError, StopIteration):
            info[key] = None
    try:  # "some avg10=... avg60=..." lines: how long runnable tasks waited for a CPU
        info["pressure_cpu"] = Path("/proc/pressure/cpu").read_text().strip().splitlines()
    except OSError:
        info["pressure_cpu"] = None
    return info


def tool_versions(packages: tuple[str, ...] = (), commands: tuple[tuple[str, ...], ...] = ()) -> dict[str, Any]:
    """Installed versions of these Python packages and the first output line of these commands
    (e.g. ("nginx", "-v")); None for what is missing."""
    from importlib import metadata

    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    for argv in commands:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
            text = (done.stdout or done.stderr).strip().splitlines()
            out[argv[0]] = text[0] if text else None
        except (OSError, subprocess.TimeoutExpired):
            out[argv[0]] = None
    return out


# --- wrk (C load generator) with a POST Lua script -------------------------------------------------
# Percentiles wrk's done() hook reports, for latency-distribution charts (p in percent).
WRK_PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99)
WRK_DONE_MARK = "WRK_JSON "
_WRK_DONE_LUA = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('%s{"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d,' ..
    '"min_us":%%d,"max_us":%%d,"mean_us":%%.1f,"percentiles_us":[',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout, latency.min, latency.max, latency.mean))
  for i, p in ipairs({%s}) do
    if i > 1 then io.write(",") end
    io.write(string.format("[%%s,%%d]", p, latency:percentile(p)))
  end
  io.write("]}\\n")
end
"""


def wrk_post_script(path: Path, body: str, url_path: str | None = None) -> Path:
    """Write a wrk Lua script that POSTs `body` (JSON text, no single quotes) and prints the
    summary, error counts and latency percentiles as one JSON line (read by run_wrk)."""
    if "'" in body or "\n" in body:
        raise ValueError("the body must be one line of JSON without single quotes")
    lines = ['wrk.method = "POST"', f"wrk.body = '{body}'",
             'wrk.headers["Content-Type"] = "application/json"']
    if url_path:
        lines.append(f'wrk.path = "{url_path}"')
    percentiles = ",".join(str(p) for p in WRK_PERCENTILES)
    path.write_text("\n".join(lines) + "\n" + _WRK_DONE_LUA % (WRK_DONE_MARK, percentiles))
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float, *, threads: int = 1,
            timeout_s: float = 5.0) -> dict[str, Any]:
    """One `wrk -t<threads> -c<connections> -d<seconds>` run (bounded: killed at seconds + 30).

    Returns requests, rps, p50_ms / p99_ms, errors (socket errors + non-2xx/3xx), error_kinds,
    percentiles_ms ([[percent, ms], ...]) and, when wrk failed, the end of its output."""
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--timeout", f"{timeout_s:g}s", "-s", str(script), url]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=False)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # run() has killed it
        out, code = f"wrk did not finish: {exc}", -1
    return _wrk_result(out, code)


def _wrk_result(out: str, code: int) -> dict[str, Any]:
    import json

    line = next((ln for ln in out.splitlines() if ln.startswith(WRK_DONE_MARK)), None)
    if line is None:
        return {"requests": 0, "rps": 0.0, "errors": 0, "wrk_failed": True, "wrk_output": out[-800:]}
    raw = json.loads(line[len(WRK_DONE_MARK):])
    kinds = {k: raw[k] for k in ("connect", "read", "write", "status", "timeout")}
    seconds = raw["duration_us"] / 1e6
    pct = [[p, round(us / 1000, 4)] for p, us in raw["percentiles_us"]]
    by_p = {p: ms for p, ms in pct}
    result: dict[str, Any] = {
        "requests": raw["requests"], "seconds": round(seconds, 3),
        "rps": round(raw["requests"] / seconds, 1) if seconds else 0.0,
        "p50_ms": by_p.get(50), "p99_ms": by_p.get(99), "mean_ms": round(raw["mean_us"] / 1000, 4),
        "max_ms": round(raw["max_us"] / 1000, 4), "errors": sum(kinds.values()),
        "error_kinds": kinds, "percentiles_ms": pct}
    if code != 0:
        result["wrk_output"] = out[-800:]
    return result
