"""What the bench scripts and the end-to-end tests share: free 127.0.0.1 ports (and the ports,
segment name and environment of one supervisor), a percentile, the Scheduler-shaped request
example, and a child process started and stopped by its pid."""

from __future__ import annotations

import copy
import math
import os
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
def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int) -> int:
    """A base port such that base .. base+count-1 are all free right now."""
    for _ in range(200):
        base = free_port()
        if base + count >= 65000:
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
    follows the creating thread, so start such children from the main thread)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *,
                 append_log: bool = False, die_with_parent: bool = False) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab" if append_log else "wb")  # noqa: SIM115 - lives as long as the child
        self.popen = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**os.environ, **env},
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
