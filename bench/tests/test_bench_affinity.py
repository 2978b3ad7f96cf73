"""bench/bench_affinity.py's workload and its report section, without processes."""

from __future__ import annotations

from collections import Counter

from bench import bench_affinity
from bench.bench_affinity import WORKLOADS
from bench.report import affinity


def test_the_targets_workload_is_seeded_bursty_one_id_a_request_and_zipf_popular():
    workload = WORKLOADS["knowledge64"]
    planned = bench_affinity.plan(workload, 3, 1500, 20.0)
    assert planned == bench_affinity.plan(workload, 3, 1500, 20.0) != bench_affinity.plan(workload, 4, 1500, 20.0)
    assert len(planned) == 1500 and all(len(p.kids) == 1 for p in planned)
    # The request sequence does not depend on the rate: the offline replay of it is the run's.
    assert [p.kids for p in bench_affinity.plan(workload, 3, 1500, 1.0)] == [p.kids for p in planned]
    # Bursts of 2 s at 1.65x the mean, then 2 s at 0.35x: the mean is the rate asked for.
    in_bursts = sum(1 for p in planned if int(p.at_s // 2) % 2 == 0)
    assert 3.5 < in_bursts / (len(planned) - in_bursts) < 6.0  # 1.65 / 0.35 = 4.7
    assert 0.9 < len(planned) / planned[-1].at_s / 20.0 < 1.1
    popular = Counter(k for p in planned for k in p.kids).most_common()
    assert len(popular) == 64
    # Zipf(0.6) over 64: rank 1 about 12x rank 64, far flatter than the mixed workload's 1.1.
    assert 5 < popular[0][1] / popular[-1][1] < 30


def test_the_mixed_workload_names_one_to_three_ids_or_a_shared_system_prompt():
    planned = bench_affinity.plan(WORKLOADS["mixed200"], 3, 1000, 10.0)
    knowledge = [p for p in planned if p.kids]
    assert all(1 <= len(p.kids) <= 3 and len(set(p.kids)) == len(p.kids) for p in knowledge)
    assert 0.65 < len(knowledge) / len(planned) < 0.85


def test_fair_shares_weigh_each_instance_by_its_speed():
    assert bench_affinity.fair_shares() == {"inst-0": 0.2, "inst-1": 0.4, "inst-2": 0.4}


def _row(name: str, hit: float, p50: float, p99: float, fair: float) -> dict:
    return {"contender": name, "resident_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "max_share_over_fair": fair, "requests": 10, "ok": 10, "share": {"a": 5, "b": 5},
            "kdn_bytes": 2e9, "guard_fired": 1, "guard_decisions": 10, "saved_ms_p50": 42.0}


def test_the_section_checks_the_targets_from_the_rows_and_names_the_ceiling():
    rows = [_row(affinity.SHARED, 0.60, 60.0, 900.0, 1.2), _row(affinity.ONE, 0.62, 58.0, 880.0, 1.1),
            _row(affinity.PER_WORKER, 0.40, 90.0, 1000.0, 1.1), _row(affinity.LEAST_LOAD, 0.30, 120.0, 950.0, 1.0)]
    checks = affinity.targets({r["contender"]: r for r in rows})
    assert [ok for _, _, ok in checks] == [True, True, False, True, True, True]  # p99 900/950 > 0.9
    data = {"results": rows, "requests": 10, "workload": {"name": "knowledge64", "burst": [1.65, 0.35]},
            "replayed_without_load": {"random": 0.5, "holder_first": 0.75, "holder_first_over_random": 1.5},
            "calibration": {"saturation_rps": 30.0, "concurrency": 48, "seconds": 15}}
    text = affinity.section(data)
    assert "60%" in text and "**FAIL**" in text and "1 of 10" in text and "Targets:" in text
    assert "reaches 80% of that ceiling" in text and "closed loop of 48 streams" in text
    legacy = affinity.section({**data, "workload": {"name": "mixed200"}}, "affinity_mixed200.json")
    assert "no targets" in legacy and "Targets:" not in legacy


def test_repeated_runs_are_judged_by_their_medians_and_shown_run_by_run():
    runs = [{**_row(affinity.SHARED, hit, p50, p99, 1.1), "requests": 1500, "ok": ok, "errors": errors,
             "share": {"inst-0": a, "inst-1": 1500 - a}, "run": n}
            for n, (hit, p50, p99, ok, errors, a) in enumerate([(0.90, 20.0, 1900.0, 1500, [], 200),
                                                                 (0.80, 25.0, 2900.0, 1499, ["boom"], 300),
                                                                 (0.85, 22.0, 1700.0, 1500, [], 250)])]
    [row] = affinity.medians(runs)
    assert (row["resident_hit_rate"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (0.85, 22.0, 1900.0)
    assert row["share"] == {"inst-0": 250, "inst-1": 1250} and (row["requests"], row["ok"]) == (4500, 4499)
    assert row["errors"] == ["boom"] and row["runs"]["resident_hit_rate"] == [0.90, 0.80, 0.85]
    text = affinity.section({"results": runs, "repeats": 3, "requests": 1500,
                             "workload": {"name": "mixed200"}}, "affinity_mixed200.json")
    assert "median of 3 runs" in text and "90% / 80% / 85%" in text and "1,900 / 2,900 / 1,700" in text
