"""least_load (aliases `ll`, `least-load`): the candidate with the lowest load score; ties rotate
among the lowest on a second shared cursor; where nothing is known of anyone, round-robin.

The score (docs/architecture.md §4.1) is Σ weight × value over a candidate's known components,
added in the order of the weights: `least_load_totals`, over what LoadView.components reads.

Since least_load chooses on every request, a selector per directory snapshot serves it: it
knows where its candidates' words are in the shared segment and reads just those. It exists
twice: in C (`_least_load.c`, where the install built it: under a microsecond for 16
candidates), adding the same terms with the same float operations in the same order; and in
Python (`PythonSelector`, where it did not), feeding least_load_totals the words it read. Both
give the component path's totals bit for bit (tests/test_least_load_selection.py holds them
equal on randomised tables). A selector steps aside (None) wherever it would not see what the
component path sees -- the directory moved, a slot changed generation, a snapshot record
describes another one -- and the component path chooses then; a weighted component no
selector reads (`qps_1m`) leaves the choice to the component path throughout.
"""

from __future__ import annotations

import math
import operator
import struct
from itertools import repeat
from typing import Any, Iterable, Mapping, Sequence, TypeVar

from cacheroute_proxy import clock
from cacheroute_proxy.setting import ConfigError
from shm_schema import CountersReader, DirectorySnapshot, InstanceSlot, layout
from shm_schema.records import SNAPSHOT
from shm_schema.snapshot import SnapshotReader, flat_index

from .load_view import LoadView, backlog_ms, decode_batch, ready_wait
from .policy import Choice, Components, Cursor
from .round_robin import RoundRobinPolicy

try:  # the C selector, built by `pip install` where a compiler is
    from ._least_load import Selector as _NativeSelector
except ImportError:  # no compiler at install: PythonSelector serves
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


def least_load_totals(count: int, columns: Iterable[tuple[float, Sequence[float | None]]]
                      ) -> list[float | None]:
    """Each of `count` candidates' Σ weight × value over its known components, added in the
    order of `columns`; None where none is known.
    `columns`: per weighted component, in the order of the weights, (weight, each candidate's
    value or None)."""
    totals: list[float | None] = [None] * count
    for weight, values in columns:
        totals = [total if value is None else weight * value if total is None
                  else total + weight * value for total, value in zip(totals, values)]
    return totals


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
        # The selector type: C where built (and wanted), else Python; none where a weighted
        # component is one the selectors do not read.
        self._selector_type: Any = None
        if self._active and all(name in NATIVE_COMPONENTS for name, _ in self._active):
            self._selector_type = _NativeSelector if native and NATIVE_SELECTION else PythonSelector
        self._selector: tuple[DirectorySnapshot | None, Any] = (None, None)

    # --- the score and the choice, from components --------------------------------------------
    def totals(self, count: int, components: Components | None) -> list[float | None]:
        """Each candidate's score; None where no weighted component is known."""
        return least_load_totals(count, [(weight, components[name]) for name, weight in self._active
                                         if components and name in components])

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
            "total": least_load_totals(1, [(weight, [raw.get(name)]) for name, weight in self._active])[0],
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
        return Choice(self.select_by_totals(candidates, self._component_totals(view, snapshot, candidates)))

    def table_totals(self, view: LoadView, snapshot: DirectorySnapshot,
                     candidates: tuple[InstanceSlot, ...]) -> list[float | None]:
        """The candidates' scores now: the selector's where it serves, else the component path's."""
        if candidates is snapshot.alive:
            selector = self.selector(view, snapshot)
            if selector is not None:
                totals = selector.totals(clock.now_us())
                if totals is not None:
                    return totals
        return self._component_totals(view, snapshot, candidates)

    def _component_totals(self, view: LoadView, snapshot: DirectorySnapshot,
                          candidates: tuple[InstanceSlot, ...]) -> list[float | None]:
        return self.totals(len(candidates), view.components(candidates, snapshot.slot_span))

    def booking(self, view: LoadView, instance: InstanceSlot, now_us: int) -> tuple[float | None, int]:
        """`view.booking(instance, now_us)`, from the current selector where it serves: one C
        call where the view's answer is a dozen Python ones, on every request."""
        selector = self._selector[1]
        if selector is not None:
            booked = selector.booking(instance, now_us)
            if booked is not None:
                return booked
        return view.booking(instance, now_us)

    def selector(self, view: LoadView, snapshot: DirectorySnapshot) -> Any:
        """The selector over `snapshot`'s alive instances (one a snapshot; C where built, else
        PythonSelector), or None where none can serve: the per_worker view, a weighted
        component the selectors do not read, a snapshot decoded mid-write."""
        built_for, selector = self._selector
        if built_for is not snapshot:
            selector = None if self._selector_type is None \
                else _selector(self._selector_type, self, view, snapshot)
            self._selector = (snapshot, selector)
        return selector


