"""bench/bench_affinity.py's workload and its report section, without processes."""

from __future__ import annotations

from collections import Counter

from bench import bench_affinity
from bench.report import affinity


def test_the_workload_is_seeded_bursty_and_zipf_popular():
    planned = bench_affinity.plan(3, 40.0, 14.0, 3.0)
    assert planned == bench_affinity.plan(3, 40.0, 14.0, 3.0) != bench_affinity.plan(4, 40.0, 14.0, 3.0)
    knowledge = [p for p in planned if p.kids]
    assert all(1 <= len(p.kids) <= 3 and len(set(p.kids)) == len(p.kids) for p in knowledge)
    assert 0.65 < len(knowledge) / len(planned) < 0.85
    in_bursts = sum(1 for p in planned if int(p.at_s // 2) % 2 == 0)
    assert in_bursts > 2.5 * (len(planned) - in_bursts)  # 14/s against 3/s
    popular = Counter(k for p in knowledge for k in p.kids).most_common()
    assert popular[0][1] > 5 * popular[len(popular) // 2][1]  # a head and a long tail


def _row(name: str, hit: float, p50: float, p99: float, peak: float) -> dict:
    return {"contender": name, "resident_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "max_share_over_mean": peak, "requests": 10, "ok": 10, "share": {"a": 5, "b": 5},
            "kdn_bytes": 2e9, "guard_fired": 1, "guard_decisions": 10}


def test_the_section_checks_the_issue_targets_from_the_rows():
    rows = {r["contender"]: r for r in (
        _row(affinity.SHARED, 0.60, 60.0, 900.0, 1.2), _row(affinity.ONE, 0.62, 58.0, 880.0, 1.1),
        _row(affinity.PER_WORKER, 0.40, 90.0, 1000.0, 1.1), _row(affinity.LEAST_LOAD, 0.30, 120.0, 800.0, 1.0))}
    checks = {name: ok for name, _, ok in affinity.targets(rows)}
    assert list(checks.values()) == [True, True, True, False, True, True]  # p99 900 > 800
    text = affinity.section({"results": list(rows.values()), "requests": 10})
    assert "60%" in text and "**FAIL**" in text and "1 of 10" in text
    replayed = {"random": 0.5, "holder_first": 0.62, "holder_first_over_random": 1.24}
    with_ceiling = affinity.targets(rows, replayed)
    assert with_ceiling[1][1:] == ("1.24", False) and len(with_ceiling) == 7
    text = affinity.section({"results": list(rows.values()), "replayed_without_load": replayed})
    assert "routing at random reaches 50%" in text and "1.24× as much" in text
    assert "find every id" not in text  # a results file from before the whole-hit count
    replayed.update(whole_random=0.55, whole_holder_first=0.7)
    text = affinity.section({"results": list(rows.values()), "replayed_without_load": replayed})
    assert "55% find every id already held" in text and "(70% routed to the holder)" in text
