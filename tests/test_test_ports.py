"""The ports and segment names the tests and benchmarks hand out (cacheroute_sim/processes.py):
ports free when picked, outside the kernel's ephemeral range, and never handed out twice in a
while. A port is only taken when its server binds it; picked one by one, a supervisor's control
plane once got worker 1's private port, and a test read the sidecar's /healthz as the worker's.
Parallel test workers (pytest-xdist) do not know each other's picks: each has its own share of
the ports and its own segment names."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from cacheroute_sim.processes import (SupervisorPorts, _listen_window, free_port, free_port_range,
                                     recent_limit, segment_name, segment_prefix)
from tests import segment_guard


def test_a_supervisors_ports_are_one_free_range_outside_the_ephemeral_range():
    """One range checked free as a whole, so no two of them can be the same port."""
    window = _listen_window()
    for workers in (1, 2, 4, 16):
        for _ in range(50):
            ports = SupervisorPorts(workers, "cacheroute_test")
            every = [ports.dp_port, ports.cp_port, *(ports.private_base + i for i in range(workers))]
            assert every == list(range(every[0], every[0] + len(every))), every
            assert every[0] in window and every[-1] in window
            with socket.socket() as probe:  # free now: the one picked last can be bound
                probe.bind(("127.0.0.1", every[-1]))


def test_no_port_is_handed_out_twice_before_anything_binds_it():
    """Nothing binds these: every pick is free, and only the memory of what was handed out
    keeps them apart (4,096 random picks from ~22,000 ports, or half a parallel test worker's
    share of them, would repeat one almost surely)."""
    limit = recent_limit(_listen_window())
    handed: list[int] = []
    n = 0
    while len(handed) + 1 + 12 <= limit:
        handed.append(free_port())
        base = free_port_range(1 + n % 12)
        handed.extend(range(base, base + 1 + n % 12))
        n += 1
    assert len(handed) > limit - 13 and len(handed) == len(set(handed))


def _as_worker(monkeypatch: pytest.MonkeyPatch, name: str | None, count: int) -> None:
    for variable, value in (("PYTEST_XDIST_WORKER", name), ("PYTEST_XDIST_WORKER_COUNT", str(count))):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)


def test_parallel_test_workers_pick_ports_from_shares_that_do_not_overlap(monkeypatch: pytest.MonkeyPatch):
    _as_worker(monkeypatch, None, 1)
    whole = _listen_window()
    shares = []
    for index in range(4):
        _as_worker(monkeypatch, f"gw{index}", 4)
        share = _listen_window()
        assert len(share) >= len(whole) // 4 - 1 and share.start in whole and share[-1] in whole
        for _ in range(30):
            base = free_port_range(1 + index * 5)
            assert base in share and base + index * 5 in share
        shares.append(share)
    assert all(a[-1] < b.start for a, b in zip(shares, shares[1:]))


def test_parallel_test_workers_name_their_segments_apart(monkeypatch: pytest.MonkeyPatch):
    _as_worker(monkeypatch, None, 1)
    assert segment_prefix("cacheroute_test") == "cacheroute_test_"
    alone = segment_name("cacheroute_test")
    assert alone.startswith("/cacheroute_test_") and len(alone) == len("/cacheroute_test_") + 10
    _as_worker(monkeypatch, "gw2", 3)
    assert segment_prefix("cacheroute_test") == "cacheroute_test_gw2_"
    names = {segment_name("cacheroute_test") for _ in range(100)}
    assert len(names) == 100 and all(name.startswith("/cacheroute_test_gw2_") for name in names)
    assert SupervisorPorts(1, "cacheroute_test").shm_name.startswith("/cacheroute_test_gw2_")


def test_a_parallel_workers_leftover_check_counts_only_its_own_segments(monkeypatch: pytest.MonkeyPatch):
    """Another worker's segment, unmapped and old, is not this worker's leftover (workers 98 and
    99 of 100: no worker of a real run watches these names)."""
    _as_worker(monkeypatch, "gw99", 100)
    assert segment_guard.watched_segments() == ("cacheroute_test_gw99_",)
    before = segment_guard.shm_files(segment_guard.watched_segments())
    mine, other = Path(f"/dev/shm{segment_name('cacheroute_test')}"), Path("/dev/shm/cacheroute_test_gw98_0123456789")
    try:
        for path in (mine, other):
            path.write_bytes(b"")
            os.utime(path, (time.time() - 60, time.time() - 60))  # past the brand-new grace
        assert segment_guard.orphans(before, segment_guard.watched_segments()) == {mine.name}
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
