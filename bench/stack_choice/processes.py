"""The orchestrator's children: started on pre-bound sockets, checked, stopped by pid."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from .payloads import HOST, N_CHUNKS, REPO, REQ_BODY, SSE_DONE




_CHILDREN: list = []


class Child:
    def __init__(self, name: str, child_args: list[str], cpu: int | None, logdir: Path,
                 ready_path: str = "/health"):
        self.name = name
        shared = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind((HOST, 0))
        shared.listen(1024)
        private = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        private.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        private.bind((HOST, 0))
        private.listen(1024)
        for s in (shared, private):
            # Inherited by accepted sockets on Linux.  Granian sets this on the listeners it
            # builds itself and does NOT set it per connection, so a pre-bound socket without
            # it gives ~40 ms Nagle/delayed-ACK stalls on streamed responses.  uvloop (uvicorn,
            # hypercorn, aiohttp) sets TCP_NODELAY per connection anyway.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port, self.private_port = shared.getsockname()[1], private.getsockname()[1]
        fds = (shared.fileno(), private.fileno())
        cmd = [sys.executable, "-m", "bench.stack_choice", *child_args,
               "--fds", f"{fds[0]},{fds[1]}"]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.log = logdir / f"{name}.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=self._logf, stderr=subprocess.STDOUT)
        _CHILDREN.append(self)
        shared.close()
        private.close()
        self.pid = self.proc.pid
        self._wait_ready(ready_path)

    def _wait_ready(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}: {self.log_tail()}")
            try:
                st, _ = http_req(self.port, "GET", path, timeout=1.0)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self, n=1500):
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(8)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # SIGKILL to this pid only
                self.proc.wait(5)
        self._logf.close()
        if self in _CHILDREN:
            _CHILDREN.remove(self)


def stop_all():
    for c in list(_CHILDREN):
        try:
            c.stop()
        except Exception:
            pass


def http_req(port, method, path, body=None, timeout=5.0):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check_endpoints(child: Child, method: str) -> dict:
    """Both pre-bound sockets must serve both endpoints correctly."""
    out = {}
    body = REQ_BODY if method == "POST" else None
    for label, port in (("shared_reuseport", child.port), ("private", child.private_port)):
        try:
            sj, bj = http_req(port, method, "/json", body)
            ss, bs = http_req(port, method, "/stream", body)
            ok = (sj == 200 and json.loads(bj)["object"] == "chat.completion"
                  and ss == 200 and bs.count(b"data: ") == N_CHUNKS and bs.endswith(SSE_DONE))
            out[label] = {"ok": ok, "port": port}
        except Exception as e:  # noqa: BLE001
            out[label] = {"ok": False, "port": port, "error": repr(e)}
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out
