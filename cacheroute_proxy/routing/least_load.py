"""least_load (aliases `ll`, `least-load`): the candidate with the lowest load score; ties rotate
among the lowest on a second shared cursor; where nothing is known of anyone, round-robin.

The score (docs/architecture.md §4.1) is Σ weight × value over a candidate's known components,
added in the order of the weights: `least_load_score`, over what LoadView.components reads.

It exists once more, in C (`_least_load.c`, where the install built it): a selector per
directory snapshot that reads its candidates' words straight from the shared segment and adds
the same terms with the same float operations in the same order, so its totals are the Python
ones bit for bit (tests/test_least_load_selection.py holds them equal on randomised tables).
It is the fast path, since least_load chooses on every request: under a microsecond for 16
candidates, where reading every component into lists and summing them in Python takes tens.
It steps aside (None) wherever it would not see what the Python score sees -- the directory
moved, a slot changed generation, a snapshot record describes another one, a weighted component
it does not read (`qps_1m`) -- and the Python score chooses then; without the compiled part it
always does.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence, TypeVar

from cacheroute_proxy import clock
from cacheroute_proxy.setting import ConfigError
from shm_schema import CountersReader, DirectorySnapshot, InstanceSlot, layout
from shm_schema.records import SNAPSHOT
from shm_schema.snapshot import SnapshotReader, flat_index

from .load_view import LoadView
from .policy import Choice, Components, Cursor
from .round_robin import RoundRobinPolicy

try:  # the C selector, built by `pip install` where a compiler is
    from ._least_load import Selector as _NativeSelector
except ImportError:  # no compiler at install: the Python score serves
    _NativeSelector = None

NATIVE_SELECTION = _NativeSelector is not None

T = TypeVar("T")

# The original Proxy's default weights. A zero weight excludes the component. Layers: lifecycle
# (inflight); instantaneous queue (active_*, *_queue_depth); predicted reservation pressure
# (pending_prefill_count, active_decode_count, backlog ms: 1000 ms of predicted backlog weighs as
# much as one request in flight). The order is the order of the sum, in Python and in C.
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

# What the C selector reads, by component: a counter lane of the shared table, a count of the
# snapshot record, the backlog. It adds them in this order, the order of DEFAULT_WEIGHTS.
LANES = {name: layout.LANE_NAMES.index(name) for name in DEFAULT_WEIGHTS if name in layout.LANE_NAMES}
RECORD_COUNTS = ("pending_prefill_count", "active_decode_count")
BACKLOG = "predicted_total_backlog_ms"
NATIVE_COMPONENTS = (*LANES, *RECORD_COUNTS, BACKLOG)
# The snapshot fields the C selector is handed per candidate, in the order it takes them.
_RECORD_FIELDS = tuple(getattr(SNAPSHOT.index, name) for name in (
    "pending_prefill_count", "active_decode_count", "next_slot_free_at_us", "prefill_free_at_us",
    "marginal_backlog_us"))
_GENERATION = SNAPSHOT.index.generation
_EXACT_LIMIT = 2 ** 53  # integers below it are exact as floats, in Python and in C


def least_load_score(terms: Iterable[tuple[float, float | None]]) -> float | None:
    """Σ weight × value over the known components, in the order given; None if none is known.
    `terms`: (weight, value) of one candidate's weighted components, in the order of the weights."""
    total = None
    for weight, value in terms:
        if value is not None:
            total = weight * value if total is None else total + weight * value
    return total


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


