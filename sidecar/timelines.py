"""Per-instance queue timelines: the host-wide reservation order the original kept per process.

One timeline per instance (slot, generation), fed by events from every worker in one serial
order (the original's rules, with their defects fixed):

- reserve (released to ready): take the earliest-free of READY_CONCURRENCY slots; prefill
  starts when both that slot and the prefill chain are free; the slot stays busy through the
  predicted decode (decode occupancy is modelled, not ignored);
- first token: the request moves from pending to decoding; the prefill chain is free now and
  every remaining reservation is re-anchored on real time;
- complete (or failed, or cancelled): the reservation goes away; if it never saw its first
  token the others are re-anchored too.

Three things the workers cannot know are learned here, per instance: how many sequences it
really runs at once (its registered max_num_seqs, when below READY_CONCURRENCY), its pace
(cacheroute_proxy/pace.py), the factor by which its prefills are slower or faster than the
predictor profile, and its decode pace, the same for its decodes (first token -> completion):
decode holds the slots a burst waits for, and batched decode runs slower than the profile's
prefill pace says.

All times are wall-clock seconds; snapshots publish them as absolute microseconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from shm_schema.snapshot import Pressure

from cacheroute_proxy.pace import Pace

RECENT_WEIGHT = 0.2  # of the newest reservation in the moving averages of service and decode
# The pace is learned only from first tokens predicted to wait at most this long: a queued
# request's prediction is the serial prefill chain's, and an engine that batches the prefills of
# a queue answers them sooner -- learned from, the busiest engine would look the fastest and
# draw still more (the pace measures the instance, not the queue model).
QUEUED_S = 0.001


class Reservation:
    """One request's place on its instance's timeline. Its predicted first token is read
    through the timeline, which brings a deferred re-anchoring up to date first."""

    __slots__ = ("key", "service_s", "decode_s", "profile_decode_s", "reserved_at",
                 "_predicted_first_token", "first_token_at", "late", "_timeline")

    def __init__(self, key: int, service_s: float, decode_s: float, reserved_at: float,
                 timeline: "InstanceTimeline | None" = None, profile_decode_s: float = 0.0) -> None:
        self.key = key
        self.service_s = service_s
        self.decode_s = decode_s
        self.profile_decode_s = profile_decode_s  # the workers' prediction, before any pace
        self.reserved_at = reserved_at
        self._predicted_first_token = 0.0
        self.first_token_at: float | None = None
        self.late = -1  # the timeline's anchor count if reserved while a re-anchoring was owed
        self._timeline = timeline

    @property
    def predicted_first_token(self) -> float:
        if self._timeline is not None:
            self._timeline.settle()
        return self._predicted_first_token

    @property
    def predicted_end(self) -> float:
        start = self.predicted_first_token if self.first_token_at is None else self.first_token_at
        return start + self.decode_s


@dataclass
class InstanceTimeline:
    """One instance's slots and prefill chain.

    Re-anchoring (`_recompute(now)`) is a pure function of the decoding set, the pending
    reservations in order and `now`: a later one overwrites everything an earlier one wrote.
    So it is owed, not run: a first token or an early completion records its time as the
    anchor (`_stale_at`), and what happens before the owed re-anchoring runs is recorded in
    the form it would act on it:
    - a reservation joins the pending order, marked as made after the anchor: re-anchoring
      gives it what reserving on the re-anchored state would (its own time as a floor);
    - a decoding request that completes leaves the slot it held to the owed state (a
      completion never re-anchors, so that slot stays in the predictions until the next one);
    - a first token needs only its request's prediction for its pace observation: for the
      oldest pending request, the earliest slot of the owed state; for another, while the
      reservations before it each take an idle slot (READY_CONCURRENCY is rarely full), the
      prefill chain up to it. Otherwise it settles first.
    `settle()` runs the owed re-anchoring: before a pressure is published, or when anything
    reads `slot_free`, `prefill_free` or a reservation's prediction. Every reader sees exactly
    what re-anchoring on every event would produce (tests/test_timelines.py holds the two to
    equal floats on random event sequences); the sidecar re-anchors about once per published
    snapshot instead of once per request."""
    ready_slots: int
    pace: Pace = field(default_factory=lambda: Pace(step=0.0))
    where: tuple[int, int] = (0, 0)  # the instance: (slot, generation)
    # When each ready slot frees up, as a min-heap: only the multiset matters (the earliest
    # free slot is taken), and READY_CONCURRENCY may be 64, where a linear min per event was
    # most of the sidecar's CPU.
    _slot_free: list[float] = field(default_factory=list)
    _prefill_free: float = 0.0
    pending: dict[int, Reservation] = field(default_factory=dict)   # reservation order
    decoding: dict[int, Reservation] = field(default_factory=dict)
    # Recent pace-scaled service and decode times (moving averages), for the marginal backlog.
    recent_service_s: float = 0.0
    recent_decode_s: float = 0.0
    # Predicted ends of the decoding requests (first token + decode), by key: the slots they
    # hold, read as plain floats by every re-anchoring.
    _decode_ends: dict[int, float] = field(default_factory=dict)
    _stale_at: float | None = None  # the anchor of the owed re-anchoring, if one is owed
    _anchors: int = 0               # anchors so far: a reservation made after the last one
    _ghost_ends: list[float] = field(default_factory=list)  # slots of decodes since completed
    # Learned at the pace's step from completed decodes; until the first, decodes take the pace.
    decode_pace: Pace = field(init=False)

    def __post_init__(self) -> None:
        if not self._slot_free:
            self._slot_free = [0.0] * self.ready_slots
        self.decode_pace = Pace(self.pace.step)

    @property
    def decode_factor(self) -> float:
        decode_pace = self.decode_pace
        return decode_pace.factor if decode_pace.observations else self.pace.factor

    @property
    def slot_free(self) -> list[float]:
        self.settle()
        return self._slot_free

    @property
    def prefill_free(self) -> float:
        self.settle()
        return self._prefill_free

    def settle(self) -> None:
        """Run the owed re-anchoring, if any."""
        if self._stale_at is not None:
            self._recompute(self._stale_at)
            self._stale_at = None
            self._ghost_ends.clear()

    def _owe(self, now: float) -> None:
        """Re-anchoring on `now` is owed: it replaces whatever was owed before."""
        self._stale_at = now
        self._anchors += 1
        if self._ghost_ends:
            self._ghost_ends.clear()

    def reserve(self, key: int, t: float, service_s: float, decode_s: float) -> Reservation:
        res = Reservation(key, service_s * self.pace.factor, decode_s * self.decode_factor, t, self,
                          decode_s)
        # The moving averages of the marginal backlog (the first reservation seeds them).
        if not self.recent_service_s and not self.recent_decode_s:
            self.recent_service_s, self.recent_decode_s = res.service_s, res.decode_s
        else:
            self.recent_service_s += RECENT_WEIGHT * (res.service_s - self.recent_service_s)
            self.recent_decode_s += RECENT_WEIGHT * (res.decode_s - self.recent_decode_s)
        self.pending[key] = res
        if self._stale_at is not None:
            res.late = self._anchors  # placed when the owed re-anchoring runs
            return res
        slot_free, prefill_free = self._slot_free, self._prefill_free
        prefill_start = t if t > slot_free[0] else slot_free[0]
        if prefill_free > prefill_start:
            prefill_start = prefill_free
        res._predicted_first_token = first = prefill_start + res.service_s
        heapq.heapreplace(slot_free, first + res.decode_s)
        self._prefill_free = first
        return res

    def first_token(self, key: int, t: float) -> None:
        pending = self.pending
        res = pending.get(key)
        if res is None:
            return
        if self._stale_at is None:
            predicted = res._predicted_first_token
        elif next(iter(pending)) == key:
            predicted = self._owed_first_prediction(res)
        else:
            predicted = self._owed_chain(until=key)
            if predicted is None:
                self.settle()
                predicted = res._predicted_first_token
        del pending[key]
        if predicted - res.service_s - res.reserved_at <= QUEUED_S:
            self.pace.observe(predicted - res.reserved_at, t - res.reserved_at)
        res.first_token_at = t
        self.decoding[key] = res
        self._decode_ends[key] = t + res.decode_s
        self._owe(t)

    def _owed_first_prediction(self, res: Reservation) -> float:
        """The prediction the owed re-anchoring gives the oldest pending reservation: it
        starts at the earliest slot of the re-anchored state (or its own time, if reserved
        after the anchor), the same arithmetic as `_recompute`'s first step."""
        now = self._stale_at
        assert now is not None
        ends, ghosts = self._decode_ends, self._ghost_ends
        start = now
        if len(ends) + len(ghosts) >= self.ready_slots:  # no slot idle: the earliest busy one
            earliest = min(min(ends.values(), default=math.inf), min(ghosts, default=math.inf))
            if earliest > start:
                start = earliest
        if res.late == self._anchors and res.reserved_at > start:
            start = res.reserved_at
        return start + res.service_s

    def _owed_chain(self, until: int | None = None) -> float | None:
        """Where the owed re-anchoring ends the prefill chain: after reservation `until`, or
        after every pending one (None) - if each up to there takes an idle slot: then each
        starts when the chain is free (or at its own time, if reserved after the anchor), as
        `_recompute` chains them. None when the slots run out first."""
        cursor = self._stale_at
        assert cursor is not None
        idle = self.ready_slots - len(self._decode_ends) - len(self._ghost_ends)
        anchors = self._anchors
        for position, (key, res) in enumerate(self.pending.items()):
            if position >= idle:
                return None
            if res.late == anchors and res.reserved_at > cursor:
                cursor = res.reserved_at
            cursor += res.service_s
            if key == until:
                return cursor
        return cursor

    def complete(self, key: int, t: float, failed: bool = False) -> None:
        """The request ended: finished, or `failed` (an error or a cancel, which says nothing of
        how long the engine's decode takes)."""
        res = self.decoding.pop(key, None)
        if res is not None:
            if not failed:
                self._observe_decode(res, t)
            end = self._decode_ends.pop(key)
            if self._stale_at is not None:
                self._ghost_ends.append(end)  # its slot is part of the owed state
        elif self.pending.pop(key, None) is not None:
            self._owe(t)

    def _observe_decode(self, res: Reservation, t: float) -> None:
        """Learn the decode pace from a decode that ran to its end, starting from the factor
        decodes took until now (`decode_factor`: before the first, the pace's), so predictions
        do not jump back to the profile's."""
        assert res.first_token_at is not None
        decode_pace = self.decode_pace
        decode_pace.factor = self.decode_factor
        decode_pace.observe(res.profile_decode_s * decode_pace.factor, t - res.first_token_at)

    def drop(self, keys: set[int], t: float) -> None:
        for key in keys:
            self.decoding.pop(key, None)
            self._decode_ends.pop(key, None)
            self.pending.pop(key, None)
        self._owe(t)

    def _recompute(self, now: float) -> None:
        """Re-anchor every pending reservation on `now` (service times are not re-predicted):
        the slots are those of the decoding requests (and of decodes completed since the
        anchor), a reservation made after the anchor starts no earlier than its own time.
        The same arithmetic, in the same order, as reserving one by one: equal floats."""
        busy = sorted([end if end > now else now
                       for end in itertools.chain(self._decode_ends.values(), self._ghost_ends)])
        free = self.ready_slots - len(busy)
        anchors, cursor = self._anchors, now
        if len(self.pending) < free:
            # Every reservation takes an idle slot (free at `now`, never later than the chain)
            # and one stays idle: each starts when the prefill chain is free, no heap needed.
            for res in self.pending.values():
                start = res.reserved_at if res.late == anchors and res.reserved_at > cursor else cursor
                res._predicted_first_token = cursor = start + res.service_s
                busy.append(cursor + res.decode_s)
            self._slot_free = [now] * (free - len(self.pending)) + sorted(busy)
            self._prefill_free = cursor
            return
        # A sorted list is a heap: the idle slots first, then the busy ones.
        slots = [now] * free + busy if free > 0 else busy[:self.ready_slots]
        replace = heapq.heapreplace
        for res in self.pending.values():
            start = slots[0]
            if cursor > start:
                start = cursor
            if res.late == anchors and res.reserved_at > start:
                start = res.reserved_at
            res._predicted_first_token = cursor = start + res.service_s
            replace(slots, cursor + res.decode_s)
        self._slot_free = slots
        self._prefill_free = cursor

    def marginal_backlog_s(self) -> float:
        """What one more request adds to the backlog: its prefill on the serial chain, or its
        share of the slots it occupies through decode when that is more."""
        return max(self.recent_service_s,
                   (self.recent_service_s + self.recent_decode_s) / self.ready_slots)

    def pressure(self, generation: int) -> Pressure:
        ends = self._decode_ends
        # What the owed re-anchoring would give, without running it, while an idle slot
        # remains after the chain (the earliest free is then the anchor); it stays owed.
        owed = self._stale_at
        if owed is not None and len(self.pending) < self.ready_slots - len(ends) - len(self._ghost_ends):
            next_slot_free, prefill_free = owed, self._owed_chain()
        else:
            self.settle()
            next_slot_free, prefill_free = self._slot_free[0], self._prefill_free
        pace = self.pace
        return Pressure(generation, len(self.pending), len(ends), int(next_slot_free * 1e6),
                        int(prefill_free * 1e6), int(max(ends.values(), default=0.0) * 1e6),
                        int(self.marginal_backlog_s() * 1e6),
                        int(pace.factor * 1e6) if pace.observations else 0)

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
        self._where: dict[int, InstanceTimeline] = {}  # request key -> its instance's timeline

    def timeline(self, slot: int, generation: int) -> InstanceTimeline:
        key = (slot, generation)
        timeline = self._by_instance.get(key)
        if timeline is None:
            limit = self._max_num_seqs(slot, generation)
            slots = min(self.ready_slots, limit) if limit > 0 else self.ready_slots
            timeline = self._by_instance[key] = InstanceTimeline(slots, Pace(self.pace_step),
                                                                 where=key)
        return timeline

    # The three per-request events: the sidecar's hottest code (one call per event).
    def reserve(self, slot: int, generation: int, key: int, t: float, service_s: float,
                decode_s: float) -> None:
        where = self._where
        previous = where.get(key)
        if previous is not None:  # a re-sent reservation replaces the old one
            del where[key]
            previous.complete(key, t)
        timeline = self._by_instance.get((slot, generation)) or self.timeline(slot, generation)
        timeline.reserve(key, t, service_s, decode_s)
        where[key] = timeline

    def first_token(self, key: int, t: float) -> None:
        timeline = self._where.get(key)
        if timeline is not None:
            timeline.first_token(key, t)

    def complete(self, key: int, t: float, failed: bool = False) -> None:
        timeline = self._where.pop(key, None)
        if timeline is not None:
            timeline.complete(key, t, failed)

    def drop_keys(self, predicate: Callable[[int], bool], t: float) -> int:
        doomed = [k for k in self._where if predicate(k)]
        by_instance: dict[tuple[int, int], set[int]] = {}
        for key in doomed:
            by_instance.setdefault(self._where.pop(key).where, set()).add(key)
        for where, keys in by_instance.items():
            self._by_instance[where].drop(keys, t)
        return len(doomed)

    def forget_instances(self, live: set[tuple[int, int]], t: float) -> None:
        """Drop the timelines of instances that are gone (slot freed or reused)."""
        for where in [w for w in self._by_instance if w not in live]:
            del self._by_instance[where]
        self._where = {k: tl for k, tl in self._where.items() if tl.where in live}

    def expire(self, max_age_s: float, now: float) -> int:
        expired = 0
        for timeline in self._by_instance.values():
            expired += timeline.expire(now - max_age_s, now)
        live_keys = {k for t in self._by_instance.values() for k in (*t.pending, *t.decoding)}
        self._where = {k: tl for k, tl in self._where.items() if k in live_keys}
        return expired

    def by_instance(self) -> dict[tuple[int, int], InstanceTimeline]:
        return dict(self._by_instance)

    def pressures(self) -> dict[int, Pressure]:
        return {slot: t.pressure(gen) for (slot, gen), t in self._by_instance.items()}

    def counts(self) -> tuple[int, int]:
        pending = sum(len(t.pending) for t in self._by_instance.values())
        decoding = sum(len(t.decoding) for t in self._by_instance.values())
        return pending, decoding
