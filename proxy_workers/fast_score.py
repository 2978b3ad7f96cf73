"""The least_load score of every candidate in one generated comprehension.

The generic path (LoadView.components + LeastLoadStrategy.totals) builds a list per component
and then sums them; in Python that is ~25 us for 16 instances. Selection runs on
every request, and the candidate set changes only when the directory does, so this module
compiles, once per directory snapshot and weight set, a function whose body is the whole
weighted sum with every offset and weight as a constant:

    [(L[0] & M) * 1.0 + (L[1] & M) * 1.0 + ... + R[1] * 1.0 + R[2] * 0.5
     + (max(R[3], R[4], now) - now + max(0, (L[0] & M) - R[1] - R[2]) * R[6]) * 1e-06, ...]

over the flat lane words (one struct call) and the flat snapshot records (cached on the
snapshot generation). It returns None whenever its assumptions do not hold (a slot changed
generation, a record describes another generation), and the caller then takes the generic
path, so both always agree; tests/test_fast_score.py checks that they do.
"""

from __future__ import annotations

from typing import Callable, Sequence

from shm_schema import layout
from shm_schema.bitfields import CounterWord
from shm_schema.records import SNAPSHOT

from cacheroute_proxy.routing.strategies import LeastLoadStrategy

Scorer = Callable[[Sequence[int], Sequence[int] | None, int], list[float] | None]

# Component -> (table, field) in the generated code: L = lane words, R = snapshot records.
_LANE_FIELDS = {"inflight": 0, "active_ready": 1, "active_prepare": 2, "prepare_queue_depth": 3,
                "ready_queue_depth": 4}
_RECORD_FIELDS = {"pending_prefill_count": 1, "active_decode_count": 2}
_SUPPORTED = {*_LANE_FIELDS, *_RECORD_FIELDS, "predicted_total_backlog_ms"}


def compile_scorer(strategy: LeastLoadStrategy, slots: Sequence[int],
                   generations: Sequence[int]) -> Scorer | None:
    """A scorer for these candidates, or None if the weights need the generic path."""
    weights = {name: w for name, w in strategy.weights.items() if w}
    if not slots or not set(weights) <= _SUPPORTED:
        return None
    used, fields = layout.LANES_USED, SNAPSHOT.count
    mask = CounterWord.COUNT_MASK
    lane_gens = ", ".join(f"L[{used * s}] >> 32" for s in slots)
    record_gens = ", ".join(f"R[{fields * s}]" for s in slots)
    queue_terms, full_terms = [], []
    for s in slots:
        queue = [_weighted(f"(L[{used * s + f}] & {mask})", weights[n])
                 for n, f in _LANE_FIELDS.items() if n in weights]
        predicted = [_weighted(f"R[{fields * s + f}]", weights[n])
                     for n, f in _RECORD_FIELDS.items() if n in weights]
        if "predicted_total_backlog_ms" in weights:  # microseconds, weighted per ms
            scale = weights["predicted_total_backlog_ms"] / 1000
            r = fields * s
            # Time until free, plus the unannounced requests (inflight - pending - decoding)
            # at the marginal cost each (load_view._unannounced_backlog_ms).
            unseen = f"max(0, (L[{used * s}] & {mask}) - R[{r + 1}] - R[{r + 2}]) * R[{r + 6}]"
            predicted.append(f"(max(R[{r + 3}], R[{r + 4}], now) - now + {unseen}) * {scale!r}")
        queue_terms.append(" + ".join(queue) or "0")
        full_terms.append(" + ".join(queue + predicted) or "0")
    gens = tuple(generations)
    source = (
        "def scorer(L, R, now):\n"
        f"    if ({lane_gens},) != GENS:\n"
        "        return None\n"
        "    if R is None:\n"
        f"        return [{', '.join(queue_terms)}]\n"
        f"    if ({record_gens},) != GENS:\n"
        "        return None\n"
        f"    return [{', '.join(full_terms)}]\n")
    namespace: dict[str, object] = {"GENS": gens}
    exec(compile(source, "<least_load scorer>", "exec"), namespace)
    return namespace["scorer"]  # type: ignore[return-value]


def _weighted(term: str, weight: float) -> str:
    return term if weight == 1.0 else f"{term} * {weight!r}"
