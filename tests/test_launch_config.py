"""How the proxy is launched: `make run-workers` passes N/STRATEGY/SIM only when they are given on
make's command line (the environment decides otherwise); `cacheroute-proxy run` and the demo take
the original's flags, and refuse a bad value naming the flag; a taken address stops the launch at
once, naming it; a note about the host is said once, not by every worker at every start."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from cacheroute_sim.processes import free_port_range
from tests.harness import ROOT, Process, SupervisorPorts, get, wait_until

pytestmark = pytest.mark.timeout(180)


# --- make run-workers -------------------------------------------------------------------------
def _demo_command(*make_args: str, env: dict[str, str]) -> list[str]:
    """The demo's command line as `make -n run-workers` prints it (the line that runs the demo)."""
    done = subprocess.run(["make", "--no-print-directory", "-n", "run-workers", *make_args], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "-m cacheroute_sim.demo" in line]
    assert len(lines) == 1, done.stdout
    return shlex.split(lines[0])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_workers_leaves_the_environment_alone_unless_told_on_its_command_line() -> None:
    # The environment says least_load and 3 workers; variables named like make's (N, STRATEGY,
    # SIM) that merely sit in the environment are no command-line choice either.
    env = {"PROXY_INSTANCE_STRATEGY": "least_load", "PROXY_WORKERS": "3", "PROXY_SIM_INSTANCES": "0",
           "N": "7", "STRATEGY": "round_robin", "SIM": "5"}
    argv = _demo_command(env=env)
    assert argv[-2:] == ["-m", "cacheroute_sim.demo"], argv  # no --workers, --strategy, --sim-instances
    argv = _demo_command("N=4", "STRATEGY=rr", "SIM=0", env=env)
    flags = argv[argv.index("cacheroute_sim.demo") + 1:]
    assert flags == ["--workers", "4", "--strategy", "rr", "--sim-instances", "0"], argv


