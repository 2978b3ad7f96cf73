"""BENCHMARKS.md is generated from the results JSON only: every figure in it comes from the
files, the checks show PASS/FAIL as stored, and the charts are real PNGs. The inputs are tiny
synthetic results written here (never committed as results)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench.report import peers
from bench.report.build import SERIES, build, charts_available
from bench.routing import summary, uncertainty
from cacheroute_sim.processes import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LABELS = ["fast0", "fast1", "slow"]


def _routing_run(repeat: int, p99: float, shares: tuple[float, float, float]) -> dict[str, Any]:
    return {"repeat": repeat, "position": repeat, "ttft_p50_ms": 61.5, "ttft_p90_ms": 300.0,
            "ttft_p99_ms": p99, "total_p50_ms": 900.0, "total_p99_ms": 4321.0,
            "inflight_spread_mean": 1.25, "inflight_spread_p95": 3.0, "errors": 0,
            "error_rate": 0.0, "contender_cpu_util": 0.2, "worker_cpu_peak": 0.15,
            "client_late_p99_ms": 2.0, "share": dict(zip(LABELS, shares)),
            "ttft_p99_by_instance_ms": {"fast0": 400.0, "fast1": 410.0, "slow": p99},
            "ttft_samples_ms": [50.0, 61.5, 70.0, 300.0, p99],
            "series": {"t_s": [0.0, 0.05, 0.1, 0.15], "inflight": [[0, 0, 0], [1, 2, 0], [2, 2, 1], [0, 1, 3]],
                       "every_nth_sample": 1}}


def _routing() -> dict[str, Any]:
    p99s = {summary.REFERENCE: 1000.0, summary.SHARED: 1050.0, summary.PER_WORKER: 1700.0,
            summary.ROUND_ROBIN: 2500.0, summary.NGINX: 1234.5}
    contenders = []
    for name, p99 in p99s.items():
        runs = [_routing_run(i, p99 + 10 * (i - 1), (0.4, 0.4, 0.2)) for i in range(3)]
        contenders.append({"name": name, "kind": "nginx" if name == summary.NGINX else "proxy",
                           "workers": 4, "strategy": "least_load", "load_view": "shared",
                           "runs": runs, "median": summary.medians(runs, LABELS)})
    return {"command": "python -m bench.routing --synthetic", "started_at": "2026-11-30T14:00:00+00:00",
            "machine": {"nproc": 2, "cpu_model": "Test CPU", "loadavg": [0.5, 0.4, 0.3],
                        "pressure_cpu": ["some avg10=1.00 avg60=2.00 avg300=3.00 total=1"]},
            "versions": {"nginx": "nginx/1.22.1"}, "method": {"repeats": 3},
            "scenario": {"time_scale": 0.5, "instances": [
                {"label": lb, "slow_factor": 3.0 if lb == "slow" else 1.0, "max_concurrency": 4}
                for lb in LABELS],
                "schedule": {"duration_s": 35.0, "burst_gap_mean_s": 1.0, "burst_size": [2, 10],
                             "seed": 7, "max_tokens_mix": [[16, 0.5], [256, 0.5]],
                             "prompt_tokens_mix": [[32, 1.0]]}},
            "offered_load": {"requests": 210, "bursts": 35, "mean_rate_per_s": 6.0},
            "instance_labels": LABELS, "contenders": contenders,
            "ratios_to_nginx": summary.ratios_to_nginx(contenders),
            "checks": summary.checks(contenders), "validity": summary.validity(contenders),
            "uncertainty": uncertainty.intervals(contenders, resamples=100),
            "notes": ["a synthetic note"]}


def _peers() -> dict[str, Any]:
    def contender(name: str, kind: str, rps: float, samples: list[float]) -> dict[str, Any]:
        return {"name": name, "kind": kind, "workers": 2, "strategy": "least_conn",
                "runs": [{"repeat": 0, "rps_c32": rps, "latency_samples_ms": samples,
                          "wrk_latency_percentiles_ms": {"50": 0.8, "90": 1.5, "99": 3.25}}],
                "median": {"rps_c32": rps, "added_p50_ms": 0.42, "errors": 0}}
    contenders = [contender("nginx", "nginx", 9876.0, [0.5, 0.6, 0.7, 0.9, 1.4]),
                  contender("proxy-2w-rr", "proxy", 4321.0, [0.9, 1.1, 1.3, 2.0, 5.5])]
    return {"command": "python -m bench.peers --synthetic", "started_at": "2026-11-30T14:00:00+00:00",
            "machine": {"nproc": 2}, "versions": {}, "method": {"repeats": 1},
            "contenders": contenders,
            "ratios_to_nginx": {"proxy-2w-rr": {"rps_c32": 0.4375}}, "notes": ["router did not install"]}


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    d.mkdir()
    (d / "routing.json").write_text(json.dumps(_routing()))
    (d / "peers.json").write_text(json.dumps(_peers()))
    return d


def test_every_figure_comes_from_the_json(results_dir: Path, tmp_path: Path) -> None:
    text, used = build(results_dir, tmp_path / "BENCHMARKS.md", None)
    assert used == ["routing.json", "peers.json"]
    # Routing: the median TTFT p99 of the synthetic runs, the share, the nginx ratio, a check.
    assert "| `proxy-4w-least_load-shared` | 4 | least_load | shared | 61.5 | 300 | 1,050 | 1,060 |" in text
    assert "| `proxy-4w-round_robin` | 40% | 40% | 20% | 400 | 410 | 2,500 |" in text
    assert "| `nginx-least_conn` | 4 | least_load | shared | 61.5 | 300 | 1,234 | 1,244 |" in text
    assert "Command: `python -m bench.routing --synthetic`" in text and "a synthetic note" in text
    assert "Machine: cpu_model Test CPU; nproc 2; loadavg 0.50, 0.40, 0.30" in text
    # 1050/1000 = 1.05 <= 1.10 passes; shared beats per_worker and round_robin.
    assert text.count("**PASS**") >= 3 and "**FAIL**" not in text
    # The intervals: 3 paired repeats, 1050/1000 at the median of per-repeat p99.
    assert ("| `proxy-4w-least_load-shared` / `proxy-1w-least_load` | median of per-repeat TTFT p99 "
            "| 3 | 1.05× | 1.05× – 1.05× |") in text
    # Peers: medians, ratio to nginx, notes.
    assert "9,876" in text and "4,321" in text and "0.44×" in text and "router did not install" in text


def test_a_failing_check_is_reported_as_fail(results_dir: Path, tmp_path: Path) -> None:
    data = json.loads((results_dir / "routing.json").read_text())
    for c in data["contenders"]:
        if c["name"] == summary.SHARED:
            c["median"]["ttft_p99_ms"] = 5000.0
    data["checks"] = summary.checks(data["contenders"])
    (results_dir / "routing.json").write_text(json.dumps(data))
    text, _ = build(results_dir, tmp_path / "BENCHMARKS.md", None)
    assert text.count("**FAIL**") == 3


def test_missing_files_give_a_report_without_their_sections(tmp_path: Path) -> None:
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == [] and "No results files found" in text


def test_latency_distributions_are_found_by_key_name() -> None:
    contender = _peers()["contenders"][1]
    contender["runs"].append({"scenario": "c32", "percentiles_ms": [[1, 0.2], [50, 0.9], [99.9, 7.0]]})
    found = peers.distributions(contender)
    assert found["latency_samples_ms"]["samples"] == [0.9, 1.1, 1.3, 2.0, 5.5]
    assert found["wrk_latency_percentiles_ms"] == {"quantiles": [0.5, 0.9, 0.99], "values": [0.8, 1.5, 3.25]}
    # wrk's [[percent, ms], ...], kept apart per scenario
    assert found["c32 / percentiles_ms"]["quantiles"] == pytest.approx([0.01, 0.5, 0.999])
    assert found["c32 / percentiles_ms"]["values"] == [0.2, 0.9, 7.0]


@pytest.mark.skipif(not charts_available(), reason="matplotlib is in the bench extra")
def test_charts_are_pngs_linked_from_the_report(results_dir: Path, tmp_path: Path) -> None:
    charts_dir = results_dir / "charts"
    text, _ = build(results_dir, tmp_path / "BENCHMARKS.md", charts_dir)
    names = {"routing_share.png", "routing_ttft.png", "routing_ttft_cdf.png", "routing_inflight.png",
             "peers_latency.png"}
    assert {p.name for p in charts_dir.iterdir()} == names
    for name in names:
        assert (charts_dir / name).read_bytes()[:8] == PNG_MAGIC
        assert f"(results/charts/{name})" in text


def test_a_quick_run_is_marked_as_a_smoke_run(results_dir: Path, tmp_path: Path) -> None:
    text, _ = build(results_dir, tmp_path / "BENCHMARKS.md", None)
    assert "Smoke run" not in text.split("## This proxy")[0]
    data = json.loads((results_dir / "routing.json").read_text())
    data["command"] = "python -m bench.routing --quick --out x.json"
    (results_dir / "routing.json").write_text(json.dumps(data))
    text, _ = build(results_dir, tmp_path / "BENCHMARKS.md", None)
    assert "Smoke run" in text.split("## This proxy")[0]


def test_peers_with_two_backends_renders_a_subsection_each(tmp_path: Path) -> None:
    legacy = _peers()
    section = {k: legacy[k] for k in ("contenders", "ratios_to_nginx")}
    targets = [{"target": "req/s at c32 ≥ 1.0× vllm-router's", "contender": "proxy-w2-ll",
                "versus": "vllm-router-p2", "figure": "c32 rps", "bound": 1.0, "at_least": True,
                "measured": 1.07, "per_repeat": [1.1, 1.07, 0.98], "passed": True}]
    sim = {**section, "targets": targets, "notes": ["a sim note"]}
    fake = {**section, "targets": [{**targets[0], "measured": 0.9, "passed": False}],
            "ratios_to_nginx": {"proxy-2w-rr": {"rps_c32": 0.5}}, "notes": ["a fake note"]}
    data = {k: v for k, v in legacy.items() if k not in ("contenders", "ratios_to_nginx")}
    (tmp_path / "peers.json").write_text(json.dumps({**data, "backends": {"sim": sim, "starlette": fake}}))
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == ["peers.json"]
    sim_part, fake_part = text.split("### Backend `starlette`")
    assert "### Backend `sim`" in sim_part and "0.44×" in sim_part and "a sim note" in sim_part
    assert "| 1.07× | ≥ 1.00× | **PASS** | 1.10×, 1.07×, 0.98× |" in sim_part
    assert "| 0.90× | ≥ 1.00× | **FAIL** |" in fake_part and "0.50×" in fake_part
    assert "a fake note" in fake_part and "a fake note" not in sim_part
    assert "router did not install" in fake_part  # the run's own notes close the section


def test_the_task_clock_run_renders_each_backend_with_ratios_to_the_router(tmp_path: Path) -> None:
    def entry(us: float, groups: dict[str, float]) -> dict[str, Any]:
        return {"rps": 2000.0, "task_clock_us_per_req": us, "per_repeat_us": [us, us + 10],
                "groups": {g: {"task_clock_us_per_req": v, "context_switches_per_req": 0.7}
                           for g, v in groups.items()}, "errors": 0}
    medians = {"proxy-w2-ll": entry(440.0, {"sidecar": 35.0, "workers": 405.0}),
               "vllm-router-p2": entry(220.0, {"tree": 220.0})}
    (tmp_path / "peers_task_clock.json").write_text(json.dumps(
        {"command": "python -m bench.peers.task_clock", "started_at": "2026-12-02T13:12:00+00:00",
         "backends": {"sim": medians, "starlette": medians}}))
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == ["peers_task_clock.json"]
    sim_part, fake_part = text.split("### Backend `starlette`")
    assert "### Backend `sim`" in sim_part
    for part in (sim_part, fake_part):
        assert "| `proxy-w2-ll` | 2,000 | 440 | 2.00× | 440, 450 | sidecar 35, workers 405 |" in part
        assert "| `vllm-router-p2` | 2,000 | 220 | 1.00× |" in part


def test_the_command_line_writes_the_report(results_dir: Path, tmp_path: Path) -> None:
    from bench.report.__main__ import main

    out = tmp_path / "B.md"
    assert main(["--results", str(results_dir), "--out", str(out), "--charts", str(tmp_path / "c")]) == 0
    assert out.read_text().startswith("# Benchmarks")


def _pressure(**extra: Any) -> dict[str, Any]:
    return {"command": "python -m bench.bench_pressure --synthetic",
            "workload": {"duration_s": 45.0, "rate_per_s": 1.0, "strategy": "least_load"},
            "requests_ok": 48, "requests_failed": 0,
            "ttft_prediction_error_ms": {"median_abs": 57.0, "p90_abs": 112, "median_signed": -57.0, "samples": 48},
            "actual_ttft_ms": {"p50": 1424.0, "p90": 3707},
            "snapshot_age_ms": {"p50": 45.65, "p99": 100.1, "max": 100.1, "samples": 48},
            "loadavg": [0.2, 0.4, 0.6], **extra}


def test_the_real_engine_pressure_run_sits_next_to_the_simulated_one(tmp_path: Path) -> None:
    (tmp_path / "pressure.json").write_text(json.dumps(_pressure()))
    (tmp_path / "pressure_vllm.json").write_text(json.dumps(_pressure(
        command="python -m bench.bench_pressure --vllm --synthetic",
        workload={"rate_per_s": 4.0, "engine": "vLLM CPU, tiny model", "profile": "vllm-cpu-tiny"},
        engine={"vllm_version": "0.32.0", "max_num_seqs": 4},
        ttft_prediction_error_ms={"median_abs": 23.5, "p90_abs": 345, "median_signed": 12.25, "samples": 230},
        requests_ok=230, requests_failed=2, failures={"RequestFailed: 400 too long": 2},
        loadavg_at_start=[1.5, 1.0, 0.5])))
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == ["pressure.json", "pressure_vllm.json"]
    simulated, real = text.split("## Predicted pressure against real vLLM engines")
    assert "## Predicted pressure against reality" in simulated
    assert "| TTFT prediction error (ms) | median_abs | 57 |" in simulated
    assert "--vllm --synthetic" in real and "profile vllm-cpu-tiny" in real
    assert "| TTFT prediction error (ms) | median_abs | 23.5 |" in real
    assert "| TTFT prediction error (ms) | p90_abs | 345 |" in real
    assert "Engines: vllm_version 0.32.0; max_num_seqs 4" in real
    assert "| requests failed |  | 2 |" in real and "- 2 × `RequestFailed: 400 too long`" in real
    assert "Load average at the start: 1.50, 1, 0.50" in real
    assert "23.5" not in simulated and "| median_abs | 57 |" not in real


DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{2}:\d{2}(:\d{2})? ?UTC\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_every_recorded_result_is_a_section_with_its_command_and_machine_and_no_commit_or_date(
        tmp_path: Path) -> None:
    results = ROOT / "bench" / "results"
    text, used = build(results, tmp_path / "BENCHMARKS.md", None)
    assert sorted(used) == sorted(p.name for p in results.glob("*.json"))
    sections = text.split("\n## ")[1:]
    assert len(sections) == len(used)
    for section in sections:
        title = section.splitlines()[0]
        assert "\nCommand: " in section and "\nMachine: " in section, title
    assert not DATE.search(text), DATE.search(text)
    assert not COMMIT.search(text), COMMIT.search(text)
    # The settled ones say so; a commit in a command is shown as REF.
    assert text.count("> **Settled**") == 4
    assert "`python -m bench.hotpath --workers 1,2 --baseline REF --nginx" in text
    assert "| `proxy-1w` | proxy | 1 | round_robin | 0.33 | 3,432 | 0.26 | 0 |" in text  # hotpath.json's medians
    assert ("Interpreters: every proxy `/root/.pyenv/versions/3.11.7/bin/python3.11 3.11.7`, but the "
            "baseline (`base-*`) `/usr/bin/python3.11 3.11.2`.") in text  # hotpath_interpreter.json
    # An A/B's change repeat by repeat (hotpath_selector_booking.json: least_load, 7 repeats).
    assert ("`proxy-2w` over `base-2w`, CPU per request at c32 repeat by repeat: 0.849, 0.854, 0.840, "
            "0.994, 0.895, 0.873, 0.901 (median 0.873; lower in 7 of 7).") in text
    assert "**PASSED**: 11,235 requests" in text and "| `clean_stop` | **PASS** |" in text  # the soak
    assert "| 5 ms | 191 | 31.3 | 164 |" in text  # what a wake-up costs
    assert "| 2 | after | 167 | 46.5 | 120 | -1.40 |" in text  # the metrics file's A/B
    assert "| granian | 19159 | 1.081 |" in text  # the stack choice's own table


def test_a_file_of_no_known_shape_still_names_its_command_and_machine(tmp_path: Path) -> None:
    (tmp_path / "probe.json").write_text(json.dumps({
        "command": "python -m bench.probe --baseline 1a2b3c4d", "machine": {"nproc": 2},
        "method": "one loop", "notes": ["a probe note"], "figures": [1, 2]}))
    text, used = build(tmp_path, tmp_path / "BENCHMARKS.md", None)
    assert used == ["probe.json"] and "## `probe.json`" in text
    assert "Command: `python -m bench.probe --baseline REF` (REF:" in text and "Machine: nproc 2" in text
    assert "Method: one loop" in text and "a probe note" in text


def test_the_repeated_real_engine_runs_are_judged_with_the_first_one_pooled(tmp_path: Path) -> None:
    results = ROOT / "bench" / "results"
    text, _ = build(results, tmp_path / "BENCHMARKS.md", None)
    parts = text.split("### All these runs together")
    series = [(first, *repeats) for first, (_, repeats) in SERIES.items()]
    present = [[name for name in names if (results / name).exists()] for names in series]
    assert len(parts) == 1 + len(series) and all(len(names) >= 2 for names in present)
    for names, part in zip(present, parts[1:]):  # only each series' last repeat pools it
        pooled = part.split("\n## ")[0]
        # Two runs a contender in each file, all in the pooled medians, judged from them.
        runs = 2 * len(names)
        assert f"| kv_aware | {runs} |" in pooled and f"| least_load | {runs} |" in pooled
        assert pooled.count("**PASS**") + pooled.count("**FAIL**") == 10
