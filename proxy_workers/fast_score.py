"""The router's least_load plan: the score of every candidate and the choice, fast.

The generic path (LoadView.components + LeastLoadStrategy.totals) builds a list per component
and then sums them; in Python that is ~25 us for 16 instances. Selection runs on every request,
and the candidate set changes only when the directory does, so a plan is built once per
directory snapshot and weight set. The reference it is held to is a function whose body is the
whole weighted sum with every offset and weight as a constant (tests/reference_scorer.py).

`SelectionPlan` is what the router runs: the same weighted sum, with the same operations in
the same order (so the same floats), but built to cost a few microseconds for 16 candidates:
- the lanes come from shm_schema's CandidateLanes, only the halves the sum reads, as small
  ints (no 64-bit int built or masked), and unpacked into locals by the generated code;
- everything that depends only on the pressure snapshot (the weighted pending and decoding
  counts, the time the instance is free again, the requests it has announced, its marginal
  cost) is derived once per published snapshot generation, with times made relative to the
  publish time so that the per-call comparisons are between small ints;
- the counts are summed as ints and scaled once when the weights allow it exactly
  (`_exact_scale`; the defaults do);
- the generated function is the whole selection: it reads the lanes, picks the lowest total
  itself and builds the totals list only for a tie (the strategy's shared tie cursor decides
  then, as before);
- under an exact scale, its twin in C (proxy_workers/_select.c, where the install built it)
  chooses instead: the same reads, checks and integer sums, each total converted and scaled
  with the same float operations, in under a microsecond for 16 candidates (`pick`, `totals`).

The plan returns None whenever its assumptions do not hold (the directory moved, a slot changed
generation, a record describes another generation), and the caller then takes the generic
path, so both always agree. tests/test_selection_plan.py checks the plan against the reference
(bit for bit) and the strategy's choice on randomised tables; tests/test_fast_score.py checks
the reference: its tables against the declarations, each component alone against the record
read by name, and its totals against the generic path's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from shm_schema import CandidateLanes, DirectorySnapshot, InstanceSlot, Segment, layout
from shm_schema.records import SNAPSHOT
from shm_schema.snapshot import SnapshotReader, flat_index

from cacheroute_proxy.routing.strategies import LeastLoadStrategy

try:  # the plan's choice in C (proxy_workers/_select.c), built by `pip install` where a compiler is
    from ._select import Plan as _NativePlan
except ImportError:  # pragma: no cover - no compiler at install: the generated Python alone
    _NativePlan = None

NATIVE_SELECTION = _NativePlan is not None

# Component -> its lane (a word of L) or its snapshot field (a word of R), by name.
LANE_FIELDS = {name: layout.LANE_NAMES.index(name) for name in layout.LANE_NAMES}
RECORD_FIELDS = {name: getattr(SNAPSHOT.index, name)
                 for name in ("pending_prefill_count", "active_decode_count")}
BACKLOG = "predicted_total_backlog_ms"
SUPPORTED = {*LANE_FIELDS, *RECORD_FIELDS, BACKLOG}
_R = SNAPSHOT.index


def weighted_term(term: str, weight: float) -> str:
    """`term * weight` as source text, with no product for a weight of 1 (as the reference)."""
    return term if weight == 1.0 else f"{term} * {weight!r}"


# --- the router's plan ----------------------------------------------------------------------------
# What one candidate's predicted terms need from its snapshot record, derived once per
# snapshot generation: the weighted pending and decoding counts (the very products the
# scorer above computes), the instance's free time relative to the publish time, the
# requests it has announced (pending + decoding) and its marginal backlog.
# Each is a local of the generated code: its prefix and the candidate's position. Under an
# exact scale (`_exact_scale`) the two weighted counts are one scaled int, "scaled_counts".
_PLAN_FIELDS = {"pending_prefill_count": "p", "active_decode_count": "d", "scaled_counts": "k",
                "free_at": "f", "announced": "n", "marginal": "m"}
# Counts at most this large keep the scaled sums exact (see `_exact_scale`).
_EXACT_COUNT_LIMIT = 2 ** 32
# Derived values at most this large fit the C plan's int64 arithmetic; both plans step aside above.
_PLAN_VALUE_LIMIT = 2 ** 62


class SelectionPlan:
    """least_load over the candidates of one directory snapshot (see the module docstring).

    `pick(now)` is the choice (None: take the generic path), `totals(now)` the scores. Under an
    exact scale both are proxy_workers/_select.c's where it was built (`native`): the same
    steps and the same floats as the generated function, in one C call."""

    def __init__(self, strategy: LeastLoadStrategy, snapshot: DirectorySnapshot, seg: Segment,
                 snapshots: SnapshotReader, stale_us: int, native: bool = NATIVE_SELECTION) -> None:
        self._weights = {name: w for name, w in strategy.weights.items() if w}
        self._candidates = snapshot.alive
        slots = [i.slot for i in self._candidates]
        self._snapshots = snapshots
        self._stale_us = stale_us
        self._scale = _exact_scale(self._weights)
        self._fields = [name for name in _PLAN_FIELDS if self._needs(name)]
        self._span = 1 + max(slots)
        self._snapshot_gen = -1
        self._published = 0
        self._pressure: tuple[int | float, ...] | None = None
        self._pressure_usable = False
        # The choice is the C plan's method or the generated function itself: nothing in front.
        # Only one of the two is built (compiling the Python one is most of a plan's cost).
        self._native: Any = None
        self.pick: Callable[[int], InstanceSlot | None]
        self.totals: Callable[[int], list[float] | None]
        if native and self._scale:
            self._native = self._native_plan(seg, strategy, slots, snapshot.seq)
            self.pick, self.totals = self._native.pick, self._native.totals
        else:
            lanes = CandidateLanes(seg, slots, [lane for name, lane in LANE_FIELDS.items()
                                                if name in self._weights], snapshot.seq)
            plan = _generate(self._weights, self._scale, self._candidates, lanes, self._fields,
                             strategy.select_by_totals, self._fresh_pressure)
            self.pick, self.totals = plan, functools.partial(plan, totals=True)

    def _native_plan(self, seg: Segment, strategy: LeastLoadStrategy, slots: list[int],
                     directory_seq: int) -> Any:
        """The generated function's twin in C: the same offsets, the same integer factors."""
        assert _NativePlan is not None and self._scale
        lanes = [(name, lane) for name, lane in LANE_FIELDS.items() if name in self._weights]
        return _NativePlan(
            seg.buf, tuple(self._candidates), strategy.select_by_totals, self._derive_native,
            seq_offset=CandidateLanes.directory_seq_offset, seq=directory_seq,
            pressure_generation_offset=SnapshotReader.generation_offset,
            generation_offsets=[CandidateLanes.generation_offset(s) for s in slots],
            generations=[i.generation for i in self._candidates],
            inflight_offsets=[CandidateLanes.count_offset(s, layout.LANE_INFLIGHT) for s in slots],
            term_offsets=[[CandidateLanes.count_offset(s, lane) for _, lane in lanes] for s in slots],
            term_factors=[[int(self._weights[name] * self._scale) for name, _ in lanes] for _ in slots],
            unscale=1 / self._scale, has_counts="scaled_counts" in self._fields,
            backlog_weight=self._weights.get(BACKLOG, 0.0) / 1000)

    def _derive_native(self) -> None:
        """The C plan's snapshot moved on: derive its values here, hand them over."""
        generation = self._current_generation()
        values = self._pressure if self._pressure_usable else False
        self._native.set_pressure(generation, self._published, values, self._stale_us)

    @staticmethod
    def supports(strategy: LeastLoadStrategy, snapshot: DirectorySnapshot) -> bool:
        weights = {name for name, w in strategy.weights.items() if w}
        return bool(snapshot.alive) and snapshot.stable and not snapshot.seq & 1 \
            and weights <= SUPPORTED

    def _fresh_pressure(self, now: int) -> tuple[int | float, ...] | None | bool:
        """The per-candidate values of a fresh snapshot; None if it is stale or was never
        published (the queue terms alone then); False if it describes other generations."""
        self._current_generation()
        published = self._published
        if not published or now - published > self._stale_us:
            return None
        return self._pressure if self._pressure_usable else False

    def _current_generation(self) -> int:
        """The published snapshot generation, derived from anew if it moved since last asked."""
        generation = self._snapshots.generation()
        if generation != self._snapshot_gen:
            self._derive(generation)
        return generation

    def _derive(self, generation: int) -> None:
        records = self._snapshots.records(self._span)
        self._snapshot_gen = generation
        self._published = self._snapshots.published_us() if records else 0
        self._pressure_usable = bool(records) and all(
            records[flat_index(i.slot, _R.generation)] == i.generation for i in self._candidates)
        if not self._pressure_usable:
            self._pressure = None
            return
        base = self._published
        values: list[int | float] = [base]
        for inst in self._candidates:
            values.extend(self._derived(records, inst.slot, base))
        if self._scale and any(records[flat_index(i.slot, getattr(_R, name))] >= _EXACT_COUNT_LIMIT
                               for i in self._candidates for name in RECORD_FIELDS):
            self._pressure_usable = False  # beyond what the scaled sum is exact for: generic
        if any(abs(v) >= _PLAN_VALUE_LIMIT for v in values):
            self._pressure_usable = False  # beyond the C plan's 64-bit ints (no real record is)
        self._pressure = tuple(values)

    def _derived(self, records: Sequence[int], slot: int, base: int) -> list[int | float]:
        def field(index: int) -> int:
            return records[flat_index(slot, index)]
        pending, decoding = field(_R.pending_prefill_count), field(_R.active_decode_count)
        weights, scale = self._weights, self._scale or 1
        value = {
            "pending_prefill_count": _product(pending, weights.get("pending_prefill_count")),
            "active_decode_count": _product(decoding, weights.get("active_decode_count")),
            "scaled_counts": (pending * int(weights.get("pending_prefill_count", 0) * scale)
                              + decoding * int(weights.get("active_decode_count", 0) * scale)),
            "free_at": max(field(_R.next_slot_free_at_us), field(_R.prefill_free_at_us)) - base,
            "announced": pending + decoding,
            "marginal": field(_R.marginal_backlog_us),
        }
        return [value[name] for name in self._fields]

    def _needs(self, name: str) -> bool:
        if name == "scaled_counts":
            return bool(self._scale) and any(n in self._weights for n in RECORD_FIELDS)
        if name in RECORD_FIELDS:
            return not self._scale and name in self._weights
        return BACKLOG in self._weights


