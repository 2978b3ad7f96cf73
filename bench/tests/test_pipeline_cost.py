"""bench/pipeline_cost.py runs the worker's real request path in-process and leaves nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench import pipeline_cost


def test_a_short_run_measures_every_variant_and_removes_what_it_made(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "cost.json"
    assert pipeline_cost.main(["--requests", "64", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"full", "without metrics", "without events", "without meta",
                            "without predictions", "without disconnect watch", "without admission",
                            "relay floor"}
    assert all(r["median_us"] > 0 for r in results.values())
    assert results["full"]["part_us"] is None and results["relay floor"]["part_us"] is not None
    assert not {name for name in set(os.listdir("/dev/shm")) - before if "cacheroute_cost" in name}
    from bench.report.others import pipeline_cost_section
    text = pipeline_cost_section(json.loads(out.read_text()))
    assert "| relay floor |" in text and "1 interleaved blocks of 64 requests" in text


def test_a_variant_replaces_its_part_only_while_it_runs() -> None:
    from proxy_workers import metrics
    original = metrics.observe_request
    with pipeline_cost.replaced(metrics, "observe_request", None):
        assert metrics.observe_request is None
    assert metrics.observe_request is original
