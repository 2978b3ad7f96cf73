"""systemd deployment: the units in deploy/systemd pass `systemd-analyze verify`, and a real
sidecar and worker (`cacheroute-proxy sidecar` / `worker --index 0`) speak the sd_notify
protocol to a real AF_UNIX datagram listener standing in for systemd: READY=1 only once they
serve, STATUS= lines, WATCHDOG=1 pings, STOPPING=1 on SIGTERM and a clean exit 0.

systemd is not PID 1 here, so `systemctl start` itself is not exercised (docs/INSTALL.md).
"""

from __future__ import annotations

import configparser
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from cacheroute_proxy import exits, systemd
from cacheroute_proxy.config import Settings
from shm_schema import Segment
from tests.harness import ROOT, Process, SimInstance, chat_body, get, private_segment_name, wait_until
from cacheroute_sim.processes import SupervisorPorts

UNITS_DIR = ROOT / "deploy" / "systemd"
UNIT_FILES = ("cacheroute-proxy.target", "cacheroute-proxy-runtime.service",
              "cacheroute-proxy-sidecar.service", "cacheroute-proxy-worker@.service",
              "cacheroute-instance-agent@.service")
INSTALLED_BIN = "/opt/cacheroute-proxy/venv/bin/"
VENV_BIN = Path(sys.executable).parent
ENTRY_POINT = VENV_BIN / "cacheroute-proxy"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                   reason="systemd-analyze not installed (.ci/run installs it)")


# --- the unit files ----------------------------------------------------------------------------
def _copy_units(target: Path) -> Path:
    """The units as installed, but with ExecStart= pointing into this venv (verify checks that
    the binaries exist), plus one instance of the worker template."""
    target.mkdir()
    for name in UNIT_FILES:
        text = (UNITS_DIR / name).read_text().replace(INSTALLED_BIN, f"{VENV_BIN}/")
        (target / name).write_text(text)
    shutil.copy(target / "cacheroute-proxy-worker@.service", target / "cacheroute-proxy-worker@0.service")
    shutil.copy(target / "cacheroute-instance-agent@.service", target / "cacheroute-instance-agent@vllm-a.service")
    return target


