"""Run deploy/systemd's units under a real systemd and check what only systemd can show, on a
host where systemd is not PID 1 (a CI container, a VM without it):

    sudo .venv/bin/python deploy/systemd/check_user_manager.py     # ~1 min; exit 0 = all passed

It starts a root systemd *user* manager (`systemd --user`, the same code as PID 1 for units,
notify, watchdog, dependencies and RuntimeDirectory=) confined to its own cgroups and a private
mount namespace, loads the units into it, drives them with `systemctl --user` and stops it.
Exit 77 when the host cannot do this (not root, no systemd binary, no writable cgroups).

Differences from a real install, each forced by a user manager or by this kind of host:
- User=/Group= are dropped (a user manager cannot switch users); everything runs as root.
- ExecStart= points into this venv, EnvironmentFile= to a scratch file with free ports,
  /run/cacheroute-proxy becomes %t/cacheroute-proxy (the manager's runtime directory), and
  output goes to files (no journald).
- ProtectHome=read-only instead of yes when this venv's interpreter lives under /root or /home
  (pyenv): ProtectHome=yes would hide it (status 203/EXEC) -- see docs/INSTALL.md.
- PrivateTmp=no instead of yes when this checkout or its venv lives under /tmp (a CI clone):
  a private /tmp would hide the program (203/EXEC). The metrics directory is not in /tmp.
- In the manager's mount namespace: /run is made a mount point and the runtime directory a
  tmpfs (as on any systemd host; otherwise sandboxed units get an empty /run and
  RuntimeDirectory= is not removed), and /run/systemd/{system,inaccessible} exist. The host's
  own /run is not touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent  # the checkout, installed in editable mode: the units import from it
sys.path.insert(0, str(PROJECT))  # run as a script from the checkout: its helpers are importable
from cacheroute_sim.processes import free_port, free_port_range  # noqa: E402
VENV_BIN = Path(sys.executable).parent
SYSTEMD = "/lib/systemd/systemd"
CGROUP_ROOTS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]
UNITS = ("cacheroute-proxy.target", "cacheroute-proxy-runtime.service",
         "cacheroute-proxy-sidecar.service", "cacheroute-proxy-worker@.service")
WORKERS = (0, 1)
FAILING_INDEX = 7  # a worker whose private port is taken: exit 5, no restart


class Check:
    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, name: str, ok: bool, detail: object = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}  {name}{f'  ({detail})' if detail else ''}", flush=True)
        self.failed += not ok
        return ok


class UserManager:
    """`systemd --user` in its own cgroups and mount namespace, driven by `systemctl --user`."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.xdg = scratch / "xdg"
        self.name = scratch.name
        self.cgroups = [root / self.name for root in CGROUP_ROOTS[:2] if (root / "cgroup.procs").exists()] \
            or [CGROUP_ROOTS[2] / self.name]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.xdg.mkdir(mode=0o700)
        for cgroup in self.cgroups:
            cgroup.mkdir()
        setup = " && ".join([
            "mount --bind /run /run",
            f"mount -t tmpfs -o mode=700 tmpfs {self.xdg}",
            "mount -t tmpfs -o mode=755 tmpfs /run/systemd",
            "mkdir /run/systemd/system /run/systemd/inaccessible",
            "cd /run/systemd/inaccessible && mkdir dir && touch reg && mknod chr c 0 0 && mknod blk b 0 0"
            " && mkfifo fifo && chmod 0000 dir reg chr blk fifo && cd /",
            f"exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME={self.scratch} XDG_RUNTIME_DIR={self.xdg}"
            f" XDG_CONFIG_HOME={self.scratch / 'cfg'} {SYSTEMD} --user",
        ])
        with open(self.scratch / "manager.log", "wb") as log:
            self.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            preexec_fn=self._join_cgroups)
        if not wait_for(lambda: self.systemctl("is-system-running").stdout.strip() in ("running", "degraded"), 20):
            raise RuntimeError(f"systemd --user did not come up; see {self.scratch / 'manager.log'}")

    def _join_cgroups(self) -> None:
        for cgroup in self.cgroups:
            (cgroup / "cgroup.procs").write_text("0")

    def systemctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        assert self.process is not None
        return subprocess.run(["nsenter", "-t", str(self.process.pid), "-m", "env", f"XDG_RUNTIME_DIR={self.xdg}",
                               "systemctl", "--user", "--no-pager", *args],
                              capture_output=True, text=True, timeout=timeout)

    def prop(self, unit: str, name: str) -> str:
        return self.systemctl("show", "-p", name, "--value", unit).stdout.strip()

    def exists(self, path: str) -> bool:
        """A path as the manager (and its units) see it."""
        assert self.process is not None
        return subprocess.run(["nsenter", "-t", str(self.process.pid), "-m", "test", "-e", path]).returncode == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.systemctl("exit", timeout=30)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for cgroup in filter(Path.exists, self.cgroups):  # what is left in them, this manager started
            for procs in sorted(cgroup.rglob("cgroup.procs"), reverse=True):
                for pid in procs.read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.5)
            for directory in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                directory.rmdir()
            cgroup.rmdir()


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (OSError, subprocess.SubprocessError):
            pass
        time.sleep(interval_s)
    return False


