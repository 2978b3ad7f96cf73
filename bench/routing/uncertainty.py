"""How sure the checks are: ratios between contenders with paired bootstrap intervals.

A run's TTFT p99 is about its 3rd-slowest request, and the slowest requests of one run come
in clumps (one burst that found the slow instance full), so p99 moves a lot from repeat to
repeat. The checks compare medians over repeats; this module says how far those ratios could
move, and shows the same comparisons at p90 and p95, where a few clumps weigh less.

Paired: each resample draws repeat numbers with replacement and takes the same repeats of
both contenders, since contenders of one repeat ran minutes apart on the same machine.
Pure functions over the results' runs; seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Callable, Sequence

from bench.harness.stats import percentile, ratio
from bench.routing.summary import CHECK_SPECS, PER_WORKER, REFERENCE, pooled_ttfts

# The checks' comparisons, and what the per_worker ablation costs against the reference.
COMPARISONS = (*((a, b) for _, a, b, _, _ in CHECK_SPECS), (PER_WORKER, REFERENCE))
MEDIAN_OF_P99 = "median of per-repeat TTFT p99"
# name -> figure of a contender from its chosen repeats (a list of runs).
STATISTICS: dict[str, Callable[[Sequence[dict[str, Any]]], float | None]] = {
    MEDIAN_OF_P99: lambda runs: statistics.median(r["ttft_p99_ms"] for r in runs),
    "pooled TTFT p99": lambda runs: _pooled(runs, 0.99),
    "pooled TTFT p95": lambda runs: _pooled(runs, 0.95),
    "pooled TTFT p90": lambda runs: _pooled(runs, 0.90),
}
RESAMPLES = 2000
LEVEL = 0.90
SEED = 20261130


def _pooled(runs: Sequence[dict[str, Any]], q: float) -> float | None:
    samples = pooled_ttfts(runs)
    return percentile(samples, q) if samples else None


def paired_repeats(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Runs of the same repeat number that both measured TTFTs (a run that did not start, or
    answered nothing, has no pair)."""
    def usable(c: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {r["repeat"]: r for r in c.get("runs", [])
                if r.get("ttft_samples_ms") and r.get("ttft_p99_ms") is not None}
    runs_a, runs_b = usable(a), usable(b)
    return [(runs_a[k], runs_b[k]) for k in sorted(runs_a.keys() & runs_b.keys())]


def ratio_interval(pairs: list[tuple[dict[str, Any], dict[str, Any]]],
                   figure: Callable[[Sequence[dict[str, Any]]], float | None],
                   rng: random.Random, resamples: int = RESAMPLES,
                   level: float = LEVEL) -> tuple[float | None, float | None, float | None]:
    """(ratio over every pair, low, high) of figure(a) / figure(b); None where undefined.
    Needs at least 3 pairs for an interval (fewer resample to almost nothing)."""
    overall = ratio(figure([a for a, _ in pairs]), figure([b for _, b in pairs])) if pairs else None
    if len(pairs) < 3 or overall is None:
        return overall, None, None
    draws = []
    for _ in range(resamples):
        chosen = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        value = ratio(figure([a for a, _ in chosen]), figure([b for _, b in chosen]))
        if value is not None:
            draws.append(value)
    tail = (1 - level) / 2
    return overall, percentile(draws, tail), percentile(draws, 1 - tail)


def intervals(contenders: list[dict[str, Any]], resamples: int = RESAMPLES, level: float = LEVEL,
              seed: int = SEED) -> dict[str, Any]:
    """Every comparison under every statistic; comparisons with a missing contender are left out."""
    by_name = {c["name"]: c for c in contenders}
    rng = random.Random(seed)
    rows = []
    for a, b in COMPARISONS:
        if a not in by_name or b not in by_name:
            continue
        pairs = paired_repeats(by_name[a], by_name[b])
        for name, figure in STATISTICS.items():
            overall, low, high = ratio_interval(pairs, figure, rng, resamples, level)
            rows.append({"compares": [a, b], "statistic": name, "repeats": len(pairs),
                         "ratio": _round(overall), "low": _round(low), "high": _round(high)})
    return {"method": f"paired bootstrap over repeats, {resamples} resamples, "
                      f"{level:.0%} percentile interval, seed {seed}",
            "level": level, "rows": rows}


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 3)
