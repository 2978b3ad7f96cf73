"""kv_aware (aliases `kv`, `kv-aware`): the candidate with the lowest predicted time to first
token, plus what serving a prompt away from its home costs the caches (docs/architecture.md §4.4,
"The score" and "Homes"), within the balance guard.

What a request would cost on each candidate, given what each holds of it, is the worker's to say
(its pricing reads the affinity index and the predictor profile: proxy_workers/affinity.py);
this policy adds each candidate's queue wait and pace from the load view, and chooses.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, TypeVar

from shm_schema import DirectorySnapshot, InstanceSlot

from .least_load import LeastLoadPolicy
from .load_view import LoadView
from .policy import Choice, Cursor

T = TypeVar("T")


class Guard(NamedTuple):
    """Whether the balance guard made kv_aware choose as least_load does, and from what."""
    fired: bool
    spread: int | None  # most - fewest requests in flight among the candidates
    fewest: int | None
    most: int | None
    bound: float  # the spread it allowed
    balance_rel: float
    # Fired because the choice's engine had every sequence slot taken and another candidate
    # one free (the slot guard), not for the spread.
    slots: bool = False

    @property
    def reason(self) -> str:
        """Why, in words (for /debug/instance_loads: a choice never spends time on it)."""
        if self.slots:
            return "every engine slot of kv_aware's choice taken, one free elsewhere: least_load"
        if self.spread is None:
            return "fewer than two candidates with a known inflight"
        if self.fired:
            return (f"inflight spread {self.spread} > bound {self.bound:g} and most {self.most} > "
                    f"balance_rel {self.balance_rel:g} x fewest {self.fewest}: least_load")
        if self.spread <= self.bound:
            return f"inflight spread {self.spread} <= bound {self.bound:g}"
        return f"most inflight {self.most} <= balance_rel {self.balance_rel:g} x fewest {self.fewest}"


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

    def score_ms(self, work_weight: float = 1.0) -> float | None:
        """What kv_aware selects by: the wait, the transfer, and the engine work the choice adds
        (the prefill and the displacement) `work_weight` times: its own wait once, the rest the
        delay it causes the requests that will queue behind it."""
        if self.queue_ms is None:
            return None
        return self.queue_ms + self.transfer_ms + work_weight * (self.prefill_ms + self.displace_ms)


class Costs(Protocol):
    """What a request would cost on one candidate at the profile's pace (the worker's pricing)."""

    @property
    def prefill_ms(self) -> float: ...

    @property
    def transfer_ms(self) -> float: ...

    @property
    def displace_ms(self) -> float: ...


# (request, candidates) -> each candidate's costs, in order.
Pricing = Callable[[Any, Sequence[InstanceSlot]], Sequence[Costs]]


def predictions(view: LoadView, candidates: Sequence[InstanceSlot], span: int,
                inflight: Sequence[int | None], costs: Sequence[Costs]) -> list[Prediction]:
    """Each candidate's queue wait and pace, with what the request would cost there."""
    waits = view.queue_waits(candidates, span, inflight)
    return [Prediction(queue_ms, pace * c.prefill_ms, c.transfer_ms, pace * c.displace_ms)
            for (queue_ms, pace), c in zip(waits, costs)]


def _homed(costs: Sequence[Costs]) -> bool:
    """Displacement is charged only away from a prompt's home: a request charged any has one."""
    return any(c.displace_ms for c in costs)


def engines_full(candidates: Sequence[InstanceSlot], inflight: Sequence[int | None]) -> list[bool | None]:
    """Per candidate: its engine runs as many requests as it has sequence slots (its registered
    max_num_seqs); None where either is unknown."""
    return [None if count is None or not instance.max_num_seqs else count >= instance.max_num_seqs
            for instance, count in zip(candidates, inflight)]


def _slots_taken(chosen: int, candidates: Sequence[InstanceSlot], inflight: Sequence[int | None]) -> bool:
    """The slot guard's test: candidate `chosen`'s engine is full and another's has a slot free."""
    full = engines_full(candidates, inflight)
    return full[chosen] is True and False in full


