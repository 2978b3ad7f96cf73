"""Instance selection strategies, with the original Proxy's names, aliases and semantics.

A strategy sees the candidate list (alive instances, registration order) and, for least_load,
per-candidate load components: ``{"inflight": [3, 0, None], ...}`` aligned with the
candidates, where None means unknown (never zero). Cursors for rotation are injected: in a
worker they are fetch-adds on the shared header, so N workers rotate like one process.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence, TypeVar

from cacheroute_proxy.config import STRATEGY_ALIASES, ConfigError

T = TypeVar("T")
Cursor = Callable[[], int]
Components = Mapping[str, Sequence[float | None]]

# The original Proxy's default weights. A zero weight excludes the
# component. Layers: lifecycle (inflight); instantaneous queue (active_*, *_queue_depth);
# predicted reservation pressure (pending_prefill_count, active_decode_count, backlog ms:
# 1000 ms of predicted backlog weighs as much as one request in flight).
DEFAULT_WEIGHTS: dict[str, float] = {
    "inflight": 1.0,
    "active_prepare": 1.0,
    "active_ready": 1.0,
    "prepare_queue_depth": 0.25,
    "ready_queue_depth": 0.25,
    "pending_prefill_count": 1.0,
    "active_decode_count": 0.5,
    "predicted_total_backlog_ms": 0.001,
    "qps_1m": 0.0,
}


def _local_cursor() -> Cursor:
    return itertools.count().__next__


class RoundRobinStrategy:
    name = "round_robin"

    def __init__(self, cursor: Cursor | None = None) -> None:
        self._next = cursor or _local_cursor()

    def select(self, candidates: Sequence[T], components: Components | None = None) -> T:
        if not candidates:
            raise RuntimeError("no instances")
        return candidates[self._next() % len(candidates)]


class LeastLoadStrategy:
    name = "least_load"

    def __init__(self, weights: Mapping[str, float] | None = None, cursor: Cursor | None = None,
                 tie_cursor: Cursor | None = None) -> None:
        self.weights = resolve_weights(weights)
        self._active = tuple((k, w) for k, w in self.weights.items() if w != 0.0)
        self._fallback = RoundRobinStrategy(cursor)
        self._ties = RoundRobinStrategy(tie_cursor)
        self._summers: dict[tuple[float, ...], Callable[..., list[float]]] = {}

    def totals(self, count: int, components: Components | None) -> list[float | None]:
        """Score of each candidate; None where no weighted component is known."""
        present = [(components[name], weight) for name, weight in self._active
                   if components and name in components]
        if not present:
            return [None] * count
        lists = [values for values, _ in present]
        if not any(None in values for values in lists):
            return self._weighted_sum(tuple(weight for _, weight in present))(*lists)
        totals: list[float | None] = [None] * count
        for values, weight in present:
            for i, value in enumerate(values):
                if value is not None:
                    current = totals[i]
                    totals[i] = weight * value if current is None else current + weight * value
        return totals

    def _weighted_sum(self, weights: tuple[float, ...]) -> Callable[..., list[float]]:
        """`[x0*w0 + x1*w1 + ... for x0, x1, ... in zip(L0, L1, ...)]` compiled once per set of
        weights: one comprehension with the weights as constants is ~3x faster than summing
        component by component, and this runs on every least_load selection."""
        summer = self._summers.get(weights)
        if summer is None:
            n = len(weights)
            args = ", ".join(f"L{i}" for i in range(n))
            terms = " + ".join(f"x{i} * {float(w)!r}" for i, w in enumerate(weights))
            items = ", ".join(f"x{i}" for i in range(n)) + ("," if n == 1 else "")
            summer = eval(f"lambda {args}: [{terms} for {items} in zip({args})]")
            self._summers[weights] = summer
        return summer

    def select(self, candidates: Sequence[T], components: Components | None = None) -> T:
        if not candidates:
            raise RuntimeError("no instances")
        return self.select_by_totals(candidates, self.totals(len(candidates), components))

    def select_by_totals(self, candidates: Sequence[T], totals: list[float | None]) -> T:
        """Lowest known total; unknown totals dropped; all unknown -> round-robin; ties ->
        round-robin among them."""
        if None not in totals:
            best = min(totals)  # type: ignore[type-var]
        else:
            known = [t for t in totals if t is not None]
            if not known:  # nothing known about anyone
                return self._fallback.select(candidates)
            best = min(known)
        if totals.count(best) == 1:
            return candidates[totals.index(best)]
        return self._ties.select([c for c, t in zip(candidates, totals) if t == best])

    def explain(self, index: int, components: Components | None,
                sources: Mapping[str, str], queue_source: str) -> dict[str, Any]:
        """The full score object of the original: total, raw and weighted components,
        the source of each number and the weights."""
        raw: dict[str, float] = {}
        weighted: dict[str, float] = {}
        for name, weight in self._active:
            values = (components or {}).get(name)
            value = None if values is None else values[index]
            if value is None:
                continue
            raw[name] = value
            weighted[name] = weight * value
        return {
            "total": sum(weighted.values()) if weighted else None,
            "components": raw,
            "weighted_components": weighted,
            "source": {name: sources.get(name, "unavailable") for name in self.weights},
            "queue_source": queue_source,
            "weights": dict(self.weights),
        }


class Guard(NamedTuple):
    """Why the balance guard did or did not make kv_aware choose as least_load does."""
    fired: bool
    reason: str
    spread: int | None  # most - fewest requests in flight among the candidates
    fewest: int | None
    most: int | None


class Prediction(NamedTuple):
    """kv_aware's price of one candidate, in milliseconds: the request's predicted time to first
    token there, in its three parts, and what serving it there does to the caches."""
    queue_ms: float | None  # wait before its prefill could start; None: the predicted layer is unknown
    prefill_ms: float       # prefill of what the instance does not hold, at the instance's pace
    transfer_ms: float      # KDN -> instance transfer of the knowledge KV it does not hold
    displace_ms: float = 0.0  # away from the prompt's home: the prefill its blocks would save there

    @property
    def own_ms(self) -> float:
        """What the request itself costs there, whatever waits before it."""
        return self.prefill_ms + self.transfer_ms + self.displace_ms

    @property
    def total_ms(self) -> float | None:
        """The predicted time to first token."""
        return None if self.queue_ms is None else self.queue_ms + self.prefill_ms + self.transfer_ms

    @property
    def score_ms(self) -> float | None:
        """What kv_aware selects by: the predicted time to first token and the cache cost."""
        return None if self.queue_ms is None else self.queue_ms + self.own_ms


class KvAwareStrategy(LeastLoadStrategy):
    """The candidate with the lowest predicted time to first token (docs/architecture.md §4.4):
    queue wait, plus the prefill of the prompt tokens not already resident at the instance's
    measured pace, plus the KV transfer of the knowledge not already resident -- plus, away
    from the prompt's home, the prefill its blocks would save there (they would take the place
    of that instance's own prompts). Load and affinity in one unit: an instance holding the
    prefix wins unless its queue costs more than the prefill it saves. Ties rotate, as
    least_load's.

    Where the predicted layer is unknown (no fresh snapshot), least_load's score chooses and
    what the request itself costs breaks its ties. The balance guard, after SGLang's router,
    chooses as least_load does when the candidates' requests in flight spread by more than
    `balance_abs` AND the busiest holds more than `balance_rel` x the idlest's: a queue the
    prediction underrates cannot keep attracting what it holds."""

    name = "kv_aware"

    def __init__(self, weights: Mapping[str, float] | None = None, cursor: Cursor | None = None,
                 tie_cursor: Cursor | None = None, *, balance_abs: float = 4.0,
                 balance_rel: float = 1.5) -> None:
        super().__init__(weights, cursor, tie_cursor)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def guard(self, inflight: Sequence[int | None]) -> Guard:
        known = [n for n in inflight if n is not None]
        if len(known) < 2:
            return Guard(False, "fewer than two candidates with a known inflight", None,
                         min(known, default=None), max(known, default=None))
        fewest, most = min(known), max(known)
        spread = most - fewest
        if spread <= self.balance_abs:
            return Guard(False, f"inflight spread {spread} <= balance_abs {self.balance_abs:g}",
                         spread, fewest, most)
        if most <= self.balance_rel * fewest:
            return Guard(False, f"most inflight {most} <= balance_rel {self.balance_rel:g} x "
                         f"fewest {fewest}", spread, fewest, most)
        return Guard(True, f"inflight spread {spread} > balance_abs {self.balance_abs:g} and most "
                     f"{most} > balance_rel {self.balance_rel:g} x fewest {fewest}: least_load",
                     spread, fewest, most)

    def scores(self, totals: list[float | None], inflight: Sequence[int | None],
               predictions: Sequence[Prediction]) -> tuple[list[Any], Guard]:
        """What to select by (lowest wins, equal ones rotate): the predicted times to first
        token with the cache cost; least_load's totals if the guard fires; least_load's totals
        with the request's own cost as the tie-break where a prediction is unknown."""
        verdict = self.guard(inflight)
        if verdict.fired:
            return totals, verdict
        predicted = [p.score_ms for p in predictions]
        if None not in predicted:
            return predicted, verdict
        return [None if t is None else (t, p.own_ms) for t, p in zip(totals, predictions)], verdict

    def choose(self, candidates: Sequence[T], totals: list[float | None],
               inflight: Sequence[int | None], predictions: Sequence[Prediction]) -> tuple[T, Guard]:
        scores, verdict = self.scores(totals, inflight, predictions)
        return self.select_by_totals(candidates, scores), verdict


