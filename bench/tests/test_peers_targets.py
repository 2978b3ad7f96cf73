"""bench/peers/targets.py: the peer targets from one run's points: ratios of medians against
the right reference, bounds in the right direction, per-repeat ratios paired by repeat, and
"not measured" (never a PASS) when a contender is missing; and how the report renders them."""

from __future__ import annotations

from typing import Any

from bench.peers import summary, targets
from bench.report import peers as report


def _entry(name: str, kind: str, per_repeat: list[dict[str, float]]) -> dict[str, Any]:
    """A contender entry from per-repeat figures {rps, streams, cpu, p99, added_p50, and
    optionally long_streams, per_1m_tokens}."""
    runs: list[dict[str, Any]] = []
    for repeat, f in enumerate(per_repeat):
        runs.append({"scenario": "c1", "repeat": repeat, "added_p50_ms": f.get("added_p50")})
        runs.append({"scenario": "c32", "repeat": repeat, "rps": f["rps"], "p99_ms": f["p99"],
                     "cpu_s_per_1k": f["cpu"]})
        runs.append({"scenario": "stream32", "repeat": repeat, "streams_per_s": f["streams"]})
        if "per_1m_tokens" in f:
            runs.append({"scenario": "stream256", "repeat": repeat,
                         "streams_per_s": f["long_streams"], "cpu_s_per_1m_tokens": f["per_1m_tokens"]})
    return summary.contender_entry({"name": name, "kind": kind}, runs)


def _run(proxy_rps: list[float], proxy_added_p50: float = 0.15) -> list[dict[str, Any]]:
    proxy = _entry(targets.PROXY, "proxy", [
        {"rps": r, "streams": 1700.0, "cpu": 0.20, "p99": 9.0, "added_p50": proxy_added_p50,
         "long_streams": 90.0, "per_1m_tokens": 12.0} for r in proxy_rps])
    nginx = _entry(targets.NGINX, "nginx", [
        {"rps": 10000.0, "streams": 2100.0, "cpu": 0.05, "p99": 5.0, "added_p50": 0.1}] * 3)
    router = _entry(targets.ROUTER, "router", [
        {"rps": 7000.0, "streams": 1600.0, "cpu": 0.25, "p99": 10.0, "added_p50": 0.3,
         "long_streams": 100.0, "per_1m_tokens": 10.0}] * 3)
    return [proxy, nginx, router]


def _by_text(verdicts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["target"]: v for v in verdicts}


def test_ratio_targets_use_medians_and_the_right_reference() -> None:
    verdicts = _by_text(targets.targets(_run([8400.0, 7700.0, 6300.0])))
    vs_router = verdicts["req/s at c32 ≥ 1.0× vllm-router's"]
    assert vs_router["measured"] == 1.1 and vs_router["passed"] is True  # 7700 / 7000
    assert vs_router["per_repeat"] == [1.2, 1.1, 0.9]  # each repeat's own quotient, in order
    vs_nginx = verdicts["req/s at c32 ≥ 0.8× nginx's (2 workers)"]
    assert vs_nginx["measured"] == 0.77 and vs_nginx["passed"] is False
    assert vs_nginx["per_repeat"] == [0.84, 0.77, 0.63]
    assert verdicts["streams/s at c32 ≥ vllm-router's"]["passed"] is True  # 1700 / 1600
    cpu = verdicts["CPU s per 1,000 requests, whole tree ≤ vllm-router's"]
    assert cpu["measured"] == 0.8 and cpu["passed"] is True  # lower is better: <= 1.0
    p99 = verdicts["p99 at c32 ≤ vllm-router's"]
    assert p99["measured"] == 0.9 and p99["passed"] is True
    tokens = verdicts["CPU s per 1M relayed tokens ≤ vllm-router's"]
    assert tokens["measured"] == 1.2 and tokens["passed"] is False  # 12 / 10 s per 1M tokens
    assert verdicts["streams/s of 256 tokens ≥ vllm-router's"]["measured"] == 0.9
    added = verdicts["added p50 at c1 ≤ vllm-router's"]
    assert added["measured"] == 0.5 and added["passed"] is True  # 0.15 / 0.3 ms


