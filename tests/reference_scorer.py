"""The reference the router's least_load plan is held to (tests/test_selection_plan.py,
tests/test_fast_score.py): a function generated per candidate set whose body is the whole
weighted sum with every offset and weight as a constant, over the flat lane words L (one
struct call) and the flat snapshot records R:

    [count(L[inflight of slot a]) * w + ... + R[pending_prefill_count of a] * w
     + (max(R[next_slot_free_at_us of a], R[prefill_free_at_us of a], now) - now
        + unannounced(a) * R[marginal_backlog_us of a]) * w_per_us, ...]

(w_per_us: the backlog weight, which is per millisecond, over 1000.) Every index in it comes
from shm_schema's declarations (layout.lane_index for the lanes, snapshot.flat_index with
records.SNAPSHOT's field indices for the records), and a counter word is decoded by the source
text CounterWord gives, so the reference cannot drift from the format. It was the router's
scorer before the plan; the plan (proxy_workers/fast_score.py) computes the same floats.
"""

from __future__ import annotations

from typing import Callable, Sequence

from cacheroute_proxy.routing.strategies import LeastLoadStrategy
from proxy_workers.fast_score import BACKLOG, LANE_FIELDS, RECORD_FIELDS, SUPPORTED, weighted_term
from shm_schema import layout
from shm_schema.bitfields import CounterWord
from shm_schema.records import SNAPSHOT
from shm_schema.snapshot import flat_index

Scorer = Callable[[Sequence[int], Sequence[int] | None, int], list[float] | None]
_R = SNAPSHOT.index


def compile_scorer(strategy: LeastLoadStrategy, slots: Sequence[int],
                   generations: Sequence[int]) -> Scorer | None:
    """A scorer for these candidates, or None if the weights need the generic path."""
    weights = {name: w for name, w in strategy.weights.items() if w}
    if not slots or not set(weights) <= SUPPORTED:
        return None
    lane_gens = ", ".join(CounterWord.generation_source(_lane(s, layout.LANE_INFLIGHT)) for s in slots)
    record_gens = ", ".join(_record(s, _R.generation) for s in slots)
    queue_terms, full_terms = [], []
    for s in slots:
        queue = [weighted_term(CounterWord.count_source(_lane(s, lane)), weights[name])
                 for name, lane in LANE_FIELDS.items() if name in weights]
        predicted = [weighted_term(_record(s, field), weights[name])
                     for name, field in RECORD_FIELDS.items() if name in weights]
        if BACKLOG in weights:
            predicted.append(_backlog_term(s, weights[BACKLOG]))
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


def _backlog_term(slot: int, weight_per_ms: float) -> str:
    """Time until the instance is free, plus the requests in flight the snapshot has not seen
    (inflight - pending - decoding) at the marginal cost each (load_view's
    _unannounced_backlog_ms); the record is in microseconds, the weight per millisecond."""
    inflight = CounterWord.count_source(_lane(slot, layout.LANE_INFLIGHT))
    unseen = (f"max(0, {inflight} - {_record(slot, _R.pending_prefill_count)}"
              f" - {_record(slot, _R.active_decode_count)}) * {_record(slot, _R.marginal_backlog_us)}")
    free_at = f"max({_record(slot, _R.next_slot_free_at_us)}, {_record(slot, _R.prefill_free_at_us)}, now)"
    return f"({free_at} - now + {unseen}) * {weight_per_ms / 1000!r}"


def _lane(slot: int, lane: int) -> str:
    return f"L[{layout.lane_index(slot, lane)}]"


def _record(slot: int, field: int) -> str:
    return f"R[{flat_index(slot, field)}]"
