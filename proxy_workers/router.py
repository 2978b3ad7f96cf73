"""Selection and leases: pick an instance from the shared table, hold it while a request runs.

A Lease is the only way inflight changes on the data plane: `Router.acquire` begins it, and
`Lease.release` ends it at most once, so a double release cannot decrement twice.
"""

from __future__ import annotations

import itertools

from cacheroute_proxy.clock import now_us
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from proxy_workers.fast_score import Scorer, compile_scorer
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.strategies import LeastLoadStrategy, Strategy, build_strategy
from shm_schema import (
    Admission,
    DirectorySnapshot,
    InstanceSlot,
    Segment,
    WorkerRow,
    header,
)

from .outliers import OutlierTracker
from .upstream import base_url


class Lease:
    """A request's hold on one instance: inflight, plus whichever queue lanes it is in.

    `snapshot_age_ms`: how old the sidecar's predicted layer was when least_load chose this
    instance (None for other strategies, or before any snapshot), for the request's trace."""

    __slots__ = ("instance", "snapshot_age_ms", "_row", "_held", "_lanes")

    def __init__(self, instance: InstanceSlot, row: WorkerRow,
                 snapshot_age_ms: float | None = None) -> None:
        self.instance = instance
        self.snapshot_age_ms = snapshot_age_ms
        self._row = row
        self._held = True
        self._lanes: list[int] = []

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
        """End the request on this instance (every lane, then inflight); False if already
        released or the slot is stale."""
        if not self._held:
            return False
        self._held = False
        while self._lanes:
            self._row.remove(self._lanes.pop(), self.instance.slot, self.instance.generation)
        return self._row.end(self.instance.slot, self.instance.generation)


class Router:
    def __init__(self, settings: Settings, seg: Segment, row: WorkerRow) -> None:
        self.row = row
        self.view = LoadView(seg, settings.load_view, row, stale_ms=settings.snapshot_stale_ms)
        if settings.load_view == "shared":
            cursor, tie_cursor = (lambda: header.next_round_robin(seg)), (lambda: header.next_tie_break(seg))
        else:  # the ablation: N independent proxies, each with its own rotation
            cursor, tie_cursor = itertools.count().__next__, itertools.count().__next__
        self.strategy: Strategy = build_strategy(settings.instance_strategy,
                                                 weights=settings.least_load_weights,
                                                 cursor=cursor, tie_cursor=tie_cursor)
        self._least_load = isinstance(self.strategy, LeastLoadStrategy)
        self.scorer = (self.strategy if isinstance(self.strategy, LeastLoadStrategy)
                       else LeastLoadStrategy(settings.least_load_weights))
        # least_load over the shared table: one generated comprehension per directory snapshot.
        self._compiled: tuple[object, Scorer | None] = (None, None)
        self._fast = self._least_load and settings.load_view == "shared"
        self.outliers = OutlierTracker(settings.eject_after_failures, settings.eject_s)

    def choose(self, exclude: frozenset[tuple[int, int]] = frozenset()) -> InstanceSlot:
        snapshot = self.view.directory.snapshot()
        candidates = snapshot.alive
        if not candidates:
            raise HTTPError(503, "no_instance", "proxy has no alive instance")
        ejected = self.outliers.ejected()
        if exclude or ejected:
            avoid = exclude | ejected
            kept = tuple(i for i in candidates if (i.slot, i.generation) not in avoid)
            if not kept:
                kept = tuple(i for i in candidates if (i.slot, i.generation) not in exclude)
            if not kept:
                raise HTTPError(503, "no_instance", "every alive instance failed this request")
            if len(kept) < len(candidates):
                return self._select(kept, snapshot.slot_span)
        if not self._least_load:
            return self.strategy.select(candidates)
        if self._fast:
            totals = self._fast_totals(snapshot)
            if totals is not None:
                return self.strategy.select_by_totals(candidates, totals)  # type: ignore[union-attr]
        return self._select(candidates, snapshot.slot_span)

    def _select(self, candidates: tuple[InstanceSlot, ...], span: int) -> InstanceSlot:
        """The generic path: every component read one by one (round_robin reads none)."""
        components = self.view.components(candidates, span) if self._least_load else None
        return self.strategy.select(candidates, components)

    def _fast_totals(self, snapshot: DirectorySnapshot) -> list[float] | None:
        compiled_for, scorer = self._compiled
        if compiled_for is not snapshot:
            scorer = compile_scorer(self.scorer, [i.slot for i in snapshot.alive],
                                    [i.generation for i in snapshot.alive])
            self._compiled = (snapshot, scorer)
        if scorer is None:
            return None
        span = snapshot.slot_span
        now = now_us()
        return scorer(self.view.lanes(span), self.view.fresh_records(span, now), now)

    def has_alternative(self, exclude: frozenset[tuple[int, int]]) -> bool:
        """Is there an alive instance outside `exclude` to retry on?"""
        return any((i.slot, i.generation) not in exclude for i in self.view.directory.snapshot().alive)

    def acquire(self, exclude: frozenset[tuple[int, int]] = frozenset()) -> Lease:
        """Choose an instance outside `exclude` and begin a request on it (503 if there is none,
        or if it left the table between the choice and the begin)."""
        instance = self.choose(exclude)
        age = self.view.snapshot_age_ms() if self._least_load else None
        if not self.row.begin(instance.slot, instance.generation):
            raise HTTPError(503, "no_instance", "selected instance is no longer registered")
        return Lease(instance, self.row, age)

