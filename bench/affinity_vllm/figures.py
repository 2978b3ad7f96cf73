"""The figures (pure): the calibration's saturation throughput, one run's summary, and per load
and contender the medians over its runs with their spread."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Sequence

from bench.harness.stats import percentile

from .load import Outcome


def saturation_rps(outcomes: Sequence[Outcome], concurrency: int) -> float:
    """Completed requests per second of a closed loop with `concurrency` in flight, over its
    steady part: from the `concurrency`-th answered request to the `concurrency`-th from last.
    The first ones started together on cold caches, and after the last send the loop drains
    with fewer in flight; between, every slot is taken as soon as it frees."""
    ends = sorted(o.ended_at for o in outcomes if answered(o) and o.ended_at is not None)
    steady = len(ends) - 2 * concurrency
    if steady < 1:
        raise ValueError(f"{len(ends)} answered requests: need more than {2 * concurrency} "
                         f"to measure past the start and the drain of {concurrency} in flight")
    return steady / (ends[-concurrency - 1] - ends[concurrency - 1])


def answered(outcome: Outcome) -> bool:
    return outcome.error is None and outcome.ttft_ms is not None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    """One run as the client saw it: answered, errors (by kind), TTFT p50/p99 (ms, answered
    requests), completed per second (answered / first send to last end), and for this proxy's
    kv_aware how often the guard fired, how many choices went where the prompt saved time (and
    the median saving), the median TTFT it predicted for its choices, and how closely each
    prompt kept to one instance; and this proxy's means of the time before forwarding (and of it,
    choosing the instance) and of the time outside the worker (the client's TTFT less the
    worker's)."""
    ok = [o for o in outcomes if answered(o)]
    failed = [o.error or "no first token" for o in outcomes if not answered(o)]
    ttft = [o.ttft_ms for o in ok]
    guards = [o.guard for o in ok if o.guard is not None]
    saved = [o.saved_ms for o in ok if o.saved_ms is not None]
    predicted = [o.predicted_ttft_ms for o in ok if o.predicted_ttft_ms is not None]
    return {
        "requests": len(outcomes), "ok": len(ok), "error_count": len(outcomes) - len(ok),
        "errors": dict(Counter(failed).most_common(5)),
        "ttft_p50_ms": _round(percentile(ttft, 0.5) if ttft else None),
        "ttft_p99_ms": _round(percentile(ttft, 0.99) if ttft else None),
        "ttft_mean_ms": _round(statistics.fmean(ttft) if ttft else None),
        "wall_s": round(wall_s, 2),
        "completed_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "guard_fired": sum(guards), "guard_decisions": len(guards),
        "saved": sum(1 for ms in saved if ms > 0),
        "saved_ms_p50": _round(statistics.median(saved) if saved else None),
        "predicted_ttft_p50_ms": _round(statistics.median(predicted) if predicted else None),
        "prompt_concentration": prompt_concentration(ok),
        "before_forward_mean_ms": _mean([o.before_forward_ms for o in ok]),
        "select_mean_ms": _mean([o.select_ms for o in ok]),
        "outside_worker_mean_ms": _mean([o.outside_ms for o in ok]),
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return _round(statistics.fmean(known), 2) if known else None


def prompt_concentration(outcomes: Sequence[Outcome]) -> float | None:
    """The share of requests sent to the instance that answered most of their system prompt's
    requests: 1.0 when each prompt stays on one instance. None without the instances (a peer's
    answers do not name theirs)."""
    by_prompt: dict[int, Counter[str]] = {}
    for o in outcomes:
        if o.instance is not None and o.system is not None:
            by_prompt.setdefault(o.system, Counter())[o.instance] += 1
    placed = sum(sum(c.values()) for c in by_prompt.values())
    return round(sum(max(c.values()) for c in by_prompt.values()) / placed, 4) if placed else None


def cpu_figures(cpu_s: float, by_role: dict[str, float], answered: int) -> dict[str, Any]:
    """The contender's CPU over the run: seconds, and milliseconds per answered request (whole
    tree and by role)."""
    figures: dict[str, Any] = {"cpu_s": round(cpu_s, 3),
                               "cpu_ms_per_request": round(cpu_s / answered * 1000, 3) if answered else None}
    if by_role:
        figures["cpu_ms_per_request_by_role"] = {role: round(s / answered * 1000, 3) if answered else None
                                                 for role, s in sorted(by_role.items())}
    return figures


SPREAD_KEYS = ("prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "engine_ttft_mean_ms",
               "completed_per_s", "cpu_ms_per_request")


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the runs' figures (None when no run had one)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": round(statistics.median(present), 4), "min": min(present), "max": max(present),
            "runs": list(values)}


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (load, contender), in the order first run: the medians over its runs and their
    spread (SPREAD_KEYS), errors and requests summed, each engine's share summed."""
    out = []
    for load, name in dict.fromkeys((r["load"], r["contender"]) for r in runs):
        mine = [r for r in runs if r["load"] == load and r["contender"] == name]
        share = [sum(r["share"][i] for r in mine) for i in range(len(mine[0]["share"]))]
        out.append({"load": load, "contender": name, "runs": len(mine),
                    "requests": sum(r["requests"] for r in mine), "ok": sum(r["ok"] for r in mine),
                    "errors": sum(r["error_count"] for r in mine), "share": share,
                    "guard_fired": sum(r.get("guard_fired", 0) for r in mine),
                    "guard_decisions": sum(r.get("guard_decisions", 0) for r in mine),
                    **{key: spread([r.get(key) for r in mine]) for key in SPREAD_KEYS}})
    return out
