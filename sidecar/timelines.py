"""Per-instance queue timelines: the host-wide reservation order the original kept per process.

One timeline per instance (slot, generation), fed by events from every worker in one serial
order (docs/architecture.md §6: the original's rules, with their defects fixed):

- reserve (released to ready): take the earliest-free of READY_CONCURRENCY slots; prefill
  starts when both that slot and the prefill chain are free; the slot stays busy through the
  predicted decode (decode occupancy is modelled, not ignored);
- first token: the request moves from pending to decoding; the prefill chain is free now and
  every remaining reservation is re-anchored on real time;
- complete (or failed, or cancelled): the reservation goes away; if it never saw its first
  token the others are re-anchored too.

Two things the workers cannot know are learned here, per instance: how many sequences it
really runs at once (its registered max_num_seqs, when below READY_CONCURRENCY) and its pace
(sidecar/pace.py), the factor by which it is slower or faster than the predictor profile.

All times are wall-clock seconds; snapshots publish them as absolute microseconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from shm_schema.snapshot import Pressure

from .pace import Pace

RECENT_WEIGHT = 0.2  # of the newest reservation in the moving averages of service and decode


@dataclass
class Reservation:
    key: int
    service_s: float
    decode_s: float
    reserved_at: float
    predicted_first_token: float = 0.0
    first_token_at: float | None = None

    @property
    def predicted_end(self) -> float:
        start = self.predicted_first_token if self.first_token_at is None else self.first_token_at
        return start + self.decode_s


@dataclass
class InstanceTimeline:
    ready_slots: int
    pace: Pace = field(default_factory=lambda: Pace(step=0.0))
    # When each ready slot frees up, as a min-heap: only the multiset matters (the earliest
    # free slot is taken), and READY_CONCURRENCY may be 64, where a linear min per event was
    # most of the sidecar's CPU.
    slot_free: list[float] = field(default_factory=list)
    prefill_free: float = 0.0
    pending: dict[int, Reservation] = field(default_factory=dict)   # reservation order
    decoding: dict[int, Reservation] = field(default_factory=dict)
    # Recent pace-scaled service and decode times (moving averages), for the marginal backlog.
    recent_service_s: float = 0.0
    recent_decode_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.slot_free:
            self.slot_free = [0.0] * self.ready_slots

    def reserve(self, key: int, t: float, service_s: float, decode_s: float) -> Reservation:
        factor = self.pace.factor
        res = Reservation(key, service_s * factor, decode_s * factor, reserved_at=t)
        self._remember_durations(res)
        prefill_start = max(t, self.slot_free[0], self.prefill_free)
        res.predicted_first_token = prefill_start + res.service_s
        heapq.heapreplace(self.slot_free, res.predicted_end)
        self.prefill_free = res.predicted_first_token
        self.pending[key] = res
        return res

    def first_token(self, key: int, t: float) -> None:
        res = self.pending.pop(key, None)
        if res is None:
            return
        self.pace.observe(res.predicted_first_token - res.reserved_at, t - res.reserved_at)
        res.first_token_at = t
        self.decoding[key] = res
        self._recompute(t)

    def complete(self, key: int, t: float) -> None:
        self.decoding.pop(key, None)
        if self.pending.pop(key, None) is not None:
            self._recompute(t)

    def drop(self, keys: set[int], t: float) -> None:
        for key in keys:
            self.decoding.pop(key, None)
            self.pending.pop(key, None)
        self._recompute(t)

    def _recompute(self, now: float) -> None:
        """Re-anchor every pending reservation on `now` (service times are not re-predicted)."""
        busy = [max(now, r.predicted_end) for r in self.decoding.values()]
        if len(busy) >= self.ready_slots:
            slots = heapq.nsmallest(self.ready_slots, busy)  # sorted, so already a heap
        else:
            slots = [now] * (self.ready_slots - len(busy)) + sorted(busy)
        cursor = now
        for res in self.pending.values():
            res.predicted_first_token = max(slots[0], cursor) + res.service_s
            heapq.heapreplace(slots, res.predicted_end)
            cursor = res.predicted_first_token
        self.slot_free = slots
        self.prefill_free = cursor

    def _remember_durations(self, res: Reservation) -> None:
        if not self.recent_service_s and not self.recent_decode_s:
            self.recent_service_s, self.recent_decode_s = res.service_s, res.decode_s
            return
        self.recent_service_s += RECENT_WEIGHT * (res.service_s - self.recent_service_s)
        self.recent_decode_s += RECENT_WEIGHT * (res.decode_s - self.recent_decode_s)

    def marginal_backlog_s(self) -> float:
        """What one more request adds to the backlog: its prefill on the serial chain, or its
        share of the slots it occupies through decode when that is more."""
        return max(self.recent_service_s,
                   (self.recent_service_s + self.recent_decode_s) / self.ready_slots)

    def pressure(self, generation: int) -> Pressure:
        ends = [r.predicted_end for r in self.decoding.values()]
        return Pressure(generation=generation,
                        pending_prefill_count=len(self.pending),
                        active_decode_count=len(self.decoding),
                        next_slot_free_at_us=int(self.slot_free[0] * 1e6),
                        prefill_free_at_us=int(self.prefill_free * 1e6),
                        decode_free_at_us=int(max(ends, default=0.0) * 1e6),
                        marginal_backlog_us=int(self.marginal_backlog_s() * 1e6))

    def expire(self, older_than: float, now: float) -> int:
        """Drop reservations whose completion was never reported (a lost event)."""
        stale = {k for k, r in {**self.pending, **self.decoding}.items() if r.reserved_at < older_than}
        if stale:
            self.drop(stale, now)
        return len(stale)


class Timelines:
    """Every instance's timeline, keyed by (slot, generation).

    `max_num_seqs(slot, generation)` is the instance's registered sequence limit (0 = unknown);
    `pace_step` how fast paces learn (0 = off)."""

    def __init__(self, ready_slots: int, pace_step: float = 0.0,
                 max_num_seqs: Callable[[int, int], int] = lambda slot, generation: 0) -> None:
        self.ready_slots = ready_slots
        self.pace_step = pace_step
        self._max_num_seqs = max_num_seqs
        self._by_instance: dict[tuple[int, int], InstanceTimeline] = {}
        self._where: dict[int, tuple[int, int]] = {}  # request key -> instance

    def timeline(self, slot: int, generation: int) -> InstanceTimeline:
        key = (slot, generation)
        timeline = self._by_instance.get(key)
        if timeline is None:
            limit = self._max_num_seqs(slot, generation)
            slots = min(self.ready_slots, limit) if limit > 0 else self.ready_slots
            timeline = self._by_instance[key] = InstanceTimeline(slots, Pace(self.pace_step))
        return timeline

    def reserve(self, slot: int, generation: int, key: int, t: float, service_s: float,
                decode_s: float) -> None:
        self.complete(key, t)  # a re-sent reservation replaces the old one
        self.timeline(slot, generation).reserve(key, t, service_s, decode_s)
        self._where[key] = (slot, generation)

    def first_token(self, key: int, t: float) -> None:
        where = self._where.get(key)
        if where is not None:
            self._by_instance[where].first_token(key, t)

    def complete(self, key: int, t: float) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            self._by_instance[where].complete(key, t)

    def drop_keys(self, predicate: Callable[[int], bool], t: float) -> int:
        doomed = [k for k in self._where if predicate(k)]
        by_instance: dict[tuple[int, int], set[int]] = {}
        for key in doomed:
            by_instance.setdefault(self._where.pop(key), set()).add(key)
        for where, keys in by_instance.items():
            self._by_instance[where].drop(keys, t)
        return len(doomed)

    def forget_instances(self, live: set[tuple[int, int]], t: float) -> None:
        """Drop the timelines of instances that are gone (slot freed or reused)."""
        for where in [w for w in self._by_instance if w not in live]:
            del self._by_instance[where]
        self._where = {k: w for k, w in self._where.items() if w in live}

    def expire(self, max_age_s: float, now: float) -> int:
        expired = 0
        for timeline in self._by_instance.values():
            expired += timeline.expire(now - max_age_s, now)
        live_keys = {k for t in self._by_instance.values() for k in (*t.pending, *t.decoding)}
        self._where = {k: w for k, w in self._where.items() if k in live_keys}
        return expired

    def by_instance(self) -> dict[tuple[int, int], InstanceTimeline]:
        return dict(self._by_instance)

    def pressures(self) -> dict[int, Pressure]:
        return {slot: t.pressure(gen) for (slot, gen), t in self._by_instance.items()}

    def counts(self) -> tuple[int, int]:
        pending = sum(len(t.pending) for t in self._by_instance.values())
        decoding = sum(len(t.decoding) for t in self._by_instance.values())
        return pending, decoding
