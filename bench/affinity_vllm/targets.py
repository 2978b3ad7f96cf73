"""The targets for the real-engine leg, judged per load from the medians over the runs
(figures.aggregate): kv_aware against least_load, and against the best peer at the same load.

Against least_load: at 40 % of its saturation the hit rate ≥ 1.5× its, TTFT p50 ≤ 0.9× and p99 ≤
1.0×; at 60 % the hit rate ≥ 1.4×, p50 and p99 ≤ 1.0×. Against the peers: the hit rate ≥ 1.0× the
best peer's (the highest) and TTFT p50 ≤ 1.0× the best peer's (the lowest), each best taken
on its own figure, so both must beat every peer. Affinity that raises hits but lengthens the
queue is not a win: the TTFT bounds stand beside the hit-rate ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from .contenders import BASELINE, OURS, PEERS

# load share -> (hit rate at least, TTFT p50 at most, TTFT p99 at most), × least_load's
AGAINST_BASELINE = {0.4: (1.5, 0.9, 1.0), 0.6: (1.4, 1.0, 1.0)}
AGAINST_PEERS = (1.0, 1.0)  # hit rate at least, TTFT p50 at most, × the best peer's


@dataclass(frozen=True)
class Verdict:
    load: float
    target: str
    ours: float | None
    reference: float | None
    reference_name: str
    ratio: float | None
    bound: str  # "≥ 1.5×", "≤ 0.9×"
    verdict: str  # PASS, FAIL, not measured


def _judge(load: float, target: str, ours: float | None, reference: float | None, reference_name: str,
           bound: float, at_least: bool) -> Verdict:
    text = f"{'≥' if at_least else '≤'} {bound:g}×"
    if ours is None or not reference:
        return Verdict(load, target, ours, reference, reference_name, None, text, "not measured")
    ratio = ours / reference
    ok = ratio >= bound if at_least else ratio <= bound
    return Verdict(load, target, ours, reference, reference_name, round(ratio, 3), text, "PASS" if ok else "FAIL")


def _median(row: dict[str, Any] | None, key: str) -> float | None:
    return None if row is None else row[key]["median"]


def judge(results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """Every target at every load the results hold (the least_load ones only at their
    two loads)."""
    verdicts: list[Verdict] = []
    for load in dict.fromkeys(r["load"] for r in results):
        rows = {r["contender"]: r for r in results if r["load"] == load}
        ours, base = rows.get(OURS), rows.get(BASELINE)
        hit, p50, p99 = (_median(ours, k) for k in ("prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms"))
        bounds = AGAINST_BASELINE.get(round(load, 3))
        if bounds is not None:
            for target, mine, key, bound, at_least in (
                    ("hit rate", hit, "prefix_cache_hit_rate", bounds[0], True),
                    ("TTFT p50", p50, "ttft_p50_ms", bounds[1], False),
                    ("TTFT p99", p99, "ttft_p99_ms", bounds[2], False)):
                verdicts.append(_judge(load, target, mine, _median(base, key), BASELINE, bound, at_least))
        peers = [rows[name] for name in PEERS if name in rows]
        best_hit = max(peers, key=lambda r: _median(r, "prefix_cache_hit_rate") or 0.0, default=None)
        best_p50 = min(peers, key=lambda r: _median(r, "ttft_p50_ms") or float("inf"), default=None)
        verdicts.append(_judge(load, "hit rate vs the best peer", hit, _median(best_hit, "prefix_cache_hit_rate"),
                               best_hit["contender"] if best_hit else "no peer ran", AGAINST_PEERS[0], True))
        verdicts.append(_judge(load, "TTFT p50 vs the best peer", p50, _median(best_p50, "ttft_p50_ms"),
                               best_p50["contender"] if best_p50 else "no peer ran", AGAINST_PEERS[1], False))
    return verdicts


def as_records(verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]
