"""bench/pipeline_cost.py runs the worker's real request path in-process and leaves nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import pipeline_cost


def test_a_short_run_measures_every_variant_and_removes_what_it_made(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "cost.json"
    assert pipeline_cost.main(["--requests", "64", "--repeats", "1", "--cold-requests", "2",
                               "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    cold = json.loads(out.read_text())["cold"]
    assert set(cold) == set(results) and all(r["median_us"] > 0 for r in cold.values())
    assert cold["full"]["part_us"] is None and cold["relay floor"]["part_us"] is not None
    assert tuple(results) == pipeline_cost.VARIANTS
    assert all(r["median_us"] > 0 for r in results.values())
    assert results["full"]["part_us"] is None and results["relay floor"]["part_us"] is not None
    assert not {name for name in set(os.listdir("/dev/shm")) - before if "cacheroute_cost" in name}
    from bench.report.others import pipeline_cost_section
    text = pipeline_cost_section(json.loads(out.read_text()))
    assert "| relay floor |" in text and "1 interleaved blocks of 64 requests" in text
    assert "on evicted caches (2 each, median)" in text
    assert "| `proxy_workers` |" in text and "(serve)` |" in text


def test_the_profile_names_the_data_planes_functions_by_repository_path() -> None:
    """The profiled block: its shares add up to the whole, a function of the data plane is named
    by its path here with its line, and counted in its package."""
    from bench.pipeline_cost import by_function
    import cProfile
    import pstats

    from proxy_workers import app

    profiler = cProfile.Profile()
    profiler.runcall(lambda: [app.worker_name(i) for i in range(2000)])
    profile = by_function(pstats.Stats(profiler), 2000, 10.0)
    assert abs(sum(row["share"] for row in profile["packages"]) - 1) < 0.01
    names = [row["function"] for row in profile["functions"]]
    line = app.worker_name.__code__.co_firstlineno
    assert f"proxy_workers/app.py:{line}(worker_name)" in names
    worker = next(row for row in profile["functions"] if row["function"].endswith("(worker_name)"))
    assert worker["calls_per_request"] == 1.0
    packages = {row["package"]: row["share"] for row in profile["packages"]}
    assert packages["proxy_workers"] >= worker["share"] > 0


def test_a_variant_replaces_its_part_only_while_it_runs() -> None:
    from proxy_workers import metrics
    original = metrics.observe_request
    with pipeline_cost.replaced(metrics, "observe_request", None):
        assert metrics.observe_request is None
    assert metrics.observe_request is original


@pytest.mark.slow
@pytest.mark.timeout(400)  # four processes under valgrind, ~15 s each on an idle machine
def test_instructions_count_what_a_request_executes_under_callgrind(tmp_path: Path) -> None:
    """bench/instructions.py: two runs of a variant under valgrind, the difference a request;
    the part of what a variant leaves out is full − it, and nothing is left in /dev/shm."""
    import shutil

    from bench import instructions
    from bench.report.others import instructions_section

    if shutil.which("valgrind") is None:
        if os.environ.get("CACHEROUTE_REQUIRE_VALGRIND") == "1":
            pytest.fail("valgrind is not installed, and CACHEROUTE_REQUIRE_VALGRIND=1")
        pytest.skip("valgrind is not installed (.ci/run installs it)")
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "instructions.json"
    assert instructions.main(["--variants", "full,relay floor", "--requests", "64", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["full"]["part"] is None
    # a whole request of the product's own is tens of thousands of instructions, never zero
    assert results["full"]["per_request"] > results["relay floor"]["per_request"] + 10_000
    assert results["relay floor"]["part"] == results["full"]["per_request"] - results["relay floor"]["per_request"]
    assert not {name for name in set(os.listdir("/dev/shm")) - before if "cacheroute_cost" in name}
    text = instructions_section(json.loads(out.read_text()))
    assert "| relay floor |" in text and "100 %" in text


def test_an_instructions_run_stopped_by_sigterm_removes_its_segment() -> None:
    """A run (what valgrind runs) stopped mid-way, as a Ctrl-C or a SIGTERM to the benchmark
    stops it: it unwinds, says so, and leaves no segment behind."""
    import signal
    import subprocess
    import sys
    import time

    before = set(os.listdir("/dev/shm"))

    def its_segments() -> set[str]:
        return {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("cacheroute_cost_")}

    run = subprocess.Popen([sys.executable, "-m", "bench.instructions", "--drive", "full", "10000000"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not its_segments():
            assert run.poll() is None and time.monotonic() < deadline, "the run made no segment"
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130 and b"interrupted" in out
    assert not its_segments()