class KvAwarePolicy(LeastLoadPolicy):
    """The candidate with the lowest predicted time to first token: queue wait, plus the prefill
    of the prompt tokens not already resident at the instance's measured pace, plus the KV
    transfer of the knowledge not already resident -- plus, away from the prompt's home, the
    prefill its blocks would save there (they would take the place of that instance's own
    prompts). Load and affinity in one unit: an instance holding the prefix wins unless its
    queue costs more than the prefill it saves. Ties rotate, as least_load's.

    Where the predicted layer is unknown (no fresh snapshot), least_load's score chooses and
    what the request itself costs breaks its ties. The balance guard, after SGLang's router,
    chooses as least_load does when the candidates' requests in flight spread by more than
    `balance_abs` AND the busiest holds more than `balance_rel` x the idlest's: a queue the
    prediction underrates cannot keep attracting what it holds. A request whose prompt has a
    home (its pricing charges displacement away from it) spreads by `prompt_balance_abs`
    instead: the sidecar already balances the homes' work, so a spill only prefills the prompt
    again elsewhere and evicts one of that instance's own; and its work counts
    `prompt_work_weight` times.

    With `slot_guard`, kv_aware also chooses as least_load does when its choice's engine has
    as many requests in flight as sequence slots (its registered max_num_seqs) and another
    candidate has one free: the request would wait there for a running one to end, a whole
    decode, which the prediction underrates in a burst.

    Without a pricing (a bare router in a unit test), or for a selection without a request,
    kv_aware is least_load. Built bare, the guard never fires and the work counts once; the
    worker passes its settings (proxy_workers/router.py)."""

    name = "kv_aware"

    def __init__(self, weights: Mapping[str, float] | None = None, cursor: Cursor | None = None,
                 tie_cursor: Cursor | None = None, *, balance_abs: float = math.inf,
                 balance_rel: float = 1.5, prompt_balance_abs: float | None = None,
                 work_weight: float = 1.0, prompt_work_weight: float | None = None,
                 pricing: Pricing | None = None, slot_guard: bool = False,
                 native: bool = True) -> None:
        super().__init__(weights, cursor, tie_cursor, native=native)
        self.slot_guard = slot_guard
        self.balance_abs = balance_abs
        self.prompt_balance_abs = balance_abs if prompt_balance_abs is None else prompt_balance_abs
        self.balance_rel = balance_rel
        self.work_weight = work_weight
        self.prompt_work_weight = work_weight if prompt_work_weight is None else prompt_work_weight
        self.pricing = pricing

    def spread_bound(self, costs: Sequence[Costs]) -> float:
        """The guard's bound on the inflight spread for a request priced so."""
        return self._terms(_homed(costs))[0]

    def _terms(self, homed: bool) -> tuple[float, float]:
        """(spread bound, work weight) of a request whose prompt has a home, or not. A homed
        prompt's work counts by its own weight (it stays home unless a queue outweighs it),
        knowledge's by work_weight (the KV arrives by transfer, and a slow instance holds ids
        too)."""
        if homed:
            return self.prompt_balance_abs, self.prompt_work_weight
        return self.balance_abs, self.work_weight

    def guard(self, inflight: Sequence[int | None], bound: float | None = None) -> Guard:
        """Whether least_load chooses instead: the inflight spread past `bound` (balance_abs
        unless given) and the busiest past balance_rel x the idlest."""
        bound = self.balance_abs if bound is None else bound
        known = [n for n in inflight if n is not None]
        if len(known) < 2:
            return Guard(False, None, min(known, default=None), max(known, default=None), bound,
                         self.balance_rel)
        fewest, most = min(known), max(known)
        spread = most - fewest
        return Guard(spread > bound and most > self.balance_rel * fewest, spread, fewest, most,
                     bound, self.balance_rel)

    def scores(self, totals: Callable[[], list[float | None]], inflight: Sequence[int | None],
               predictions: Sequence[Prediction]) -> tuple[list[Any], Guard]:
        """What to select by (lowest wins, equal ones rotate): the predicted times to first
        token with the cache cost; least_load's totals if the guard fires; least_load's totals
        with the request's own cost as the tie-break where a prediction is unknown. `totals`
        gives least_load's, asked for only then: the predictions decide nearly always."""
        bound, weight = self._terms(_homed(predictions))  # one look at the candidates for both
        verdict = self.guard(inflight, bound)
        if verdict.fired:
            return totals(), verdict
        predicted = [p.score_ms(weight) for p in predictions]
        if None not in predicted:
            return predicted, verdict
        return [None if t is None else (t, p.own_ms) for t, p in zip(totals(), predictions)], verdict

    def select_by_predictions(self, candidates: Sequence[T], totals: Callable[[], list[float | None]],
                              inflight: Sequence[int | None],
                              predictions: Sequence[Prediction]) -> tuple[T, Guard]:
        scores, verdict = self.scores(totals, inflight, predictions)
        return self.select_by_totals(candidates, scores), verdict

    def choose(self, view: LoadView, snapshot: DirectorySnapshot,
               candidates: tuple[InstanceSlot, ...], request: Any = None) -> Choice:
        if request is None or self.pricing is None:
            return super().choose(view, snapshot, candidates)
        span = snapshot.slot_span
        costs = self.pricing(request, candidates)
        inflight = view.inflight(candidates, span)
        predicted = predictions(view, candidates, span, inflight, costs)
        def totals() -> list[float | None]:
            return self.table_totals(view, snapshot, candidates)
        chosen, guard = self.select_by_predictions(candidates, totals, inflight, predicted)
        index = candidates.index(chosen)
        if self.slot_guard and not guard.fired and _slots_taken(index, candidates, inflight):
            chosen, guard = self.select_by_totals(candidates, totals()), guard._replace(fired=True, slots=True)
            index = candidates.index(chosen)
        return Choice(chosen, costs[index], predicted[index], guard)