def _verify(units: Path) -> list[str]:
    """Problems `systemd-analyze verify` reports for our units (it exits 0 for unknown keys
    and bad values and only prints them, so the output counts, not just the return code)."""
    names = [*UNIT_FILES, "cacheroute-proxy-worker@0.service", "cacheroute-instance-agent@vllm-a.service"]
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", *(str(units / n) for n in names)],
                          capture_output=True, text=True, timeout=60, cwd=units)
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if "cacheroute" in line or str(units) in line]
    if done.returncode != 0:
        problems.append(f"exit {done.returncode}: {done.stdout}{done.stderr}")
    return problems


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    assert ENTRY_POINT.exists(), f"{ENTRY_POINT} missing: run `make install`"
    assert _verify(_copy_units(tmp_path / "units")) == []


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: a misspelt key, a bad value and a missing binary are reported."""
    units = _copy_units(tmp_path / "units")
    worker = units / "cacheroute-proxy-worker@0.service"
    worker.write_text(worker.read_text().replace("ProtectHome=yes", "ProtectHomme=yes")
                      .replace("WatchdogSec=15", "WatchdogSec=fifteen"))
    sidecar = units / "cacheroute-proxy-sidecar.service"
    sidecar.write_text(sidecar.read_text().replace(f"{VENV_BIN}/cacheroute-proxy", "/nonexistent/cacheroute-proxy"))
    problems = "\n".join(_verify(units))
    assert "ProtectHomme" in problems and "fifteen" in problems and "/nonexistent" in problems, problems


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # keys are case-sensitive
    parser.read_string(_joined_repeats((UNITS_DIR / name).read_text()))
    return parser


def _joined_repeats(text: str) -> str:
    """systemd allows a key several times (Environment=); configparser keeps the last: join them."""
    seen: dict[tuple[str, str], int] = {}
    out, section = [], ""
    for line in text.splitlines():
        match = re.match(r"^(\w+)=(.*)$", line)
        if line.startswith("["):
            section = line
        elif match:
            key = (section, match.group(1))
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                line = f"{match.group(1)}#{seen[key]}={match.group(2)}"
        out.append(line)
    return "\n".join(out)


def test_units_fit_together():
    """What verify cannot know: the names the units refer to exist, the roles notify, the stop
    timeout covers the drain, and the metrics directory is the runtime unit's."""
    units = {name: _unit(name) for name in UNIT_FILES}
    for name, unit in units.items():
        for section, key in (("Unit", "Wants"), ("Unit", "Requires"), ("Unit", "After"),
                             ("Unit", "PartOf"), ("Install", "WantedBy")):
            for ref in unit.get(section, key, fallback="").split():
                if ref.startswith("cacheroute-proxy"):
                    assert ref in units, f"{name}: {key}={ref} names no unit in deploy/systemd"
    runtime = units["cacheroute-proxy-runtime.service"]["Service"]
    assert "cacheroute-proxy/metrics" in runtime["RuntimeDirectory"].split()
    assert "cacheroute_proxy shm unlink" in runtime["ExecStop"] and runtime["RemoveIPC"] == "no"
    for role in ("sidecar", "worker@"):
        service = units[f"cacheroute-proxy-{role}.service"]["Service"]
        assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
        assert service["Restart"] == "on-failure"
        assert service["RemoveIPC"] == "no" and int(service["WatchdogSec"]) >= 4
        assert service["EnvironmentFile"] == "-/etc/cacheroute-proxy/proxy.env"
        assert units[f"cacheroute-proxy-{role}.service"]["Unit"]["PartOf"] == "cacheroute-proxy.target"
    # exit statuses that mean "cannot start at all" (cacheroute_proxy/exits.py) are not restarted
    assert units["cacheroute-proxy-sidecar.service"]["Service"]["RestartPreventExitStatus"].split() == \
        [str(exits.CANNOT_START), str(exits.CONTROL_ADDRESS_IN_USE)]
    assert units["cacheroute-proxy-worker@.service"]["Service"]["RestartPreventExitStatus"].split() == \
        [str(exits.CANNOT_START), str(exits.SERVICE_ADDRESS_IN_USE), str(exits.PRIVATE_ADDRESS_IN_USE)]
    worker = units["cacheroute-proxy-worker@.service"]
    assert worker["Service"]["ExecStart"].endswith("cacheroute-proxy worker --index %i")
    # SIGKILL must not come while a worker still drains (its deadline, then 2 s to flush the cuts).
    assert int(worker["Service"]["TimeoutStopSec"]) >= Settings().drain_timeout_s + 10
    # Workers keep serving through a sidecar restart: ordered after it, but not bound to it.
    assert "cacheroute-proxy-sidecar.service" in worker["Unit"]["Wants"]
    assert "cacheroute-proxy-sidecar.service" in worker["Unit"]["After"]
    assert "cacheroute-proxy-sidecar.service" not in worker["Unit"].get("Requires", "")
    assert "BindsTo" not in worker["Unit"]
    metrics_dir = next(v.split("=", 1)[1] for k, v in worker["Service"].items()
                       if k.startswith("Environment") and k != "EnvironmentFile" and v.startswith("PROXY_METRICS_DIR="))
    assert metrics_dir == "/run/cacheroute-proxy/metrics" == worker["Service"]["ReadWritePaths"]


@pytest.mark.timeout(420)
@pytest.mark.skipif(os.environ.get("CACHEROUTE_SYSTEMD_USER_MANAGER") != "1",
                    reason="opt-in (CACHEROUTE_SYSTEMD_USER_MANAGER=1): starts a real systemd user manager "
                           "as root in its own cgroups and mount namespace")
def test_units_under_a_real_systemd_user_manager():
    """deploy/systemd/check_user_manager.py: start, notify, order, restarts, watchdog, exit 5, stop."""
    done = subprocess.run([sys.executable, str(UNITS_DIR / "check_user_manager.py")],
                          capture_output=True, text=True, timeout=400)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "FAIL" not in done.stdout, done.stdout + done.stderr


