"""What a worker does around an instance choice: the candidates (minus the instances it
ejected and those a request already failed on), the policy's choice (cacheroute_proxy/routing),
the lease that holds the instance while the request runs, and kv_aware's claim.

A Lease is the only way inflight changes on the data plane: `Router.acquire` begins it, and
`Lease.release` ends it at most once, so a double release cannot decrement twice.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.kv_aware import KvAwarePolicy
from cacheroute_proxy.routing.least_load import LeastLoadPolicy
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.policy import Choice, Policy
from cacheroute_proxy.routing.registry import build_policy
from shm_schema import Admission, InstanceSlot, Segment, WorkerRow, header

from .affinity import AffinityScorer, affinity_report
from .affinity_index import Claim
from .outliers import OutlierTracker
from .refusals import NO_ALIVE_INSTANCE, no_instance
from .request_model import ProxyRequest
from .upstream import base_url

Slots = frozenset[tuple[int, int]]  # (slot, generation) of instances


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
    def claimed_kids(self) -> tuple[str, ...]:
        """Wanted knowledge other requests had claimed on the instance, not confirmed yet."""
        affinity = self.choice.affinity
        return () if affinity is None else affinity.pending_kids

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


def kv_aware_settings(settings: Settings) -> dict[str, float | bool]:
    return {"balance_abs": settings.kv_aware_balance_abs, "balance_rel": settings.kv_aware_balance_rel,
            "prompt_balance_abs": settings.kv_aware_prompt_balance_abs,
            "work_weight": settings.kv_aware_work_weight,
            "prompt_work_weight": settings.kv_aware_prompt_work_weight,
            "slot_guard": settings.kv_aware_slot_guard}


class Router:
    def __init__(self, settings: Settings, seg: Segment, row: WorkerRow,
                 affinity: AffinityScorer | None = None,
                 native_selection: bool = True) -> None:
        self.row = row
        self._settings = settings
        self.view = LoadView(seg, settings.load_view, row, stale_ms=settings.snapshot_stale_ms)
        if settings.load_view == "shared":
            cursor, tie_cursor = (lambda: header.next_round_robin(seg)), (lambda: header.next_tie_break(seg))
        else:  # the ablation: N independent proxies, each with its own rotation
            cursor, tie_cursor = itertools.count().__next__, itertools.count().__next__
        # Every policy learns what the chosen instance holds of a request (the prepare stage
        # skips resident knowledge); only kv_aware lets it weigh in the choice. Without a
        # scorer (a bare Router in a unit test) kv_aware is least_load.
        self.affinity = affinity
        self.policy: Policy = build_policy(
            settings.instance_strategy, weights=settings.least_load_weights, cursor=cursor,
            tie_cursor=tie_cursor, kv_aware=kv_aware_settings(settings),
            pricing=None if affinity is None else affinity.assess, native=native_selection)
        self._least_load = isinstance(self.policy, LeastLoadPolicy)  # kv_aware is one too
        self._kv_aware = isinstance(self.policy, KvAwarePolicy) and affinity is not None
        # least_load's score of every instance for /debug/instance_loads, whatever the policy.
        self.scorer = self.policy if isinstance(self.policy, LeastLoadPolicy) \
            else LeastLoadPolicy(settings.least_load_weights)
        self._policy_choose = self.policy.choose  # bound: once per selection
        # What a request's booking predicts from (LoadView.booking), by least_load's selector
        # where it serves.
        self.booking: Callable[[InstanceSlot, int], tuple[float | None, int]] = \
            functools.partial(self.policy.booking, self.view) if self._least_load else self.view.booking
        self._directory_snapshot = self.view.directory.snapshot
        self.outliers = OutlierTracker(settings.eject_after_failures, settings.eject_s)

    @property
    def weighs_prompts(self) -> bool:
        """The choice hashes a request's prompt and claims what it brings (kv_aware with its
        index): the request needs the exchange's affinity work around the forward."""
        return self._kv_aware

    def choose(self, exclude: Slots = frozenset(), request: ProxyRequest | None = None) -> InstanceSlot:
        return self._choose(exclude, request).instance

    def _choose(self, exclude: Slots, request: ProxyRequest | None) -> Choice:
        snapshot = self._directory_snapshot()
        candidates = snapshot.alive
        if not candidates:
            raise no_instance(NO_ALIVE_INSTANCE)
        ejected = self.outliers.ejected()
        if exclude or ejected:
            candidates = _without(candidates, exclude, ejected)
        return self._policy_choose(self.view, snapshot, candidates, request)

    def affinity_report(self, query: Any) -> Any:
        """/debug/instance_loads's kv_aware part for the request its query names, or None."""
        if self.affinity is None:
            return None
        policy = self.policy if isinstance(self.policy, KvAwarePolicy) \
            else KvAwarePolicy(**kv_aware_settings(self._settings))
        return affinity_report(self.affinity, self.view, policy, self._kv_aware, query)

    def has_alternative(self, exclude: Slots) -> bool:
        """Is there an alive instance outside `exclude` to retry on?"""
        return any((i.slot, i.generation) not in exclude for i in self.view.directory.snapshot().alive)

    def acquire(self, exclude: Slots = frozenset(), request: ProxyRequest | None = None) -> Lease:
        """Choose an instance outside `exclude` (for `request`: kv_aware weighs what each holds
        of it), begin a request on it (503 if there is none, or if it left the table between
        the choice and the begin, and no other is left) and, for kv_aware, claim what the
        request brings there."""
        while True:
            choice = self._choose(exclude, request)  # no_instance once none is left
            instance = choice.instance
            if choice.affinity is None and self.affinity is not None and _wants_knowledge(request):
                # Other policies: only what the prepare stage needs (which wanted ids the chosen
                # instance holds); a plain request's prompt is hashed by kv_aware alone.
                choice = choice._replace(affinity=self.affinity.assess(request, (instance,), claims=False)[0])  # type: ignore[arg-type]
            age = self.view.snapshot_age_ms() if self._least_load else None
            if self.row.begin(instance.slot, instance.generation):
                break
            exclude = exclude | {(instance.slot, instance.generation)}  # it left meanwhile
        claim = None
        if self._kv_aware and choice.affinity is not None and request is not None:
            claim = self.affinity.claim(request, instance, choice.affinity)  # type: ignore[union-attr]
        return Lease(choice, self.row, age, claim)


def _without(candidates: tuple[InstanceSlot, ...], exclude: Slots, ejected: Slots) -> tuple[InstanceSlot, ...]:
    """The candidates outside `exclude` and, while any is left, outside `ejected`; the very
    tuple when nothing is left out (least_load's C selector serves the whole snapshot only)."""
    avoid = exclude | ejected
    kept = tuple(i for i in candidates if (i.slot, i.generation) not in avoid)
    if not kept:
        kept = tuple(i for i in candidates if (i.slot, i.generation) not in exclude)
    if not kept:
        raise no_instance("every alive instance failed this request")
    return kept if len(kept) < len(candidates) else candidates


def _wants_knowledge(request: ProxyRequest | None) -> bool:
    return request is not None and request.knowledge is not None and request.knowledge.wanted
