"""bench/peers/task_clock.py: the scheduler's CPU per request, read by perf over a wrk run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.peers import task_clock


def _perf_attaches() -> bool:
    if shutil.which("perf") is None:
        return False
    done = subprocess.run(["perf", "stat", "-e", "task-clock", "--", "true"], capture_output=True,
                          timeout=30, check=False)
    return done.returncode == 0


pytestmark = [
    pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed"),
    pytest.mark.skipif(not _perf_attaches(), reason="perf not installed or not allowed here"),
    pytest.mark.slow,
]


def test_each_group_is_charged_what_the_scheduler_ran_it_for(tmp_path: Path) -> None:
    out = tmp_path / "task_clock.json"
    code = task_clock.main(["--backend", "sim", "--contenders", "proxy-w1-ll", "relay-floor-w2",
                            "--repeats", "1", "--seconds", "1", "--out", str(out)])
    assert code == 0
    medians = json.loads(out.read_text())["backends"]["sim"]
    proxy, floor = medians["proxy-w1-ll"], medians["relay-floor-w2"]
    # The proxy's roles apart; its sidecar consumes every request's events, so it runs too.
    assert set(proxy["groups"]) == {"launcher", "sidecar", "workers"}
    assert proxy["groups"]["workers"]["task_clock_us_per_req"] > 0
    assert proxy["groups"]["sidecar"]["task_clock_us_per_req"] > 0
    assert set(floor["groups"]) == {"tree"} and floor["task_clock_us_per_req"] > 0
    assert proxy["rps"] > 0 and floor["rps"] > 0 and proxy["errors"] == floor["errors"] == 0
    # Per request, the whole proxy is the sum of its groups.
    assert proxy["task_clock_us_per_req"] == pytest.approx(
        sum(g["task_clock_us_per_req"] for g in proxy["groups"].values()), abs=0.5)