def test_sidecar_with_its_port_taken_exits_6():
    """Exit 6 = its control-plane address is taken: cannot start, which the unit does not
    restart (RestartPreventExitStatus=2 6)."""
    shm_name = private_segment_name()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**os.environ, "PROXY_CP_PORT": str(taken.getsockname()[1]), "PROXY_SHM_NAME": shm_name}
        done = subprocess.run([str(ENTRY_POINT), "sidecar"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 6, done.stderr
    assert f"cannot bind the control plane (PROXY_CP_HOST/PORT) on 127.0.0.1:{env['PROXY_CP_PORT']}: " \
           "another process listens there" in done.stderr and "Traceback" not in done.stderr
    assert not os.path.exists(f"/dev/shm{shm_name}")  # it gave up before creating the segment


# --- sd_notify, unit level ---------------------------------------------------------------------
def test_notify_is_a_no_op_without_notify_socket():
    notifier = systemd.Notifier(environ={})
    assert not notifier.enabled and notifier.send(READY=1) is False
    for unsupported in ("", "relative/path", "vsock:2:1234", "@"):
        assert not systemd.Notifier({"NOTIFY_SOCKET": unsupported}).enabled, unsupported


def test_notify_to_an_abstract_socket():
    name = f"cacheroute-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(10)
        notifier = systemd.Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.send(READY=1, STATUS="two\nlines") is True
        # A newline would start a new field, so it must not reach systemd inside a value.
        assert listener.recv(4096) == b"READY=1\nSTATUS=two lines"
        assert notifier.send(WATCHDOG=1) and listener.recv(4096) == b"WATCHDOG=1"
        notifier.close()


def test_notify_to_a_missing_socket_fails_quietly(tmp_path):
    notifier = systemd.Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert notifier.enabled and notifier.send(READY=1) is False


def test_watchdog_interval():
    pid = os.getpid()
    assert systemd.watchdog_interval_s({}) is None
    assert systemd.watchdog_interval_s({"WATCHDOG_USEC": "15000000"}) == 7.5
    assert systemd.watchdog_interval_s({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": str(pid)}, pid) == 7.5
    # Meant for another process (a parent that set it before exec'ing a child): not ours.
    assert systemd.watchdog_interval_s({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": str(pid + 1)}, pid) is None
    assert systemd.watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert systemd.watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


# --- sd_notify, real processes -----------------------------------------------------------------
class FakeSystemd:
    """An AF_UNIX datagram socket where systemd's would be. Records each message with the
    sender's pid (SO_PASSCRED, as systemd checks NotifyAccess=main) and, on READY=1, probes
    the service at once: READY must not come before it serves."""

    def __init__(self, path: Path, probe_url: str) -> None:
        self.path = str(path)
        self.probe_url = probe_url
        self.messages: list[tuple[int, dict[str, str]]] = []
        self.probe_at_ready: Any = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._open = True
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        creds_size = socket.CMSG_SPACE(struct.calcsize("3i"))
        while self._open:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, creds_size)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            pid = next((struct.unpack("3i", d[:12])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1)
            fields = dict(line.split("=", 1) for line in data.decode().split("\n"))
            if "READY" in fields and self.probe_at_ready is None:
                self.probe_at_ready = self._probe()
            self.messages.append((pid, fields))

    def _probe(self) -> Any:
        try:
            return get(self.probe_url, timeout=5)
        except (OSError, AssertionError) as exc:
            return exc

    def values(self, key: str) -> list[str]:
        return [fields[key] for _, fields in list(self.messages) if key in fields]

    def senders(self) -> set[int]:
        return {pid for pid, _ in list(self.messages)}

    def close(self) -> None:
        self._open = False
        self._thread.join(5)
        self._sock.close()


def _role(argv: list[str], env: dict[str, str], systemd: FakeSystemd, log: Path) -> Process:
    # The console entry point, as ExecStart= runs it (ChildProcess adds the interpreter).
    return Process([str(ENTRY_POINT), *argv], {**env, "NOTIFY_SOCKET": systemd.path,
                                               "WATCHDOG_USEC": "1000000"}, log)


def _open_stream(port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat_body()),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read1(65536)  # the first chunk: the instance holds the rest
    return conn, response


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sidecar_and_worker_notify_systemd(tmp_path):
    ports = SupervisorPorts(1, "cacheroute_test")
    env = {**ports.supervisor_env("round_robin"), "PROXY_METRICS_DIR": str(tmp_path / "metrics")}
    side_sd = FakeSystemd(tmp_path / "sidecar.sock", f"{ports.cp_url}/healthz")
    work_sd = FakeSystemd(tmp_path / "worker.sock", f"{ports.worker_url(0)}/healthz")
    started: list[Process] = []
    try:
        sidecar = _role(["sidecar"], env, side_sd, tmp_path / "sidecar.log")
        started.append(sidecar)
        wait_until(lambda: side_sd.values("READY"), 30, message=f"sidecar READY=1\n{sidecar.tail()}")
        probe = side_sd.probe_at_ready  # the control plane answered the moment READY=1 came
        assert isinstance(probe, dict) and probe.get("ok") is True, probe
        worker = _role(["worker", "--index", "0"], env, work_sd, tmp_path / "worker.log")
        started.append(worker)
        wait_until(lambda: work_sd.values("READY"), 30, message=f"worker READY=1\n{worker.tail()}")
        # Attached to the segment and holding a row when READY came, not just listening.
        probe = work_sd.probe_at_ready
        assert isinstance(probe, dict) and probe.get("ok") is True and probe["row"] >= 0, probe

        instance = SimInstance(ports.cp_url, tmp_path, "--time-scale", "0.05", "--hold-streams")
        started.append(instance.process)
        wait_until(lambda: "1 of 1 instances alive" in " ".join(side_sd.values("STATUS")), 30,
                   message=f"sidecar STATUS refreshed: {side_sd.values('STATUS')}")
        assert any(re.fullmatch(r"serving: 1 of 1 instances alive, 1 workers, epoch 1", line)
                   for line in side_sd.values("STATUS")), side_sd.values("STATUS")
        # Pings every WATCHDOG_USEC/2, from the main process (NotifyAccess=main).
        wait_until(lambda: len(work_sd.values("WATCHDOG")) >= 4 and len(side_sd.values("WATCHDOG")) >= 4, 30,
                   message="watchdog pings")
        assert side_sd.senders() == {sidecar.pid} and work_sd.senders() == {worker.pid}
        assert get(f"{ports.worker_url(0)}/metrics", timeout=10)

        conn, response = _open_stream(ports.private_base)  # held by the instance: in flight
        wait_until(lambda: "worker 0: 1 requests in flight" in work_sd.values("STATUS"), 30,
                   message=f"worker STATUS with the stream: {work_sd.values('STATUS')}")
        worker.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: work_sd.values("STOPPING"), 30, message="worker STOPPING=1")
        stopping = next(fields for _, fields in work_sd.messages if "STOPPING" in fields)
        assert stopping["STATUS"].startswith("draining: 1 requests"), stopping
        pings = len(work_sd.values("WATCHDOG"))
        wait_until(lambda: len(work_sd.values("WATCHDOG")) > pings, 30, message="pings while draining")
        instance.release()
        body = response.read()
        conn.close()
        assert b"data: [DONE]" in body  # the stream that was in flight finished during the drain
        assert worker.popen.wait(60) == 0, worker.tail()
        # The stream's counters went where PROXY_METRICS_DIR says (the systemd layout). Every
        # series is labelled by instance, so the files appear with the first request.
        assert list((tmp_path / "metrics").glob("*.db")), "no worker metrics file"

        sidecar.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: side_sd.values("STOPPING"), 30, message="sidecar STOPPING=1")
        assert sidecar.popen.wait(30) == 0, sidecar.tail()
        assert work_sd.values("READY") == ["1"] and side_sd.values("READY") == ["1"]
    finally:
        for process in reversed(started):
            process.stop(signal.SIGTERM, timeout=30)
        side_sd.close()
        work_sd.close()
        Segment.unlink(ports.shm_name)  # under systemd: cacheroute-proxy-runtime.service's ExecStop
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")
