"""The worker's garbage collector settings (proxy_workers/server.settle_collector), in a fresh
interpreter so the test process keeps its own: requests in flight trigger no collection, and
cyclic garbage is still collected."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import gc
from proxy_workers.server import GC_FIRST_THRESHOLD, settle_collector

settle_collector()
assert gc.get_freeze_count() > 0
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "stop" else None)
in_flight = [[{} for _ in range(25)] for _ in range(256)]  # 256 requests, ~25 tracked objects each
del in_flight
assert runs == [], f"requests in flight ran {len(runs)} collections"
for _ in range(2 * GC_FIRST_THRESHOLD):
    garbage = []
    garbage.append(garbage)  # a cycle: only the collector frees it
assert runs, "cyclic garbage was never collected"
"""


def test_requests_in_flight_run_no_collection_and_cycles_are_still_collected() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
