"""Statistics the benchmarks report."""

from __future__ import annotations

import math


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


