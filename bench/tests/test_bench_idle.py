"""bench/idle.py: a short window measures the whole tree at rest, by role, and its results file
becomes a BENCHMARKS.md section."""

from __future__ import annotations

import json
from pathlib import Path

from bench import idle
from bench.report.build import build


def test_a_short_window_measures_the_tree_and_the_report_renders_it(tmp_path: Path) -> None:
    out = tmp_path / "results" / "idle.json"
    assert idle.main(["--out", str(out), "--workers", "1", "--seconds", "1", "--rounds", "1"]) == 0
    data = json.loads(out.read_text())
    window = data["results"]["current"]["windows"][0]
    assert set(window["by_role"]) >= {"sidecar", "workers"}
    # At rest a second can cost less than the 10 ms a CPU-time tick counts: 0 is a measurement.
    assert 0 <= window["cpu_s"] < 1.0 and data["target"]["verdict"] in ("PASS", "FAIL")
    text, used = build(out.parent, tmp_path / "BENCHMARKS.md", None)
    assert used == ["idle.json"] and "## At rest" in text and "current" in text
