"""PROXY_SCHED_SLICE_US: the time slice a worker and the sidecar ask the kernel for (EEVDF's
custom slice), read back from /proc where the kernel shows it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cacheroute_proxy.sched_slice import request_slice

EEVDF = "se.slice" in Path("/proc/self/sched").read_text()
needs_eevdf = pytest.mark.skipif(not EEVDF, reason="no EEVDF slice in /proc/<pid>/sched (kernel < 6.6)")


def _slice_ns(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    raise AssertionError(f"no se.slice in {path}")


@needs_eevdf
def test_a_thread_gets_the_slice_it_asks_for_and_keeps_its_nice():
    seen: dict[str, object] = {}

    def ask() -> None:  # a thread of its own: the test process keeps the kernel's slice
        tid = threading.get_native_id()
        seen["before"] = _slice_ns(f"/proc/self/task/{tid}/sched")
        seen["problem"] = request_slice(250)
        seen["after"] = _slice_ns(f"/proc/self/task/{tid}/sched")

    nice = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    assert seen["problem"] is None and seen["before"] != 250_000 and seen["after"] == 250_000
    assert os.getpriority(os.PRIO_PROCESS, 0) == nice


@needs_eevdf
def test_workers_and_the_sidecar_run_with_the_slice_set(make_cluster):
    cluster = make_cluster(workers=2, env={"PROXY_SCHED_SLICE_US": "300"})
    pids = [*cluster.worker_pids().values(), cluster.status()["sidecar"]["pid"]]
    assert [_slice_ns(f"/proc/{pid}/sched") for pid in pids] == [300_000] * 3
    plain = make_cluster(workers=1)
    assert _slice_ns(f"/proc/{plain.worker_pids()[0]}/sched") != 300_000  # unset: the kernel's
