"""A segment the service must not use: clear message at start, no traceback, no crash loop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shm_schema import Segment, layout
from tests.harness import ROOT, Process, free_port, free_port_range, private_segment_name


@pytest.fixture
def shm_name():
    name = private_segment_name()
    yield name
    Segment.unlink(name)


def _run(argv: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def _env(name: str) -> dict[str, str]:
    return {"PROXY_SHM_NAME": name, "PROXY_CP_PORT": str(free_port()),
            "PROXY_DP_PORT": str(free_port()), "PROXY_WORKER_PRIVATE_PORT_BASE": str(free_port_range(2)),
            "PROXY_WORKERS": "2"}


def test_segment_of_another_user(shm_name):
    seg = Segment.create_or_attach(shm_name, 8, 2, 64)
    seg.close()
    os.chown(f"/dev/shm{shm_name}", 65534, 65534)  # now it belongs to "nobody", mode 0600
    # Root would bypass file permissions: drop every capability so the check is real.
    drop = [shutil.which("setpriv") or "setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable]
    for role in (["-m", "sidecar"], ["-m", "proxy_workers", "--index", "0"]):
        done = _run([*drop, *role], _env(shm_name))
        assert done.returncode == 2, done.stderr
        assert "belongs to another user" in done.stderr and "Traceback" not in done.stderr


def test_full_dev_shm(shm_name):
    script = ("mount -t tmpfs -o size=64k tmpfs /dev/shm && "
              f"exec {sys.executable} -m sidecar")
    done = _run(["unshare", "--mount", "sh", "-c", script], _env(shm_name))
    assert done.returncode == 2, done.stderr
    assert "/dev/shm has no room" in done.stderr and "Traceback" not in done.stderr


def test_stale_layout_stops_the_supervisor_with_the_message(shm_name, tmp_path):
    seg = Segment.create_or_attach(shm_name, 8, 2, 64)
    seg.store(layout.H_LAYOUT_VERSION, layout.LAYOUT_VERSION - 1)
    seg.close()
    supervisor = Process(["-m", "cacheroute_proxy", "run"], _env(shm_name), tmp_path / "launcher.log")
    assert supervisor.popen.wait(30) == 1
    log = supervisor.log()
    assert f"layout version {layout.LAYOUT_VERSION - 1}" in log and "make clean-shm" in log
    assert "Traceback" not in log and log.count("started sidecar") == 1  # no crash loop
    supervisor.stop()


@pytest.mark.slow
def test_worker_that_cannot_start_stops_the_supervisor(shm_name, tmp_path):
    env = _env(shm_name)
    blocker = __import__("socket").socket()
    private = f"127.0.0.1:{env['PROXY_WORKER_PRIVATE_PORT_BASE']}"
    blocker.bind(("127.0.0.1", int(env["PROXY_WORKER_PRIVATE_PORT_BASE"])))  # worker 0's port taken
    blocker.listen()
    try:
        supervisor = Process(["-m", "cacheroute_proxy", "run"], env, tmp_path / "launcher.log")
        assert supervisor.popen.wait(40) == 1
        log = supervisor.log()
        assert f"cannot bind the private address (PROXY_WORKER_PRIVATE_*) on {private}" in log
        assert f"worker0 cannot start (exit 5, its private address {private} is taken)" in log
        assert log.count("started worker0") == 1
        supervisor.stop()
    finally:
        blocker.close()
    assert not os.path.exists(f"/dev/shm{shm_name}")
