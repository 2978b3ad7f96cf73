"""The seeded arrival schedule: bursts of streaming requests with Poisson gaps between bursts.

Pure (no clock, no I/O) so every contender replays exactly the same list, and a unit test can
check it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    at_s: float          # offset from the start of the run
    burst: int           # index of the burst it belongs to
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class ScheduleSpec:
    duration_s: float = 35.0
    # Bursts form a Poisson process: exponential gaps with this mean.
    burst_gap_mean_s: float = 1.0
    # Requests per burst, drawn uniformly from this inclusive range.
    burst_size: tuple[int, int] = (2, 10)
    # Spacing of the requests inside one burst (0: all at the same instant).
    intra_burst_gap_s: float = 0.0
    # (value, weight) mixes for the output and prompt lengths.
    max_tokens_mix: tuple[tuple[int, float], ...] = ((16, 0.5), (64, 0.3), (256, 0.2))
    prompt_tokens_mix: tuple[tuple[int, float], ...] = ((32, 0.5), (128, 0.3), (512, 0.2))
    seed: int = 20261130


def build_schedule(spec: ScheduleSpec) -> list[Arrival]:
    """Every arrival of one run, sorted by time; identical for identical specs."""
    rng = random.Random(spec.seed)
    arrivals: list[Arrival] = []
    t, burst = rng.expovariate(1.0 / spec.burst_gap_mean_s), 0
    while t < spec.duration_s:
        for k in range(rng.randint(*spec.burst_size)):
            arrivals.append(Arrival(at_s=t + k * spec.intra_burst_gap_s, burst=burst,
                                    prompt_tokens=_draw(rng, spec.prompt_tokens_mix),
                                    max_tokens=_draw(rng, spec.max_tokens_mix)))
        burst += 1
        t += rng.expovariate(1.0 / spec.burst_gap_mean_s)
    return sorted(arrivals, key=lambda a: a.at_s)


def _draw(rng: random.Random, mix: tuple[tuple[int, float], ...]) -> int:
    values, weights = zip(*mix, strict=True)
    return rng.choices(values, weights=weights)[0]


def offered_load(arrivals: list[Arrival], duration_s: float) -> dict[str, float]:
    """What the schedule asks for, to record next to the results."""
    count = len(arrivals)
    return {
        "requests": count,
        "bursts": len({a.burst for a in arrivals}),
        "mean_rate_per_s": count / duration_s if duration_s else 0.0,
        "mean_max_tokens": sum(a.max_tokens for a in arrivals) / count if count else 0.0,
        "mean_prompt_tokens": sum(a.prompt_tokens for a in arrivals) / count if count else 0.0,
    }
