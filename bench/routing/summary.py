"""From raw observations to figures: one run's summary, medians over repeats, ratios to nginx,
and the routing checks. Pure functions over plain data (unit-testable)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Sequence

from bench.harness.stats import median, percentile, ratio
from bench.routing.client import RequestResult
from bench.routing.sampler import Samples

REFERENCE = "proxy-1w-least_load"
SHARED = "proxy-4w-least_load-shared"
PER_WORKER = "proxy-4w-least_load-per_worker"
ROUND_ROBIN = "proxy-4w-round_robin"
NGINX = "nginx-least_conn"

# Medians over repeats are taken of these (lower is better for all but the shares).
MEDIAN_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "total_p50_ms", "total_p99_ms",
                  "inflight_spread_mean", "inflight_spread_p95", "errors", "error_rate",
                  "contender_cpu_util", "worker_cpu_peak", "client_late_p99_ms")
RATIO_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "total_p99_ms", "inflight_spread_mean",
                 "inflight_spread_p95")
SERIES_POINTS = 400  # per run, enough for a plot, small enough for the JSON


def _q(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


def summarize_requests(results: list[RequestResult], labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Client-side figures; `labels` names instances (id -> label) in the per-instance TTFT."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    total = [r.total_ms for r in ok if r.total_ms is not None]
    late = [r.late_ms for r in results]
    errors = Counter(r.error for r in results if not r.ok)
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
        "error_kinds": dict(errors.most_common(5)),
        "ttft_p50_ms": _q(ttft, 0.5), "ttft_p90_ms": _q(ttft, 0.9), "ttft_p99_ms": _q(ttft, 0.99),
        "ttft_max_ms": max(ttft) if ttft else None,
        "total_p50_ms": _q(total, 0.5), "total_p99_ms": _q(total, 0.99),
        "client_late_p99_ms": _q(late, 0.99),
        "ttft_p99_by_instance_ms": _by_instance(ok, labels or {}),
        # Every TTFT of the run (small: a few hundred), for distribution charts and pooled figures.
        "ttft_samples_ms": sorted(round(v, 1) for v in ttft),
    }


def _by_instance(ok: list[RequestResult], labels: dict[str, str]) -> dict[str, float | None]:
    """TTFT p99 per instance, from the instance the response headers name (both this proxy and
    nginx pass them); tells whether the tail comes from the slow instance."""
    groups: dict[str, list[float]] = {}
    for r in ok:
        if r.instance is not None and r.ttft_ms is not None:
            groups.setdefault(labels.get(r.instance, r.instance), []).append(r.ttft_ms)
    return {name: _q(values, 0.99) for name, values in sorted(groups.items())}


def summarize_samples(samples: Samples, in_window: int | None = None) -> dict[str, Any]:
    """Spread statistics over the first `in_window` samples (the arrival window; None: all);
    the series keeps every sample (downsampled) for the plot."""
    measured = samples.inflight if in_window is None else samples.inflight[:in_window]
    spreads = [max(v) - min(v) for v in measured if v]
    step = max(1, len(samples.inflight) // SERIES_POINTS)
    peaks = [max(vals) for vals in samples.worker_cpu.values() if vals]
    means = [statistics.fmean(vals) for vals in samples.worker_cpu.values() if vals]
    return {
        "inflight_samples": len(spreads), "inflight_failed_polls": samples.failed_polls,
        "inflight_spread_mean": round(statistics.fmean(spreads), 3) if spreads else None,
        "inflight_spread_p95": _q([float(s) for s in spreads], 0.95),
        "inflight_spread_max": max(spreads) if spreads else None,
        # Worker CPU in units of one core over ~1 s intervals (the reference must not be CPU-bound).
        "worker_cpu_peak": round(max(peaks), 3) if peaks else None,
        "worker_cpu_mean": round(statistics.fmean(means), 3) if means else None,
        "series": {"t_s": samples.times_s[::step], "inflight": samples.inflight[::step],
                   "every_nth_sample": step},
    }


def instance_shares(totals: list[int], labels: list[str]) -> dict[str, Any]:
    """Requests counted at the instances themselves during the run."""
    whole = sum(totals)
    return {"instance_requests": dict(zip(labels, totals, strict=True)),
            "share": {label: (n / whole if whole else 0.0) for label, n in zip(labels, totals, strict=True)}}


def medians(runs: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in MEDIAN_METRICS:
        out[metric] = median(r.get(metric) for r in runs)
    # Context for the noisy median-of-p99 (the checks use the median).
    out["ttft_p99_pooled_ms"] = _q(pooled_ttfts(runs), 0.99)
    for label in labels:
        out[f"share_{label}"] = median(r.get("share", {}).get(label) for r in runs)
        out[f"ttft_p99_ms_{label}"] = median(r.get("ttft_p99_by_instance_ms", {}).get(label) for r in runs)
    return out


def pooled_ttfts(runs: Sequence[dict[str, Any]]) -> list[float]:
    """Every TTFT of these runs in one list."""
    return [v for r in runs for v in r.get("ttft_samples_ms", [])]


def ratios_to_nginx(contenders: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = next((c["median"] for c in contenders if c["kind"] == "nginx"), None)
    if base is None:
        return {}
    out = {}
    for c in contenders:
        out[c["name"]] = {m: ratio(c["median"].get(m), base.get(m), 4) for m in RATIO_METRICS}
    return out


# The claims checked: (name, contender, compared with, threshold, threshold inclusive).
CHECK_SPECS: tuple[tuple[str, str, str, float, bool], ...] = (
    ("4 workers least_load shared: TTFT p99 within 10 % of the 1-worker reference "
     "(ratio shared / reference <= 1.10)", SHARED, REFERENCE, 1.10, True),
    ("4 workers least_load shared beats per_worker on TTFT p99 (ratio shared / per_worker < 1)",
     SHARED, PER_WORKER, 1.0, False),
    ("4 workers least_load shared beats round_robin on TTFT p99 (ratio shared / round_robin < 1)",
     SHARED, ROUND_ROBIN, 1.0, False),
)


def checks(contenders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The claims about TTFT p99 (medians over repeats); a missing contender gives a
    check with value and pass None (not measured)."""
    p99 = {c["name"]: c["median"].get("ttft_p99_ms") for c in contenders}
    # TTFTs come from answered requests only: a contender that failed some could look better
    # than it is, so the contender a claim is about must have failed none.
    failed = {c["name"]: sum((r.get("errors") or 0) for r in c.get("runs", [])) for c in contenders}
    out = []
    for name, a, b, threshold, inclusive in CHECK_SPECS:
        value = ratio(p99.get(a), p99.get(b), 4)
        # None: not measured (a contender left out or without TTFTs) -- neither pass nor fail.
        passed = None if value is None else (value <= threshold if inclusive else value < threshold)
        if passed and failed.get(a):
            passed = False
        out.append({"name": name, "value": value, "threshold": threshold, "pass": passed,
                    "compares": [a, b], "failed_requests": failed.get(a)})
    return out


def validity(contenders: list[dict[str, Any]], cpu_limit: float = 0.7) -> list[dict[str, Any]]:
    """Conditions under which the checks mean what they claim: the 1-worker reference is not
    CPU-bound (else it measures CPU, not routing) and nothing failed."""
    out = []
    ref = next((c for c in contenders if c["name"] == REFERENCE), None)
    if ref is not None:
        peak = ref["median"].get("worker_cpu_peak")
        out.append({"name": f"1-worker reference not CPU-bound (peak worker CPU over 1 s "
                            f"intervals, median over repeats, <= {cpu_limit} core)",
                    "value": peak, "threshold": cpu_limit,
                    "pass": peak is not None and peak <= cpu_limit})
    for c in contenders:
        runs = c.get("runs", [])
        # Summed, not a median: one bad repeat must show. A run that did not start counts.
        errors = sum((r.get("errors") or 0) + ("start_error" in r) for r in runs) if runs \
            else c["median"].get("errors")
        out.append({"name": f"{c['name']}: no failed requests (summed over repeats)",
                    "value": errors, "threshold": 0, "pass": errors == 0})
    return out