def test_bounds_are_inclusive_and_absolute_targets_are_the_proxys_own_median() -> None:
    verdicts = _by_text(targets.targets(_run([7000.0] * 3, proxy_added_p50=0.2)))
    assert verdicts["req/s at c32 ≥ 1.0× vllm-router's"]["passed"] is True  # exactly 1.0
    added = verdicts["added p50 at c1 ≤ 0.2 ms"]
    assert added["measured"] == 0.2 and added["passed"] is True and added["versus"] is None
    assert added["per_repeat"] == [0.2, 0.2, 0.2]
    worse = _by_text(targets.targets(_run([7000.0] * 3, proxy_added_p50=0.21)))
    assert worse["added p50 at c1 ≤ 0.2 ms"]["passed"] is False


def test_a_missing_reference_is_not_measured_never_a_pass() -> None:
    without_router = [c for c in _run([9000.0] * 3) if c["name"] != targets.ROUTER]
    verdicts = _by_text(targets.targets(without_router))
    vs_router = verdicts["req/s at c32 ≥ 1.0× vllm-router's"]
    assert vs_router["passed"] is None and vs_router["measured"] is None
    assert vs_router["per_repeat"] == []
    assert verdicts["req/s at c32 ≥ 0.8× nginx's (2 workers)"]["passed"] is True
    no_proxy = [c for c in _run([9000.0] * 3) if c["name"] != targets.PROXY]
    assert all(v["passed"] is None for v in targets.targets(no_proxy))


def test_per_repeat_ratios_pair_only_repeats_both_ran() -> None:
    proxy, nginx, router = _run([5000.0, 6000.0, 7000.0])
    nginx["runs"] = [r for r in nginx["runs"] if r["repeat"] != 1]  # nginx missed repeat 1
    rows = targets.repeat_ratios([proxy, nginx, router])
    rps = next(r for r in rows if r["contender"] == targets.PROXY and r["figure"] == "c32 rps")
    assert rps["to_nginx"] == [0.5, 0.7] and rps["to_router"] == [0.714, 0.857, 1.0]
    assert {r["contender"] for r in rows} == {targets.PROXY, targets.NGINX, targets.ROUTER}


def test_the_report_renders_verdicts_and_per_repeat_ratios() -> None:
    contenders = _run([8400.0, 7700.0, 6300.0])
    text = report.targets_table(targets.targets(contenders))
    assert ("| req/s at c32 ≥ 1.0× vllm-router's | `proxy-w2-ll` | c32 rps | 1.10× | ≥ 1.00× "
            "| **PASS** | 1.20×, 1.10×, 0.90× |") in text
    assert ("| req/s at c32 ≥ 0.8× nginx's (2 workers) | `proxy-w2-ll` | c32 rps | 0.77× "
            "| ≥ 0.80× | **FAIL** |") in text
    assert ("| added p50 at c1 ≤ 0.2 ms | `proxy-w2-ll` | c1 added_p50_ms | 0.15 ms "
            "| ≤ 0.20 ms | **PASS** |") in text
    rows = report.repeat_ratios(targets.repeat_ratios(contenders))
    assert "| `proxy-w2-ll` | c32 rps | 0.84×, 0.77×, 0.63× | 1.20×, 1.10×, 0.90× |" in rows


def test_the_cpu_split_by_role_is_a_median_per_role_beside_the_tree() -> None:
    runs = [{"scenario": "c32", "repeat": i, "cpu_s_per_1k": tree,
             "cpu_s_per_1k_by_role": {"launcher": 0.001, "sidecar": side, "workers": tree - side}}
            for i, (tree, side) in enumerate([(0.5, 0.1), (0.4, 0.05), (0.6, 0.2)])]
    entry = summary.contender_entry({"name": "proxy-w2-ll", "kind": "proxy"}, runs)
    split = entry["median"]["cpu_s_per_1k_by_role"]
    assert split == {"req": {"launcher": 0.001, "sidecar": 0.1, "workers": 0.4}}
    text = report.cpu_split([entry])
    assert "| `proxy-w2-ll` | sidecar | 0.10 | – |" in text
    assert "| `proxy-w2-ll` | **whole tree** | 0.50 | – |" in text
    nginx = summary.contender_entry({"name": "nginx", "kind": "nginx"}, [
        {"scenario": "c32", "repeat": 0, "cpu_s_per_1k": 0.05}])
    assert nginx["median"]["cpu_s_per_1k_by_role"] == {} and report.cpu_split([nginx]) == ""