# --- flags ------------------------------------------------------------------------------------
LAUNCHERS = {"run": ["-m", "cacheroute_proxy", "run"], "demo": ["-m", "cacheroute_sim.demo"]}
BAD_FLAGS = [
    (["--injection-strategy", "fastest"], "argument --injection-strategy: invalid choice: 'fastest'"),
    (["--ready-release-policy", "random"], "argument --ready-release-policy: invalid choice: 'random'"),
    (["--kdn-links-json", "{not json"], "argument --kdn-links-json: not valid JSON"),
    (["--kdn-links-json", "[1, 2]"], "argument --kdn-links-json: must be a JSON object"),
    (["--kdn-links-json", '{"kdn://10.0.0.9:9100": {"bandwidth_mbps": 0}}'],
     "--kdn-links-json (PROXY_KDN_LINKS_JSON): kdn://10.0.0.9:9100: bandwidth_mbps must be a number > 0"),
    (["--strategy", "fastest"], "--strategy (PROXY_INSTANCE_STRATEGY): unknown strategy 'fastest'"),
    (["--workers", "0"], "--workers (PROXY_WORKERS): must be between 1 and 256"),
    (["--port", "70000"], "--port (PROXY_DP_PORT): must be a TCP port"),
]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_naming_it(launcher: str, flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, *LAUNCHERS[launcher], *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PROXY_SHM_NAME": "/cacheroute_test_never"})
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not os.path.exists("/dev/shm/cacheroute_test_never")


def _start_demo(tmp_path: Path, name: str, env: dict[str, str], *flags: str) -> Process:
    return Process(["-m", "cacheroute_sim.demo", *flags], {**env, "PROXY_SIM_INSTANCES": "0"},
                   tmp_path / f"{name}.log")


def _stop_demo(demo: Process, ports: SupervisorPorts) -> None:
    code = demo.stop(signal.SIGINT, timeout=60)
    assert code == 0, demo.tail()
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")


def test_the_demo_honours_the_environment_and_its_flags_override_it(tmp_path: Path) -> None:
    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    env = {**ports.supervisor_env("least_load"), "PROXY_INJECTION_STRATEGY": "iws"}
    demo = _start_demo(tmp_path, "env", env)  # no flag: the environment decides
    try:
        wait_until(lambda: all(get(f"{ports.worker_url(i)}/healthz", timeout=1)["ok"] for i in (0, 1)), 40,
                   message=f"both workers up\n{demo.tail()}")
        assert get(f"{ports.worker_url(0)}/debug/instance_loads")["strategy"] == "least_load"
        chosen = get(f"{ports.cp_url}/debug/status")["settings"]
        assert chosen == {"dp": f"127.0.0.1:{ports.dp_port}", "workers": 2, "strategy": "least_load",
                          "load_view": "shared", "injection_strategy": "iws",
                          "ready_release_policy": "ordered", "static_kdn_links": []}, chosen
    finally:
        _stop_demo(demo, ports)

    links = {"kdn://10.0.0.9:9100": {"bandwidth_mbps": 400, "rtt_ms": 2}}
    ui = f"127.0.0.1:{free_port_range(1)}"
    flags = ["--strategy", "rr", "--workers", "1", "--host", "127.0.0.1", "--injection-strategy", "default",
             "--ready-release-policy", "text_bypass", "--kdn-links-json", json.dumps(links),
             "--proxy-ui-listen", ui]
    demo = _start_demo(tmp_path, "flags", env, *flags)  # the same environment, overridden
    try:
        wait_until(lambda: get(f"{ports.worker_url(0)}/healthz", timeout=1)["ok"], 40,
                   message=f"worker 0 up\n{demo.tail()}")
        assert get(f"{ports.worker_url(0)}/debug/instance_loads")["strategy"] == "round_robin"
        chosen = get(f"{ports.cp_url}/debug/status")["settings"]
        assert chosen == {"dp": f"127.0.0.1:{ports.dp_port}", "workers": 1, "strategy": "round_robin",
                          "load_view": "shared", "injection_strategy": "default",
                          "ready_release_policy": "text_bypass",
                          "static_kdn_links": ["kdn://10.0.0.9:9100"]}, chosen
        assert len(get(f"{ports.cp_url}/debug/workers")["workers"]) == 1
        with urllib.request.urlopen(f"http://{ui}/dashboard", timeout=10) as page:  # the flag's listener
            assert page.status == 200 and b"<html" in page.read()
    finally:
        _stop_demo(demo, ports)


@pytest.mark.parametrize(("argv", "env", "listen"), [
    ([], {}, "127.0.0.1:8202"),                                  # the original demo's UI address
    ([], {"PROXY_UI_LISTEN": ""}, None),                         # the environment decides: none
    ([], {"PROXY_UI_LISTEN": "127.0.0.1:9999"}, None),           # ... or its own (read by Settings)
    (["--proxy-ui-listen", "127.0.0.1:9998"], {}, "127.0.0.1:9998"),
    (["--no-proxy-ui"], {}, ""),
])
def test_the_demo_serves_its_dashboard_where_the_original_did_unless_told(
        argv: list[str], env: dict[str, str], listen: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from cacheroute_sim import demo

    monkeypatch.delenv("PROXY_UI_LISTEN", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert demo.with_demo_dashboard(demo.build_parser().parse_args(argv)).ui_listen == listen


# --- a taken address --------------------------------------------------------------------------
def _processes_of(shm_name: str) -> list[psutil.Process]:
    """Every process still running with this segment name in its environment (ours are the only ones)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PROXY_SHM_NAME") == shm_name and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _listening_socket() -> socket.socket:
    """Someone else's listener on 127.0.0.1 (no SO_REUSEPORT: nobody may share it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", free_port_range(1)))
    sock.listen()
    return sock


def test_a_taken_service_port_stops_the_launch_within_2s_naming_it(tmp_path: Path) -> None:
    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        env = {**ports.supervisor_env("round_robin"), "PROXY_DP_PORT": str(port)}
        started = time.monotonic()
        launcher = Process(["-m", "cacheroute_proxy", "run"], env, tmp_path / "launcher.log")
        try:
            code = launcher.popen.wait(timeout=2.0)
        finally:
            elapsed = time.monotonic() - started
            launcher.stop()
    log = launcher.log()
    assert code == 1 and elapsed < 2.0, (code, elapsed, log)
    assert f"cannot bind the service address (PROXY_DP_HOST/PORT) on 127.0.0.1:{port}: another process " \
           "listens there; stopping (nothing was started)" in log, log
    assert " serving " not in log and "started sidecar" not in log and "Traceback" not in log, log
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")
    assert not _processes_of(ports.shm_name)


def test_a_service_port_taken_after_the_check_stops_the_launch_when_the_workers_fail(tmp_path: Path) -> None:
    """The port is free when `run` checks it and taken before the workers bind it (they start
    only once the sidecar answers, which takes far longer than this test's bind): the workers
    exit 4, and the supervisor stops everything at once, naming the address -- without waiting
    out its readiness deadline (20 s)."""
    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    launcher = Process(["-m", "cacheroute_proxy", "run"], ports.supervisor_env("round_robin"),
                       tmp_path / "launcher.log")
    taken = socket.socket()
    try:
        wait_until(lambda: "started sidecar" in launcher.log(), 20, interval=0.005, message="sidecar started")
        taken.bind(("127.0.0.1", ports.dp_port))  # before any worker exists: the sidecar is not up yet
        taken.listen()
        assert "started worker" not in launcher.log()
        code = launcher.popen.wait(timeout=15)  # the workers' start, their exit and the stop: seconds
    finally:
        launcher.stop()
        taken.close()
    log = launcher.log()
    assert code == 1, log
    assert f"cannot bind the service address (PROXY_DP_HOST/PORT) on 127.0.0.1:{ports.dp_port}" in log, log
    assert re.search(rf"worker\d cannot start \(exit 4, the service address 127\.0\.0\.1:{ports.dp_port} "
                     r"is taken\); stopping", log), log
    assert " serving " not in log and "Traceback" not in log and "all stopped" in log, log
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")
    assert not _processes_of(ports.shm_name)


def _exit_of(argv: list[str], env: dict[str, str], log_path: Path) -> tuple[int, str]:
    """Run a process that should stop by itself (within 30 s): its exit status and its log."""
    process = Process(argv, env, log_path)
    try:
        code = process.popen.wait(timeout=30)
    finally:
        process.stop()
    return code, process.log()


def test_a_worker_whose_service_port_is_taken_exits_4_naming_it_before_saying_it_serves(tmp_path: Path) -> None:
    """The worker alone (as under systemd): it binds the service address before anything else,
    and never claims to serve an address it could not bind."""
    ports = SupervisorPorts(workers=1, shm_prefix="cacheroute_test")
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        env = {**ports.supervisor_env("round_robin"), "PROXY_DP_PORT": str(port)}
        # immediate: no segment is waited for (none exists)
        code, log = _exit_of(["-m", "proxy_workers", "--index", "0"], env, tmp_path / "worker.log")
    assert code == 4, (code, log)
    assert f"cannot bind the service address (PROXY_DP_HOST/PORT) on 127.0.0.1:{port}" in log, log
    assert "serving" not in log and "Traceback" not in log, log
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")


# --- the sysctl check, once -----------------------------------------------------------------------
MIGRATE_NOTE = "net.ipv4.tcp_migrate_req is 0"


def test_the_tcp_migrate_req_note_is_a_debug_line_not_a_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Said at every start of a host that has not installed the sysctl file (a laptop running the
    demo): once, at debug level, not a warning an operator must read each time."""
    from cacheroute_proxy import sysctl_check
    setting = tmp_path / "tcp_migrate_req"
    setting.write_text("0\n")
    with caplog.at_level(logging.DEBUG, logger="cacheroute.host"):
        sysctl_check.note_about_sysctls(str(setting))
    assert [(r.levelno, r.getMessage()[:len(MIGRATE_NOTE)]) for r in caplog.records] == [(logging.DEBUG, MIGRATE_NOTE)]
    caplog.clear()
    setting.write_text("1\n")
    sysctl_check.note_about_sysctls(str(setting))
    assert not caplog.records


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None,
                    reason="needs unshare and ip (a private network namespace)")
def test_a_host_note_is_said_once_not_by_each_worker_nor_at_a_restart(tmp_path: Path) -> None:
    """In a private network namespace whose tcp_migrate_req is 0 (the host's is left alone), so
    the note is due whatever the host says: 3 workers, one of them killed and restarted; at
    debug level, where it is said."""
    if os.geteuid() != 0:
        pytest.skip("unshare --net needs root here")
    ports = SupervisorPorts(workers=3, shm_prefix="cacheroute_test")
    script = ("ip link set lo up && sysctl -qw net.ipv4.tcp_migrate_req=0 && exec "
              + shlex.join([sys.executable, "-m", "cacheroute_proxy", "run"]))
    launcher = Process(["--net", "--", "sh", "-c", script],
                       {**ports.supervisor_env("round_robin"), "PROXY_LOG_LEVEL": "debug"},
                       tmp_path / "launcher.log", program="unshare")
    try:
        wait_until(lambda: "ready: 3 workers" in launcher.log(), 40, message=f"ready\n{launcher.tail()}")
        workers = [p for p in psutil.Process(launcher.pid).children() if "proxy_workers" in " ".join(p.cmdline())]
        assert len(workers) == 3, workers
        workers[1].kill()
        wait_until(lambda: launcher.log().count("serving 127.0.0.1") == 4, 30,
                   message=f"the killed worker serves again\n{launcher.tail()}")
        log = launcher.log()
    finally:
        code = launcher.stop(signal.SIGINT, timeout=60)
    assert code == 0, launcher.tail()
    assert log.count(MIGRATE_NOTE) == 1, log
    note = next(line for line in log.splitlines() if MIGRATE_NOTE in line)
    assert " sidecar[" in note and "DEBUG cacheroute.host:" in note, note
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")


# --- the metrics directory ---------------------------------------------------------------------
def test_a_metrics_directory_that_cannot_be_made_stops_the_launch_naming_it(tmp_path: Path) -> None:
    ports = SupervisorPorts(workers=1, shm_prefix="cacheroute_test")
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    env = {**ports.supervisor_env("round_robin"), "PROXY_METRICS_DIR": str(in_the_way)}
    code, log = _exit_of(["-m", "cacheroute_proxy", "run"], env, tmp_path / "launcher.log")
    assert code == 1, (code, log)
    assert f"cannot prepare the metrics directory {in_the_way} (PROXY_METRICS_DIR)" in log, log
    assert "Traceback" not in log and in_the_way.read_text() == "not a directory", log
    assert not os.path.exists(f"/dev/shm{ports.shm_name}") and not _processes_of(ports.shm_name)


def test_a_worker_whose_metrics_file_cannot_be_opened_exits_2_naming_the_directory(tmp_path: Path) -> None:
    """The worker alone (as under systemd), its segment there: it gives its row back."""
    from shm_schema import Segment, read_rows
    ports = SupervisorPorts(workers=1, shm_prefix="cacheroute_test")
    seg = Segment.create_or_attach(ports.shm_name, 8, 2, 64)
    try:
        unusable = tmp_path / "a-file" / "metrics"
        (tmp_path / "a-file").write_text("not a directory")
        env = {**ports.supervisor_env("round_robin"), "PROXY_METRICS_DIR": str(unusable)}
        code, log = _exit_of(["-m", "proxy_workers", "--index", "0"], env, tmp_path / "worker.log")
        assert code == 2, (code, log)
        assert f"cannot open this worker's metrics file in {unusable} (PROXY_METRICS_DIR)" in log, log
        assert "Traceback" not in log and " serving " not in log, log
        assert not [row for row in read_rows(seg) if row.identity], "the worker's row was not given back"
    finally:
        seg.close()
        Segment.unlink(ports.shm_name)
