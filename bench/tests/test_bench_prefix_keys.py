"""bench/bench_prefix_keys.py times every case on the tiny model's tokenizer (built here when
.cache/tiny-llama is missing), writes its results file, and the report renders it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report.others import prefix_keys_section
from cacheroute_sim.processes import ROOT

CASES = {"whole", "memo", "memo_miss", "multiturn_whole", "multiturn_memo"}


def test_a_short_run_times_every_case_and_its_parts(tmp_path: Path) -> None:
    out = tmp_path / "prefix_keys.json"
    done = subprocess.run([sys.executable, "-m", "bench.bench_prefix_keys", "--requests", "8",
                           "--repeats", "2", "--block-tokens", "16,128", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"16", "128"}
    for result in data["results"].values():
        assert set(result["cases"]) == CASES
        for name, case in result["cases"].items():
            assert case["cpu_us_per_request"]["median"] > 0
            assert set(case["parts_us_median"]) == {"render", "tokenize", "hash", "other"}
        memo = {name: case["memo"] for name, case in result["cases"].items()}
        assert memo["whole"]["entries"] == memo["multiturn_whole"]["entries"] == 0
        assert memo["memo"]["hits"] > 0 and memo["memo_miss"]["misses"] > 0
        assert memo["multiturn_memo"]["partial"] > 0
    text = prefix_keys_section(data)
    assert "| `memo` |" in text and "Blocks of 128 tokens" in text and "2 interleaved blocks of 8" in text