def _selector(selector_type: Any, policy: LeastLoadPolicy, view: LoadView,
              snapshot: DirectorySnapshot) -> Any:
    """A selector for the snapshot: the offsets of what it reads, from shm_schema."""
    if view.mode != "shared" or not snapshot.alive or not snapshot.stable or snapshot.seq & 1:
        return None
    candidates = snapshot.alive
    weights = dict(policy._active)
    lanes = [(lane, weights[name]) for name, lane in LANES.items() if name in weights]
    segment = view.directory.segment
    extra = {"load": segment.load} if selector_type is PythonSelector else {}
    return selector_type(
        segment.buf, candidates, policy.select_by_totals,
        _SnapshotRecords(view.snapshots, candidates, snapshot.slot_span),
        seq_offset=CountersReader.directory_seq_offset, seq=snapshot.seq,
        pressure_generation_offset=SnapshotReader.generation_offset,
        generation_offsets=[CountersReader.generation_offset(i.slot) for i in candidates],
        generations=[i.generation for i in candidates],
        inflight_offsets=[CountersReader.count_offset(i.slot, layout.LANE_INFLIGHT) for i in candidates],
        batch_limits=[i.max_num_seqs for i in candidates],
        lane_offsets=[[CountersReader.count_offset(i.slot, lane) for lane, _ in lanes] for i in candidates],
        lane_weights=[weight for _, weight in lanes],
        pending_weight=weights.get("pending_prefill_count", 0.0),
        decoding_weight=weights.get("active_decode_count", 0.0),
        backlog_weight=weights.get(BACKLOG, 0.0), stale_us=view.stale_us, **extra)


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