def install_units(scratch: Path, env: dict[str, str]) -> None:
    unit_dir = scratch / "cfg" / "systemd" / "user"
    unit_dir.mkdir(parents=True)
    (scratch / "logs").mkdir()
    (scratch / "proxy.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    interpreter = os.path.realpath(sys.executable)
    for name in UNITS:
        text = (HERE / name).read_text()
        text = text.replace("/opt/cacheroute-proxy/venv/bin/", f"{VENV_BIN}/")
        text = text.replace("/etc/cacheroute-proxy/proxy.env", str(scratch / "proxy.env"))
        text = text.replace("/run/cacheroute-proxy", "%t/cacheroute-proxy")
        text = re.sub(r"^(User|Group)=.*\n", "", text, flags=re.M)
        text = text.replace("[Service]\n", f"[Service]\nStandardOutput=append:{scratch}/logs/%n.log\n"
                            "StandardError=inherit\n", 1)
        if interpreter.startswith(("/root/", "/home/")):
            text = text.replace("ProtectHome=yes", "ProtectHome=read-only")
        if any(path.startswith(("/tmp/", "/var/tmp/")) for path in (str(VENV_BIN), str(PROJECT))):
            text = text.replace("PrivateTmp=yes", "PrivateTmp=no")
        (unit_dir / name).write_text(text)


def http_ok(port: int, path: str = "/healthz") -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
        return response.status == 200


def run_checks(manager: UserManager, ports: dict[str, int], shm_name: str, check: Check) -> None:
    workers = [f"cacheroute-proxy-worker@{i}.service" for i in WORKERS]
    sidecar, runtime = "cacheroute-proxy-sidecar.service", "cacheroute-proxy-runtime.service"
    manager.systemctl("enable", sidecar, *workers)
    started = manager.systemctl("start", "cacheroute-proxy.target")
    check("start cacheroute-proxy.target", started.returncode == 0, started.stderr.strip())
    states = {u: manager.prop(u, "ActiveState") for u in (runtime, sidecar, *workers)}
    check("runtime, sidecar and workers active (Type=notify: READY=1 accepted)",
          all(s == "active" for s in states.values()), states)
    ready = int(manager.prop(sidecar, "ActiveEnterTimestampMonotonic") or 0)  # when READY=1 came
    order = [int(manager.prop(w, "ExecMainStartTimestampMonotonic") or 0) for w in workers]
    check("workers started after the sidecar said READY=1", all(ready < w for w in order), (ready, order))
    status = {u: manager.prop(u, "StatusText") for u in (sidecar, *workers)}
    check("STATUS= shown by systemd", status[sidecar].startswith("serving:")
          and all(status[w].startswith(f"worker {i}:") for i, w in zip(WORKERS, workers)), status)
    check("segment in /dev/shm", os.path.exists(f"/dev/shm{shm_name}"))
    check("workers answer on their private ports", all(http_ok(ports["private"] + i) for i in WORKERS))
    check("shared metrics directory (RuntimeDirectory=)", http_ok(ports["private"], "/metrics")
          and manager.exists(f"{manager.xdg}/cacheroute-proxy/metrics"))

    worker_pids = [manager.prop(w, "MainPID") for w in workers]
    restarted = manager.systemctl("restart", sidecar)
    check("sidecar restart leaves the workers running",
          restarted.returncode == 0 and [manager.prop(w, "MainPID") for w in workers] == worker_pids,
          worker_pids)
    check("restarted sidecar adopted the segment (epoch 2)",
          wait_for(lambda: "epoch 2" in manager.prop(sidecar, "StatusText"), 15), manager.prop(sidecar, "StatusText"))

    old = manager.prop(workers[0], "MainPID")
    restarted = manager.systemctl("restart", workers[0])
    check("worker restart: a new process, READY before `restart` returns",
          restarted.returncode == 0 and manager.prop(workers[0], "MainPID") != old
          and http_ok(ports["private"] + WORKERS[0]))

    victim = int(manager.prop(workers[1], "MainPID"))
    os.kill(victim, signal.SIGSTOP)  # a loop that stops pinging: WatchdogSec=15 must restart it
    replaced = wait_for(lambda: manager.prop(workers[1], "MainPID") not in ("0", str(victim))
                        and manager.prop(workers[1], "ActiveState") == "active", 60, 1.0)
    check("watchdog restarts a stopped worker", replaced, f"NRestarts={manager.prop(workers[1], 'NRestarts')}")

    with socket.socket() as blocker:  # its private port taken: the worker cannot start at all
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", ports["private"] + FAILING_INDEX))
        blocker.listen()
        failing = f"cacheroute-proxy-worker@{FAILING_INDEX}.service"
        manager.systemctl("start", failing)
        time.sleep(3)
        check("exit 5 (its private address taken) is not restarted (RestartPreventExitStatus=2 4 5)",
              manager.prop(failing, "ExecMainStatus") == "5" and manager.prop(failing, "NRestarts") == "0",
              f"status={manager.prop(failing, 'ExecMainStatus')} restarts={manager.prop(failing, 'NRestarts')}")
        manager.systemctl("reset-failed", failing)

    stopped = manager.systemctl("stop", runtime)
    states = {u: manager.prop(u, "ActiveState") for u in (runtime, sidecar, *workers)}
    check("stopping the runtime unit stops everything and waits", stopped.returncode == 0
          and all(s in ("inactive", "failed") for s in states.values()), states)
    check("segment unlinked by ExecStop=", not os.path.exists(f"/dev/shm{shm_name}"))
    check("runtime directory removed", not manager.exists(f"{manager.xdg}/cacheroute-proxy"))


def main() -> int:
    if os.geteuid() != 0 or not os.path.exists(SYSTEMD) or not all(map(shutil.which, ("unshare", "nsenter"))):
        print("SKIP  needs root, systemd, unshare and nsenter")
        return 77
    ports = {"dp": free_port(), "cp": free_port(), "private": free_port_range(FAILING_INDEX + 1)}
    shm_name = f"/cacheroute_sdcheck_{os.getpid()}"
    env = {"PROXY_DP_PORT": ports["dp"], "PROXY_CP_PORT": ports["cp"], "PROXY_SHM_NAME": shm_name,
           "PROXY_WORKER_PRIVATE_PORT_BASE": ports["private"], "PROXY_SHM_WORKER_CAPACITY": 16,
           "PROXY_SHM_INSTANCE_CAPACITY": 32}
    scratch = Path(tempfile.mkdtemp(prefix="cacheroute-sdcheck-", dir="/run"))  # not /tmp: PrivateTmp=
    manager = UserManager(scratch)
    check = Check()
    try:
        install_units(scratch, {k: str(v) for k, v in env.items()})
        try:
            manager.start()
        except OSError as exc:
            print(f"SKIP  cannot confine a systemd user manager here: {exc}")
            return 77
        except RuntimeError as exc:
            check("systemd --user started", False, exc)
        else:
            run_checks(manager, ports, shm_name, check)
    finally:
        manager.stop()
        if os.path.exists(f"/dev/shm{shm_name}"):
            os.unlink(f"/dev/shm{shm_name}")
        if check.failed:
            print(f"logs kept in {scratch}/logs")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'FAILED' if check.failed else 'ALL PASSED'}: {check.failed} check(s) failed")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
