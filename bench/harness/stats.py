"""Statistics the benchmarks report, one definition each: percentiles, medians, ratios."""

from __future__ import annotations

import math
import statistics
from typing import Iterable


def percentile(values: list[float], q: float, *, method: str = "nearest_rank") -> float:
    """The q-quantile (0..1) of a non-empty list, one of its values.

    "nearest_rank": the ceil(q*n)-th smallest, the usual definition (the soak).
    "floor_index": sorted(values)[int(q*n)], one rank higher whenever q*n is a whole number;
    bench_pressure has always reported this one, so its numbers stay comparable.
    """
    ordered = sorted(values)
    if method == "nearest_rank":
        index = math.ceil(q * len(ordered)) - 1
    elif method == "floor_index":
        index = int(q * len(ordered))
    else:
        raise ValueError(f"unknown percentile method {method!r}")
    return ordered[min(len(ordered) - 1, max(0, index))]


def median(values: Iterable[float | None], digits: int | None = 4) -> float | None:
    """The median of the known values (None ones left out), rounded to `digits` (None: not
    rounded); None when no value is known."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    middle = statistics.median(known)
    return middle if digits is None else round(middle, digits)


def ratio(value: float | None, base: float | None, digits: int | None = None) -> float | None:
    """value / base, rounded to `digits` (None: not rounded); None where either is unknown or
    the base is not positive (an added latency at or below zero has no meaningful ratio)."""
    if value is None or base is None or base <= 0:
        return None
    quotient = value / base
    return quotient if digits is None else round(quotient, digits)
