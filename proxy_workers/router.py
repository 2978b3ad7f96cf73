"""Selection and leases: pick an instance from the shared table, hold it while a request runs.

A Lease is the only way inflight changes on the data plane: `Router.acquire` begins it, and
`Lease.release` ends it at most once, so a double release cannot decrement twice.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Sequence

from cacheroute_proxy.clock import now_us
from cacheroute_proxy.config import Settings
from proxy_workers.fast_score import NATIVE_SELECTION, SelectionPlan
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.strategies import (Guard, KvAwareStrategy, LeastLoadStrategy,
                                                 Prediction, Strategy, build_strategy)
from shm_schema import (
    Admission,
    DirectorySnapshot,
    InstanceSlot,
    Segment,
    WorkerRow,
    header,
)

from .affinity import AffinityScorer, Assessment, debug_request
from .affinity_index import Claim
from .outliers import OutlierTracker
from .refusals import NO_ALIVE_INSTANCE, no_instance
from .request_model import ProxyRequest
from .upstream import base_url


class Choice(NamedTuple):
    """What a selection found about the instance it chose."""
    instance: InstanceSlot
    affinity: Assessment | None = None  # what it holds of the request (kv_aware, or knowledge wanted)
    prediction: Prediction | None = None  # kv_aware: the request's predicted time to first token there
    guard: Guard | None = None  # kv_aware: the balance guard's verdict


class Lease:
    """A request's hold on one instance: inflight, plus whichever queue lanes it is in, plus
    kv_aware's claim that what it brings will be resident there.

    `snapshot_age_ms`: how old the sidecar's predicted layer was when least_load chose this
    instance (None for other strategies, or before any snapshot), for the request's trace.
    `choice`: what the selection found (the affinity is None when none was assessed)."""

    __slots__ = ("instance", "snapshot_age_ms", "choice", "claim", "_row", "_held", "_lanes")

    def __init__(self, choice: Choice, row: WorkerRow, snapshot_age_ms: float | None = None,
                 claim: Claim | None = None) -> None:
        self.instance = choice.instance
        self.snapshot_age_ms = snapshot_age_ms
        self.choice = choice
        self.claim = claim
        self._row = row
        self._held = True
        self._lanes: list[int] = []

    @property
    def resident_kids(self) -> tuple[str, ...]:
        """Wanted knowledge the index confirms the instance holds: the prepare stage skips it."""
        affinity = self.choice.affinity
        return () if affinity is None else affinity.resident_kids

    @property
    def base_url(self) -> str:
        return base_url(self.instance.host, self.instance.port)

    def enter(self, lane: int) -> None:
        """Count this request in a host-wide queue lane until `leave` (or `release`)."""
        self._row.add(lane, self.instance.slot, self.instance.generation)
        self._lanes.append(lane)

    def try_admit(self, lane: int, limit: int) -> Admission:
        """Enter `lane` only while the host-wide count is below `limit`."""
        result = self._row.try_admit(lane, self.instance.slot, self.instance.generation, limit)
        if result is Admission.ADMITTED:
            self._lanes.append(lane)
        return result

    def leave(self, lane: int) -> None:
        if lane in self._lanes:
            self._lanes.remove(lane)
            self._row.remove(lane, self.instance.slot, self.instance.generation)

    def release(self) -> bool:
        """End the request on this instance (every lane, then inflight, and withdraw what its
        claim did not make resident); False if already released or the slot is stale."""
        if not self._held:
            return False
        self._held = False
        if self.claim is not None:
            self.claim.settle()
        while self._lanes:
            self._row.remove(self._lanes.pop(), self.instance.slot, self.instance.generation)
        return self._row.end(self.instance.slot, self.instance.generation)


def kv_aware_settings(settings: Settings) -> dict[str, float]:
    return {"balance_abs": settings.kv_aware_balance_abs, "balance_rel": settings.kv_aware_balance_rel}


class Router:
    def __init__(self, settings: Settings, seg: Segment, row: WorkerRow,
                 affinity: AffinityScorer | None = None,
                 native_selection: bool = NATIVE_SELECTION) -> None:
        self.row = row
        self._settings = settings
        self.view = LoadView(seg, settings.load_view, row, stale_ms=settings.snapshot_stale_ms)
        if settings.load_view == "shared":
            cursor, tie_cursor = (lambda: header.next_round_robin(seg)), (lambda: header.next_tie_break(seg))
        else:  # the ablation: N independent proxies, each with its own rotation
            cursor, tie_cursor = itertools.count().__next__, itertools.count().__next__
        self.strategy: Strategy = build_strategy(settings.instance_strategy,
                                                 weights=settings.least_load_weights,
                                                 cursor=cursor, tie_cursor=tie_cursor,
                                                 kv_aware=kv_aware_settings(settings))
        self._least_load = isinstance(self.strategy, LeastLoadStrategy)  # kv_aware is one too
        # Every strategy learns what the chosen instance holds of a request (the prepare stage
        # skips resident knowledge); only kv_aware lets it weigh in the choice. Without a
        # scorer (a bare Router in a unit test) kv_aware is least_load.
        self.affinity = affinity
        self._kv_aware = isinstance(self.strategy, KvAwareStrategy) and affinity is not None
        self.scorer = (self.strategy if isinstance(self.strategy, LeastLoadStrategy)
                       else LeastLoadStrategy(settings.least_load_weights))
        # least_load over the shared table: one generated plan per directory snapshot.
        self._plan: tuple[object, SelectionPlan | None] = (None, None)
        self._fast = self._least_load and settings.load_view == "shared"
        self._native_selection = native_selection  # the plan's choice in C (benchmarks compare)
        self._seg = seg
        self._directory_snapshot = self.view.directory.snapshot  # bound: once per selection
        self.outliers = OutlierTracker(settings.eject_after_failures, settings.eject_s)

    def choose(self, exclude: frozenset[tuple[int, int]] = frozenset(),
               request: ProxyRequest | None = None) -> InstanceSlot:
        return self._choose(exclude, request).instance

    def _choose(self, exclude: frozenset[tuple[int, int]], request: ProxyRequest | None) -> Choice:
        snapshot = self._directory_snapshot()
        candidates = snapshot.alive
        if not candidates:
            raise no_instance(NO_ALIVE_INSTANCE)
        ejected = self.outliers.ejected()
        if exclude or ejected:
            avoid = exclude | ejected
            kept = tuple(i for i in candidates if (i.slot, i.generation) not in avoid)
            if not kept:
                kept = tuple(i for i in candidates if (i.slot, i.generation) not in exclude)
            if not kept:
                raise no_instance("every alive instance failed this request")
            if len(kept) < len(candidates):
                return self._select(kept, snapshot.slot_span, None, request)
        if not self._least_load:
            return Choice(self.strategy.select(candidates))
        if not self._fast:
            return self._select(candidates, snapshot.slot_span, None, request)
        plan = self._plan_for(snapshot)
        if plan is None:
            return self._select(candidates, snapshot.slot_span, None, request)
        if request is None or not self._kv_aware:  # least_load's choice alone
            choice = plan.pick(now_us())
            if choice is not None:
                return Choice(choice)
            return self._select(candidates, snapshot.slot_span, None, request)
        return self._select(candidates, snapshot.slot_span, plan.totals(now_us()), request)

    def _select(self, candidates: tuple[InstanceSlot, ...], span: int,
                totals: list[float | None] | None, request: ProxyRequest | None) -> Choice:
        """least_load's totals (the fast ones, or every component read one by one); kv_aware's
        predicted times to first token; round_robin reads none."""
        strategy = self.strategy
        if not isinstance(strategy, LeastLoadStrategy):
            return Choice(strategy.select(candidates))
        if totals is None:
            totals = strategy.totals(len(candidates), self.view.components(candidates, span))
        if not self._kv_aware or request is None:
            return Choice(strategy.select_by_totals(candidates, totals))
        assert isinstance(strategy, KvAwareStrategy) and self.affinity is not None
        assessments = self.affinity.assess(request, candidates)
        inflight = self.view.inflight(candidates, span)
        predictions = self._predictions(candidates, span, inflight, assessments)
        chosen, guard = strategy.choose(candidates, totals, inflight, predictions)
        index = candidates.index(chosen)
        return Choice(chosen, assessments[index], predictions[index], guard)

    def _predictions(self, candidates: Sequence[InstanceSlot], span: int,
                     inflight: Sequence[int | None], assessments: Sequence[Assessment]) -> list[Prediction]:
        """Each candidate's queue wait and pace, with what the request would cost there."""
        waits = self.view.queue_waits(candidates, span, inflight)
        return [Prediction(queue_ms, pace * a.prefill_ms, a.transfer_ms, pace * a.displace_ms)
                for (queue_ms, pace), a in zip(waits, assessments)]

    def _plan_for(self, snapshot: DirectorySnapshot) -> SelectionPlan | None:
        planned_for, plan = self._plan
        if planned_for is not snapshot:
            plan = (SelectionPlan(self.scorer, snapshot, self._seg, self.view.snapshots,
                                  self.view.stale_us, native=self._native_selection)
                    if SelectionPlan.supports(self.scorer, snapshot) else None)
            self._plan = (snapshot, plan)
        return plan

    def affinity_report(self, query: Any) -> Any:
        """/debug/instance_loads's kv_aware part for the request its query names, or None."""
        request = debug_request(query) if self.affinity is not None else None
        if request is None:
            return None
        scorer = self.affinity
        assert scorer is not None
        strategy = self.strategy if isinstance(self.strategy, KvAwareStrategy) \
            else KvAwareStrategy(**kv_aware_settings(self._settings))

        def report(instances: Sequence[InstanceSlot], totals: list[float | None],
                   inflight: list[int | None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            assessments = scorer.assess(request, instances)
            span = 1 + max((i.slot for i in instances), default=-1)
            predictions = self._predictions(instances, span, inflight, assessments)
            alive = [i.alive for i in instances]
            guard = strategy.guard([n for n, up in zip(inflight, alive) if up])
            rows = [scorer.report(request, i, a, p) for i, a, p in zip(instances, assessments, predictions)]
            return rows, {"active": self._kv_aware, "affinity_view": scorer.index.mode,
                          "request": {"knowledge": request.knowledge.knowledge_ids if request.knowledge else [],
                                      "prefix_blocks": len(scorer.prefix_of(request))},
                          "guard": {"fired": guard.fired, "reason": guard.reason, "spread": guard.spread,
                                    "balance_abs": strategy.balance_abs, "balance_rel": strategy.balance_rel}}
        return report

    def has_alternative(self, exclude: frozenset[tuple[int, int]]) -> bool:
        """Is there an alive instance outside `exclude` to retry on?"""
        return any((i.slot, i.generation) not in exclude for i in self.view.directory.snapshot().alive)

    def acquire(self, exclude: frozenset[tuple[int, int]] = frozenset(),
                request: ProxyRequest | None = None) -> Lease:
        """Choose an instance outside `exclude` (for `request`: kv_aware weighs what each holds
        of it), begin a request on it (503 if there is none, or if it left the table between
        the choice and the begin) and, for kv_aware, claim what the request brings there."""
        choice = self._choose(exclude, request)
        instance = choice.instance
        if choice.affinity is None and self.affinity is not None and _wants_knowledge(request):
            # Other strategies: only what the prepare stage needs (which wanted ids the chosen
            # instance holds); a plain request's prompt is hashed by kv_aware alone.
            choice = choice._replace(affinity=self.affinity.assess(request, (instance,), claims=False)[0])  # type: ignore[arg-type]
        age = self.view.snapshot_age_ms() if self._least_load else None
        if not self.row.begin(instance.slot, instance.generation):
            raise no_instance("selected instance is no longer registered")
        claim = None
        if self._kv_aware and choice.affinity is not None and request is not None:
            claim = self.affinity.claim(request, instance, choice.affinity)  # type: ignore[union-attr]
        return Lease(choice, self.row, age, claim)


def _wants_knowledge(request: ProxyRequest | None) -> bool:
    return request is not None and request.knowledge is not None and request.knowledge.wanted
