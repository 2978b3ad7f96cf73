"""bench/gate_wait.py: a short window of paced streams, more than the ready gate admits, through
the proxy; its results file becomes a BENCHMARKS.md section."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gate_wait
from bench.report.build import build


def test_a_short_window_relays_paced_streams_past_the_gate_and_the_report_renders_it(tmp_path: Path) -> None:
    out = tmp_path / "results" / "gate_wait.json"
    assert gate_wait.main(["--out", str(out), "--seconds", "2", "--rounds", "1", "--streams", "12"]) == 0
    window = json.loads(out.read_text())["results"]["current"]["windows"][0]
    assert window["streams_ok"] > 0 and window["errors"] == 0, window
    assert window["cpu_us_per_token"] > 0 and set(window["cpu_s_by_role"]) >= {"sidecar", "workers"}
    text, used = build(out.parent, tmp_path / "BENCHMARKS.md", None)
    assert used == ["gate_wait.json"] and "## Paced streams, half of them waiting at the ready gate" in text
