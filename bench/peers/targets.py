"""The peer targets, computed from one bench-peers run on one backend: this proxy (2 workers,
least_load) against nginx (least_conn, 2 workers) and vllm-router (power_of_two), each verdict
from the run's medians, with every repeat's ratios listed beside it (a median that passes while
repeats disagree is worth seeing).

A target is either a ratio (the proxy's median / the reference's median, bounded) or an
absolute bound on the proxy's median. Per repeat: the same quotient over the two contenders'
points of that repeat, so both sides of a ratio were measured minutes apart at most.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

from bench.harness.stats import median, ratio

PROXY = "proxy-w2-ll"
NGINX = "nginx"
ROUTER = "vllm-router-p2"
# Not judged against: the floor under the proxy (bench/peers/relay_floor.py), for ratios only.
FLOOR = "relay-floor-w2"


@dataclass(frozen=True)
class Target:
    text: str
    scenario: str            # the points it reads
    key: str                 # the figure in each point
    bound: float
    at_least: bool           # True: value >= bound; False: value <= bound
    versus: str | None = None  # None: an absolute bound on the proxy's own median

    def holds(self, value: float) -> bool:
        compare: Callable[[float, float], bool] = operator.ge if self.at_least else operator.le
        return compare(value, self.bound)


TARGETS = (
    Target("req/s at c32 ≥ 1.0× vllm-router's", "c32", "rps", 1.0, True, ROUTER),
    Target("req/s at c32 ≥ 0.8× nginx's (2 workers)", "c32", "rps", 0.8, True, NGINX),
    Target("streams/s at c32 ≥ vllm-router's", "stream32", "streams_per_s", 1.0, True, ROUTER),
    Target("streams/s of 256 tokens ≥ vllm-router's", "stream256", "streams_per_s", 1.0, True,
           ROUTER),
    Target("CPU s per 1M relayed tokens ≤ vllm-router's", "stream256", "cpu_s_per_1m_tokens", 1.0,
           False, ROUTER),
    Target("CPU s per 1,000 requests, whole tree ≤ vllm-router's", "c32", "cpu_s_per_1k", 1.0,
           False, ROUTER),
    Target("added p50 at c1 ≤ 0.2 ms", "c1", "added_p50_ms", 0.2, False),
    Target("added p50 at c1 ≤ vllm-router's", "c1", "added_p50_ms", 1.0, False, ROUTER),
    Target("p99 at c32 ≤ vllm-router's", "c32", "p99_ms", 1.0, False, ROUTER),
)
# The figures whose per-repeat ratios to nginx and to vllm-router are listed for every contender.
RATIO_FIGURES = (("c32", "rps"), ("stream32", "streams_per_s"), ("c32", "cpu_s_per_1k"),
                 ("c32", "p99_ms"), ("stream256", "cpu_s_per_1m_tokens"))


def by_repeat(entry: dict[str, Any] | None, scenario: str, key: str) -> dict[int, float]:
    """{repeat: figure} of one contender's points of one scenario (one point per repeat)."""
    if entry is None:
        return {}
    return {r["repeat"]: r[key] for r in entry.get("runs", [])
            if r.get("scenario") == scenario and r.get(key) is not None and "repeat" in r}


def per_repeat_ratios(entry: dict[str, Any] | None, base: dict[str, Any] | None,
                      scenario: str, key: str) -> list[float | None]:
    """entry / base for each repeat both were measured in, in repeat order."""
    mine, theirs = by_repeat(entry, scenario, key), by_repeat(base, scenario, key)
    return [ratio(mine[r], theirs[r], 3) for r in sorted(set(mine) & set(theirs))]


def evaluate(target: Target, entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One target's verdict: measured (the ratio of medians, or the proxy's median), per_repeat
    (ratios, or values), passed (None when a contender it needs did not run)."""
    proxy = entries.get(PROXY)
    mine = by_repeat(proxy, target.scenario, target.key)
    if target.versus is None:
        measured = median(list(mine.values()))
        per_repeat: list[float | None] = [mine[r] for r in sorted(mine)]
    else:
        base = entries.get(target.versus)
        theirs = by_repeat(base, target.scenario, target.key)
        measured = ratio(median(list(mine.values())), median(list(theirs.values())), 3)
        per_repeat = per_repeat_ratios(proxy, base, target.scenario, target.key)
    return {"target": target.text, "contender": PROXY, "versus": target.versus,
            "figure": f"{target.scenario} {target.key}", "bound": target.bound,
            "at_least": target.at_least, "measured": measured, "per_repeat": per_repeat,
            "passed": None if measured is None else target.holds(measured)}


def targets(contenders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    entries = {c["name"]: c for c in contenders}
    return [evaluate(t, entries) for t in TARGETS]


def repeat_ratios(contenders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every contender but direct and each of RATIO_FIGURES: its per-repeat ratio to nginx
    and to vllm-router (empty lists where one of them did not run)."""
    entries = {c["name"]: c for c in contenders}
    rows = []
    for c in contenders:
        if c.get("kind") == "direct":
            continue
        for scenario, key in RATIO_FIGURES:
            rows.append({"contender": c["name"], "figure": f"{scenario} {key}",
                         "to_nginx": per_repeat_ratios(c, entries.get(NGINX), scenario, key),
                         "to_router": per_repeat_ratios(c, entries.get(ROUTER), scenario, key)})
    return rows