def _exact_scale(weights: dict[str, float]) -> int | None:
    """2**J if every count's weight is a multiple of 2**-J (J <= 8) and at most 32, else None.

    Then every weighted count (below 2**32) and every partial sum of them is a float without
    rounding, so the sum is the same in any order: the generated code adds the counts as ints
    times weight * 2**J, and scales the int once. Adding the backlog term to that is the very
    float addition the literal sum makes, so the totals are the same bit for bit."""
    counted = [w for name, w in weights.items() if name in LANE_FIELDS or name in RECORD_FIELDS]
    for exponent in range(9):
        scale = 2 ** exponent
        if all(w <= 32 and (w * scale).is_integer() for w in counted):
            return scale
    return None


def _product(value: int, weight: float | None) -> int | float:
    """`value * weight` exactly as the generated sum spells it (`weighted_term`: no product for 1)."""
    return value if weight == 1.0 or weight is None else value * weight


def _generate(weights: dict[str, float], scale: int | None, candidates: Sequence[InstanceSlot],
              lanes: CandidateLanes, fields: list[str], ties: Callable,
              fresh_pressure: Callable) -> Callable:
    """The plan's function of (now, totals=False): the totals list if `totals`, else the
    choice; None if the directory moved, or the words or the records name other generations.
    It reads the lanes (`lanes.read`) and the plan's pressure values (`fresh_pressure`)."""
    n = len(candidates)
    lane_names = [f"v{i}" for i in range(lanes.size)]
    generations = ", ".join(lane_names[lanes.generation_index(i.slot)] for i in candidates)
    pressure_names = ["B"] + [f"{_PLAN_FIELDS[name]}{k}" for k in range(n) for name in fields]
    queue_terms, full_terms = [], []
    for k, inst in enumerate(candidates):
        counts = {name: lane_names[lanes.count_index(inst.slot, lane)]
                  for name, lane in LANE_FIELDS.items() if name in weights}
        if scale:
            queue, full = _scaled_counts(counts, weights, scale, k, "scaled_counts" in fields)
        else:
            queue = [weighted_term(value, weights[name]) for name, value in counts.items()]
            full = queue + [f"{_PLAN_FIELDS[name]}{k}" for name in RECORD_FIELDS if name in weights]
        predicted: list[str] = []
        if BACKLOG in weights:
            inflight = lane_names[lanes.count_index(inst.slot, layout.LANE_INFLIGHT)]
            free, announced, marginal = f"f{k}", f"n{k}", f"m{k}"
            predicted.append(f"(({free} - T if {free} > T else 0) + (({inflight} - {announced}) * "
                             f"{marginal} if {inflight} > {announced} else 0)) * "
                             f"{weights[BACKLOG] / 1000!r}")
        queue_terms.append(" + ".join(queue) or "0")
        full_terms.append(" + ".join(full + predicted) or "0")
    totals_ = [f"t{k}" for k in range(n)]
    unpack = ("    L = READ()\n"
              "    if L is None:\n"
              "        return None\n"
              "    P = FRESH(now)\n"
              f"    {', '.join(lane_names)}, = L\n"
              f"    if ({generations},) != GENS:\n"
              "        return None\n"
              "    if P is False:\n"
              "        return None\n"
              "    if P is None:\n"
              + "".join(f"        t{k} = {term}\n" for k, term in enumerate(queue_terms))
              + "    else:\n"
              f"        {', '.join(pressure_names)}, = P\n"
              "        T = now - B\n"
              + "".join(f"        t{k} = {term}\n" for k, term in enumerate(full_terms)))
    # The lowest total, the first of equals (min's choice); any equal one is a tie.
    lowest = ["    b = t0\n    k = 0\n    tie = False\n"]
    for k in range(1, n):
        lowest.append(f"    if t{k} <= b:\n"
                      f"        if t{k} < b:\n"
                      f"            b = t{k}\n            k = {k}\n            tie = False\n"
                      "        else:\n            tie = True\n")
    # One function for both (compiling is most of a plan's cost): the totals, or the choice.
    source = ("def plan(now, totals=False):\n" + unpack
              + f"    if totals:\n        return [{', '.join(totals_)}]\n" + "".join(lowest)
              + f"    if tie:\n        return TIES(CANDIDATES, [{', '.join(totals_)}])\n"
              "    return CANDIDATES[k]\n")
    namespace: dict[str, object] = {"GENS": tuple(i.generation for i in candidates),
                                    "CANDIDATES": tuple(candidates), "TIES": ties,
                                    "READ": lanes.read, "FRESH": fresh_pressure}
    exec(compile(source, "<least_load plan>", "exec"), namespace)
    return namespace["plan"]  # type: ignore[return-value]


def _scaled_counts(counts: dict[str, str], weights: dict[str, float], scale: int, k: int,
                   with_records: bool) -> tuple[list[str], list[str]]:
    """The exact part of a candidate's sum under `_exact_scale`, as (the queue lanes alone, for
    a stale snapshot; with the records' scaled pending/decoding int `k{k}` too): each a list of
    at most one `(ints) * 2**-J`, the counts of equal weight added before their factor."""
    by_factor: dict[int, list[str]] = {}
    for name, value in counts.items():
        by_factor.setdefault(int(weights[name] * scale), []).append(value)
    parts = [" + ".join(values) if factor == 1 else f"({' + '.join(values)}) * {factor}"
             for factor, values in by_factor.items()]
    queue_int = " + ".join(parts) or "0"
    unscale = "" if scale == 1 else f" * {1 / scale!r}"
    queue = [f"({queue_int}){unscale}"] if parts else []
    return queue, [f"({queue_int} + k{k}){unscale}"] if with_records else queue