class LeastLoadPolicy:
    name = "least_load"

    def __init__(self, weights: Mapping[str, float] | None = None, cursor: Cursor | None = None,
                 tie_cursor: Cursor | None = None, *, native: bool = True) -> None:
        self.weights = resolve_weights(weights)
        self._active = tuple((k, w) for k, w in self.weights.items() if w != 0.0)
        self._fallback = RoundRobinPolicy(cursor)
        self._ties = RoundRobinPolicy(tie_cursor)
        self._native = native and NATIVE_SELECTION and bool(self._active) \
            and all(name in NATIVE_COMPONENTS for name, _ in self._active)
        self._selector: tuple[DirectorySnapshot | None, Any] = (None, None)

    # --- the score and the choice, from components --------------------------------------------
    def totals(self, count: int, components: Components | None) -> list[float | None]:
        """Each candidate's score; None where no weighted component is known."""
        columns = [(weight, components[name]) for name, weight in self._active
                   if components and name in components]
        return [least_load_score([(weight, values[i]) for weight, values in columns])
                for i in range(count)]

    def select(self, candidates: Sequence[T], components: Components | None = None) -> T:
        if not candidates:
            raise RuntimeError("no instances")
        return self.select_by_totals(candidates, self.totals(len(candidates), components))

    def select_by_totals(self, candidates: Sequence[T], totals: list[Any]) -> T:
        """Lowest known total; unknown totals dropped; all unknown -> round-robin; ties ->
        round-robin among them."""
        if None not in totals:
            best = min(totals)
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
            "total": least_load_score((weight, raw.get(name)) for name, weight in self._active),
            "components": raw,
            "weighted_components": weighted,
            "source": {name: sources.get(name, "unavailable") for name in self.weights},
            "queue_source": queue_source,
            "weights": dict(self.weights),
        }

    # --- the choice, from the shared table ----------------------------------------------------
    def choose(self, view: LoadView, snapshot: DirectorySnapshot,
               candidates: tuple[InstanceSlot, ...], request: Any = None) -> Choice:
        if candidates is snapshot.alive:
            selector = self.selector(view, snapshot)
            if selector is not None:
                chosen = selector.pick(clock.now_us())
                if chosen is not None:
                    return Choice(chosen)
        return Choice(self.select_by_totals(candidates, self._python_totals(view, snapshot, candidates)))

    def table_totals(self, view: LoadView, snapshot: DirectorySnapshot,
                     candidates: tuple[InstanceSlot, ...]) -> list[float | None]:
        """The candidates' scores now: the C selector's where it serves, else the Python ones."""
        if candidates is snapshot.alive:
            selector = self.selector(view, snapshot)
            if selector is not None:
                totals = selector.totals(clock.now_us())
                if totals is not None:
                    return totals
        return self._python_totals(view, snapshot, candidates)

    def _python_totals(self, view: LoadView, snapshot: DirectorySnapshot,
                       candidates: tuple[InstanceSlot, ...]) -> list[float | None]:
        return self.totals(len(candidates), view.components(candidates, snapshot.slot_span))

    def selector(self, view: LoadView, snapshot: DirectorySnapshot) -> Any:
        """The C selector over `snapshot`'s alive instances (one a snapshot), or None where it
        cannot serve: not built, switched off, the per_worker view, a weighted component it
        does not read, a snapshot decoded mid-write."""
        built_for, selector = self._selector
        if built_for is not snapshot:
            selector = _native_selector(self, view, snapshot) if self._native else None
            self._selector = (snapshot, selector)
        return selector


def _native_selector(policy: LeastLoadPolicy, view: LoadView, snapshot: DirectorySnapshot) -> Any:
    """A C selector for the snapshot: the offsets of what it reads, from shm_schema."""
    if view.mode != "shared" or not snapshot.alive or not snapshot.stable or snapshot.seq & 1:
        return None
    candidates = snapshot.alive
    weights = dict(policy._active)
    lanes = [(lane, weights[name]) for name, lane in LANES.items() if name in weights]
    return _NativeSelector(
        view.directory.segment.buf, candidates, policy.select_by_totals,
        _SnapshotRecords(view.snapshots, candidates, snapshot.slot_span),
        seq_offset=CountersReader.directory_seq_offset, seq=snapshot.seq,
        pressure_generation_offset=SnapshotReader.generation_offset,
        generation_offsets=[CountersReader.generation_offset(i.slot) for i in candidates],
        generations=[i.generation for i in candidates],
        inflight_offsets=[CountersReader.count_offset(i.slot, layout.LANE_INFLIGHT) for i in candidates],
        lane_offsets=[[CountersReader.count_offset(i.slot, lane) for lane, _ in lanes] for i in candidates],
        lane_weights=[weight for _, weight in lanes],
        pending_weight=weights.get("pending_prefill_count", 0.0),
        decoding_weight=weights.get("active_decode_count", 0.0),
        backlog_weight=weights.get(BACKLOG, 0.0), stale_us=view.stale_us)


class _SnapshotRecords:
    """What the C selector needs of the sidecar's snapshot, read when its generation moves:
    (generation, published us or 0, per candidate its pending and decoding counts, next slot and
    prefill chain free times and marginal backlog -- or False where a record describes another
    generation or holds a value beyond 2**53)."""

    def __init__(self, snapshots: SnapshotReader, candidates: tuple[InstanceSlot, ...], span: int) -> None:
        self._snapshots = snapshots
        self._candidates = candidates
        self._span = span

    def __call__(self) -> tuple[int, int, tuple[int, ...] | bool]:
        snapshots = self._snapshots
        generation = snapshots.generation()
        records = snapshots.records(self._span)
        if not records:
            return generation, 0, False
        values: list[int] = []
        for inst in self._candidates:
            if records[flat_index(inst.slot, _GENERATION)] != inst.generation:
                return generation, snapshots.published_us(), False
            values.extend(records[flat_index(inst.slot, field)] for field in _RECORD_FIELDS)
        usable = all(0 <= value < _EXACT_LIMIT for value in values)
        return generation, snapshots.published_us(), tuple(values) if usable else False