Strategy = RoundRobinStrategy | LeastLoadStrategy


def resolve_weights(overrides: Mapping[str, float] | None) -> dict[str, float]:
    weights = dict(DEFAULT_WEIGHTS)
    for name, value in (overrides or {}).items():
        if name not in DEFAULT_WEIGHTS:
            raise ConfigError(f"PROXY_LEAST_LOAD_WEIGHTS: unknown component {name!r}; "
                              f"known: {sorted(DEFAULT_WEIGHTS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ConfigError(f"PROXY_LEAST_LOAD_WEIGHTS: weight of {name!r} must be a finite number >= 0")
        weights[name] = float(value)
    return weights


def build_strategy(name: str, *, weights: Mapping[str, float] | None = None,
                   cursor: Cursor | None = None, tie_cursor: Cursor | None = None,
                   kv_aware: Mapping[str, float] | None = None) -> Strategy:
    """Factory with the original aliases; any other name is a ValueError at start.
    `kv_aware`: KvAwareStrategy's keyword settings (balance_abs, balance_rel)."""
    canonical = STRATEGY_ALIASES.get(name.strip().lower())
    if canonical == "round_robin":
        return RoundRobinStrategy(cursor)
    if canonical == "least_load":
        return LeastLoadStrategy(weights, cursor, tie_cursor)
    if canonical == "kv_aware":
        return KvAwareStrategy(weights, cursor, tie_cursor, **(kv_aware or {}))
    raise ValueError(f"unknown instance strategy {name!r}; choose one of {sorted(STRATEGY_ALIASES)}")
