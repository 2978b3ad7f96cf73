"""bench/bench_metrics.py measures both writers in a fresh interpreter and leaves nothing."""

from __future__ import annotations

import json
import subprocess
import os
import sys
from pathlib import Path

from bench.report.others import metrics_section
from cacheroute_sim.processes import ROOT


def test_a_short_run_times_every_case_and_removes_its_directories(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # its temporary directories go here, and must be gone after
    scratch.mkdir()
    out = tmp_path / "metrics.json"
    done = subprocess.run([sys.executable, "-m", "bench.bench_metrics", "--calls", "2000", "--repeats", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"observe_request", "observe_ttft", "prometheus_client request",
                                    "prometheus_client ttft"}
    assert all(r["median_ns"] > 0 for r in data["results"].values())
    assert set(data["prometheus_client_over_product"]) == {"observe_request", "observe_ttft"}
    assert not list(scratch.iterdir())
    text = metrics_section(data)
    assert "| `observe_request` |" in text and "2 interleaved loops of 2,000 calls" in text