class PythonSelector:
    """The C selector (_least_load.c) in Python, where the install built none: the same
    construction (the byte offsets of what it reads, from shm_schema) and the same answers
    (`pick`, `totals`, None where it steps aside), its totals least_load_totals' over the words.

    Once a snapshot, the halves it reads become one struct of small ints (the rest padding) and
    each component a column getter into it; once a published snapshot generation, the records'
    values per candidate (`derive`). A selection is then one struct call, two word loads and a
    few list comprehensions -- where LoadView.components builds a record and a list per
    component. It reads the values the component path reads, and least_load_totals adds them
    in the same order (the backlog by load_view.backlog_ms, as there), so the totals are the
    component path's bit for bit."""

    def __init__(self, buffer: Any, candidates: tuple[InstanceSlot, ...], ties: Any, derive: Any, *,
                 load: Any, seq_offset: int, seq: int, pressure_generation_offset: int,
                 generation_offsets: Sequence[int], generations: Sequence[int],
                 inflight_offsets: Sequence[int], lane_offsets: Sequence[Sequence[int]],
                 lane_weights: Sequence[float], pending_weight: float, decoding_weight: float,
                 backlog_weight: float, stale_us: int, batch_limits: Sequence[int]) -> None:
        offsets = sorted({*generation_offsets, *inflight_offsets,
                          *(offset for row in lane_offsets for offset in row)})
        self._buffer, self._start = buffer, offsets[0]
        self._read = struct.Struct(_halves_format(offsets)).unpack_from
        position = {offset: index for index, offset in enumerate(offsets)}

        def column(at: Iterable[int]) -> Any:
            return _getter([position[offset] for offset in at])
        self._candidates, self._ties, self._derive = candidates, ties, derive
        self._load, self._seq_offset, self._seq = load, seq_offset, seq
        self._pressure_generation_offset = pressure_generation_offset
        self._generations_of, self._generations = column(generation_offsets), tuple(generations)
        self._inflight_of = column(inflight_offsets)
        self._lanes = [(weight, column(row[j] for row in lane_offsets))
                       for j, weight in enumerate(lane_weights)]
        self._pending_weight, self._decoding_weight = pending_weight, decoding_weight
        self._backlog_weight, self._stale_us = backlog_weight, stale_us
        self._batch_limits = tuple(batch_limits)
        # A candidate (by identity: the tuple keeps each alive, so no other object has its id)
        # -> (its index, where its generation and inflight halves are among the values read).
        self._booking_at = {id(candidate): (index, position[generation_offsets[index]],
                                            position[inflight_offsets[index]])
                            for index, candidate in enumerate(candidates)}
        self._pressure_generation: int | None = None
        self._published = 0
        self._records: tuple[tuple[int, ...], ...] | None = None  # None: of other generations

    def totals(self, now: int) -> list[float | None] | None:
        """Every candidate's total at `now`, or None where the selector steps aside."""
        values = self._read(self._buffer, self._start)
        if self._load(self._seq_offset) != self._seq:
            return None  # the directory moved since the snapshot
        if self._load(self._pressure_generation_offset) != self._pressure_generation:
            self._take_records()
        if self._generations_of(values) != self._generations:
            return None
        columns = [(weight, lane(values)) for weight, lane in self._lanes]
        if self._published and now - self._published <= self._stale_us:  # fresh
            if self._records is None:
                return None  # a record of another generation: the component path's
            if self._pending_weight or self._decoding_weight or self._backlog_weight:
                columns.extend(self._predicted(now, self._inflight_of(values)))
        if not columns:
            return None  # nothing weighted known: round-robin
        return least_load_totals(len(self._candidates), columns)

    def pick(self, now: int) -> InstanceSlot | None:
        totals = self.totals(now)
        return None if totals is None else self._ties(self._candidates, totals)

    def booking(self, instance: InstanceSlot, now: int) -> tuple[float | None, int] | None:
        """LoadView.booking's answer for one of the candidates at `now`, or None where the
        selector steps aside (as the C one's `booking`)."""
        at = self._booking_at.get(id(instance))
        if at is None:
            return None
        index, generation_at, inflight_at = at
        values = self._read(self._buffer, self._start)
        if self._load(self._seq_offset) != self._seq or values[generation_at] != self._generations[index]:
            return None
        if self._load(self._pressure_generation_offset) != self._pressure_generation:
            self._take_records()
        inflight = values[inflight_at]
        batch = decode_batch(self._batch_limits[index], inflight)
        if not (self._published and now - self._published <= self._stale_us):
            return None, batch
        if self._records is None:
            return None  # a record of another generation: the view's
        _, _, free_at, announced, _ = self._records
        return ready_wait(free_at[index], now, announced[index], inflight), batch

    def _predicted(self, now: int, inflight: Sequence[int]) -> list[tuple[float, Sequence[Any]]]:
        """The weighted predicted columns: pending, decoding, backlog."""
        pending, decoding, free_at, announced, marginal = self._records  # type: ignore[misc]
        columns: list[tuple[float, Sequence[Any]]] = []
        if self._pending_weight:
            columns.append((self._pending_weight, pending))
        if self._decoding_weight:
            columns.append((self._decoding_weight, decoding))
        if self._backlog_weight:
            columns.append((self._backlog_weight,
                            list(map(backlog_ms, free_at, repeat(now), inflight, announced, marginal))))
        return columns

    def _take_records(self) -> None:
        generation, published, values = self._derive()
        self._pressure_generation, self._published = generation, published
        if values is False:
            self._records = None
            return
        pending, decoding = values[0::5], values[1::5]
        free_at = tuple(map(max, values[2::5], values[3::5]))
        announced = tuple(map(operator.add, pending, decoding))
        self._records = (pending, decoding, free_at, announced, values[4::5])


def _halves_format(offsets: Sequence[int]) -> str:
    """A struct format reading the 4-byte halves at `offsets` (ascending) from the first on,
    padding over the rest."""
    parts = ["@I"]
    for before, offset in zip(offsets, offsets[1:]):
        gap = offset - before - 4
        parts.append(f"{gap}xI" if gap else "I")
    return "".join(parts)


def _getter(indexes: Sequence[int]) -> Any:
    """values -> the tuple of values[i] for i in indexes (itemgetter, a tuple even for one)."""
    if len(indexes) == 1:
        index = indexes[0]
        return lambda values: (values[index],)
    return operator.itemgetter(*indexes)
