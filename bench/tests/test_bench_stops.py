"""A benchmark stopped by SIGTERM (a `timeout`, an operator's kill) stops every process it
started, as Ctrl-C does (bench.harness.cli.stop_on_sigterm, which every benchmark that starts
processes installs): here bench_affinity's simulated instances, KDN and proxy (whose supervisor
stops the sidecar and the workers), cut short while its proxy serves. Also when a second
SIGTERM follows while it is stopping them, as when a `timeout` in the benchmark's process group
passes on the SIGTERM the whole group got."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, by pid, with its command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = _cmdline(child)
                frontier.append(child)
    return found


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if b"=" in e)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_sigterm_stops_every_process_the_benchmark_started(tmp_path: Path, signals: int) -> None:
    argv = ["-m", "bench.bench_affinity", "--requests", "400", "--saturation-rps", "4", "--only", "kv_aware x1"]
    bench = subprocess.Popen([sys.executable, *argv, "--out", str(tmp_path / "result.json")], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and bench.poll() is None:
            started = _descendants(bench.pid)
            if any("proxy_workers" in cmd for cmd in started.values()):
                break
            time.sleep(0.2)
        assert any("proxy_workers" in cmd for cmd in started.values()), "the proxy never served"
        time.sleep(1.0)
        started = _descendants(bench.pid)
        segment = Path("/dev/shm", _environ(next(pid for pid, cmd in started.items()
                                                 if "proxy_workers" in cmd))["PROXY_SHM_NAME"].lstrip("/"))
        assert segment.exists()
        bench.send_signal(signal.SIGTERM)
        for _ in range(signals - 1):
            time.sleep(0.3)  # the benchmark is stopping what it started
            bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) != 0  # stopped, not finished
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _left(started):
            time.sleep(0.2)
        assert _left(started) == {}
        assert not segment.exists()  # the proxy's supervisor unlinked it on its way out
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        _stop(_left(started))  # what a failed run left behind


def _stop(left: dict[int, str]) -> None:
    """SIGTERM first, so a leftover supervisor still unlinks its segment; SIGKILL what stays."""
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _left(left):
        time.sleep(0.2)
    for pid in _left(left):
        os.kill(pid, signal.SIGKILL)


def _left(started: dict[int, str]) -> dict[int, str]:
    """Those of `started` still alive (the same command line: not a pid reused since)."""
    return {pid: cmd for pid, cmd in started.items() if _alive(pid) and _cmdline(pid) == cmd}
