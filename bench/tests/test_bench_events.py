"""bench/bench_events.py: its scenario writes what workers write and the sidecar consumes all of
it, and its results file becomes a BENCHMARKS.md section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_events import run_case
from bench.report.build import build


@pytest.mark.parametrize("mode, events", [("stream", 3.0), ("non_stream", 2.0)])
def test_a_short_run_consumes_every_request_and_its_events(mode: str, events: float) -> None:
    result = run_case(2, mode, seed=1, warmup=10, measured=20, poll_s=0.0)
    # 4,000/s at the 5 ms poll: 20 a tick; a request's life varies by a tick either way
    assert result["requests"] == pytest.approx(20 * 20, abs=20)
    assert result["events_per_request"] == pytest.approx(events, abs=0.15)
    assert result["dropped"] == 0 and result["published"] >= 1
    assert result["us_per_request"] > 0


def test_the_results_file_becomes_a_section(tmp_path: Path) -> None:
    case = {"median_us_per_request": 5.5, "repeats_us_per_request": [5.5, 6.0],
            "median_us_per_tick": 110.0, "requests_per_repeat": 4000, "events_per_request": 3.0,
            "dropped": 0}
    before = {**case, "median_us_per_request": 61.0, "repeats_us_per_request": [61.0, 58.0]}
    (tmp_path / "events.json").write_text(json.dumps({
        "command": "python -m bench.bench_events --baseline main", "poll_ms": 5.0,
        "commit": "abc1234", "baseline_ref": "main", "baseline_commit": "def5678",
        "results": {"current": {"16:stream": case}, "baseline": {"16:stream": before}},
        "speedup_vs_baseline": {"16:stream": {"median_ratio": 10.3, "per_repeat": [11.1, 9.67]}},
        "method": {"measured": "thread CPU of tick()"}}))
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == ["events.json"]
    assert "## Sidecar event cost (µs of CPU per request)" in text
    assert "| `16:stream` | 61 | 5.50 | 10.3 | 11.1, 9.67 | 3 |" in text
    assert "baseline: the product at `main` (`--baseline`)" in text
    assert "def5678" not in text and "abc1234" not in text  # the file's commits stay in the file
