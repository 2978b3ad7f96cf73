"""Draining the workers' event rings into the timelines and publishing pressure snapshots.

Runs on the sidecar's loop every few milliseconds (PROXY_EVENT_POLL_MS) while events come
often (busier, as often as it publishes), else when a worker's doorbell ring says one came.
Publishes when something changed (at once after a ring; while polling, at most every
`min_publish_interval_s`) and at least every `heartbeat_s`, so a worker can tell a quiet
sidecar (fresh snapshot, nothing pending) from a dead one (the snapshot ages past
PROXY_SNAPSHOT_STALE_MS). Every publish also stamps the header's sidecar heartbeat. A snapshot
holds absolute times computed on events, so republishing an unchanged one changes nothing but
its age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from shm_schema import DirectoryReader, Segment, header, read_all
from shm_schema.bitfields import RequestKey
from shm_schema.events import Event, EventHandlers, EventKind, EventReader
from shm_schema.snapshot import Pressure, SnapshotWriter

from cacheroute_proxy.doorbell import Doorbell

from .affinity import AffinityModels
from .prompt_homes import Candidate, PromptHomes
from .timelines import Timelines

log = logging.getLogger("cacheroute.sidecar.pressure")

# After a tick that took events, poll again while they come closer together than this many
# poll intervals on average (run); a gap counts at most MAX_GAP_POLLS of them, GAP_WEIGHT the
# moving average's weight of the newest.
POLL_WHILE_GAP_BELOW = 2.0
MAX_GAP_POLLS = 8.0
GAP_WEIGHT = 0.25
# Polling, a tick that took at least this many events is busy: the next one is sure to find
# some, so it comes when the next publish is due rather than after one poll (run).
BUSY_TICK_EVENTS = 4


@dataclass
class ChannelStats:
    consumed: int = 0
    stale_epoch: int = 0
    unknown_instance: int = 0
    expired_reservations: int = 0
    dropped_by_workers: int = 0
    published: int = 0


class PressurePublisher:
    def __init__(self, seg: Segment, epoch: int, ready_slots: int, pace_step: float = 0.0,
                 min_publish_interval_s: float = 0.01, heartbeat_s: float = 0.5,
                 reservation_max_age_s: float = 900.0,
                 affinity: AffinityModels | None = None, homes: PromptHomes | None = None) -> None:
        self._seg = seg
        self.affinity = affinity  # RESIDENT and PREFIX events feed the affinity index
        self.homes = homes  # and PREFIX events the prompts' rates
        self._doorbell: Doorbell | None = None  # set by run()
        self.epoch = epoch
        self._reader = EventReader(seg)
        self._writer = SnapshotWriter(seg)
        self._directory = DirectoryReader(seg)
        self.timelines = Timelines(ready_slots, pace_step, self._max_num_seqs)
        self._owners: dict[int, int] = {}  # row -> identity whose reservations we hold
        self._identities: tuple[int, ...] = ()  # every row's owner at the last tick
        # Called when a row was claimed, released or reused: the reaper watches a new worker.
        self.on_rows_changed: list[Callable[[], None]] = []
        self._dirty = True
        self._last_publish = 0.0  # time.monotonic(): the pacing must not follow the wall clock
        self._events_at = time.monotonic()  # the last tick that took events (run)
        self._event_gap_s = 0.0  # their mean gap: from 0, polling until it says otherwise
        self._paced = True  # publishes at most every min_publish_interval_s (run: while polling)
        self._min_interval = min_publish_interval_s
        self._heartbeat = heartbeat_s
        self._max_age = reservation_max_age_s
        self._next_expiry = time.monotonic() + 10.0
        self.stats = ChannelStats()
        timelines = self.timelines
        self._handlers = EventHandlers(timelines.reserve, timelines.first_token,
                                       timelines.complete, self._apply_other)

    def tick(self) -> int:
        """Drain the rings, publish what is due; the events taken."""
        now = time.time()
        consumed = self.stats.consumed
        scan = self._reader.scan()
        if scan.identities != self._identities:  # a row was claimed, released or reused
            self._identities = scan.identities
            self._forget_departed_rows({row: identity for row, identity in enumerate(scan.identities)
                                        if identity}, now)
            for hook in self.on_rows_changed:
                hook()
        for row in scan.unread:
            self._drain(row)
        self.stats.dropped_by_workers = scan.dropped + header.events_dropped_gone(self._seg)
        if time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + 10.0
            self._housekeeping(now)
        since = time.monotonic() - self._last_publish
        if (self._dirty and (not self._paced or since >= self._min_interval)) or since >= self._heartbeat:
            self._publish(now)
        if self.affinity is not None:
            self.affinity.publish()
        if self.homes is not None:
            self.homes.tick(now, self._home_candidates)
        return self.stats.consumed - consumed

    async def run(self, poll_s: float, doorbell: Doorbell | None) -> None:
        """Tick every `poll_s` while events come often; otherwise sleep until a worker rings the
        doorbell, an engine's KV events change an affinity row, a publish the minimum interval
        held back while polling is due, or the snapshot heartbeat is
        (cacheroute_proxy/doorbell.py).

        A wake costs about as much CPU as a tick's work, whether a timer or a ring makes it.
        Events that come closer together than POLL_WHILE_GAP_BELOW polls apart (on average, the
        tick's events counted once) are taken by the next poll with fewer wakes than rings; far
        apart -- requests tens of milliseconds or more apart, as on a real engine -- a poll
        after each would find nothing, so the sidecar sleeps from the tick that took one until
        the next rings (first tokens and completions ring no one: shm_schema/events.py).
        Busier -- a tick took BUSY_TICK_EVENTS or more -- the polls between two publishes are
        left out."""
        self._doorbell = doorbell
        if doorbell is not None and self.affinity is not None:
            self.affinity.on_change = doorbell.ring_here
        tick_s = poll_s  # how long the sidecar slept before this tick, if no ring woke it
        while True:
            took = self._safe_tick()
            if took:
                self._time_events(poll_s, tick_s)
            # Polling, publishes are paced by the minimum interval; a tick a ring woke publishes
            # what it took at once (a wake of its own for it would cost as much as the tick).
            if doorbell is None or (took > 0 and self._event_gap_s < POLL_WHILE_GAP_BELOW * poll_s):
                # Busy, a tick between two publishes would only drain events, which carry their
                # own times: the next tick is the next publish's, its sleep the pacing.
                busy = took >= BUSY_TICK_EVENTS
                tick_s = max(poll_s, self._next_publish_in()) if busy else poll_s
                self._paced = not busy
                await asyncio.sleep(tick_s)
                continue
            self._paced = False
            tick_s = poll_s
            doorbell.settle()  # the tick published what changed before it
            header.set_sidecar_sleeping(self._seg, True)
            if not self._events_waiting():  # else written before the word was set: no ring comes
                await doorbell.wait(self._next_publish_in() if self._dirty else self._heartbeat)
            header.set_sidecar_sleeping(self._seg, False)

    def _time_events(self, poll_s: float, tick_s: float) -> None:
        """The moving average of the time between ticks that take events, in polls: a busy
        tick's `tick_s`, longer than a poll, counts as one. A gap counts at most MAX_GAP_POLLS
        polls: after a quiet spell, a few close events bring back the polling."""
        now = time.monotonic()
        gap = min((now - self._events_at) * poll_s / tick_s, MAX_GAP_POLLS * poll_s)
        self._events_at = now
        self._event_gap_s += GAP_WEIGHT * (gap - self._event_gap_s)

    def _next_publish_in(self) -> float:
        """Seconds until the minimum interval lets the publish held back go out."""
        return max(0.0, self._last_publish + self._min_interval - time.monotonic())

    def _events_waiting(self) -> bool:
        """An unread event in any ring: one scan, none of a tick's work."""
        return bool(self._reader.scan().unread)

    def _safe_tick(self) -> int:
        try:
            return self.tick()
        except Exception:  # a bug in one tick must not stop the next
            log.exception("event channel tick failed")
            return 0

    def drain_dead_row(self, row: int) -> None:
        """Before a dead worker's row is freed: take what it wrote, then drop what it held."""
        self._drain(row)
        self._drop_row(row, time.time())
        self._owners.pop(row, None)

    # --- internals ------------------------------------------------------------------------
    def _drain(self, row: int) -> None:
        taken, stale = self._reader.consume(row, self.epoch, self._handlers, limit=4096)
        if taken:
            self.stats.consumed += taken
            self.stats.stale_epoch += stale  # written for a sidecar that has since restarted
            if taken > stale:
                self._dirty = True

    def _apply_other(self, event: Event) -> None:
        """RESIDENT and PREFIX feed the affinity index, PREFIX the prompts' homes."""
        if self.affinity is not None:
            self.affinity.apply(event)
        if self.homes is not None and event.kind == EventKind.PREFIX:
            self.homes.observe(event)

    def _home_candidates(self) -> list[Candidate]:
        """The candidate set, each instance at its learned speed (1 if not learned yet), with
        its KV capacity and the requests it runs at once."""
        timelines = self.timelines.by_instance()
        capacity = self.affinity.capacity_tokens if self.affinity is not None else lambda *_: 0
        candidates = []
        for instance in self._directory.snapshot().alive:
            where = (instance.slot, instance.generation)
            timeline = timelines.get(where)
            pace = timeline.pace.factor if timeline is not None and timeline.pace.observations else 1.0
            candidates.append(Candidate(where, instance.instance_id, 1.0 / pace, max(0, capacity(*where)),
                                        timeline.ready_slots if timeline is not None else 0))
        return candidates

    def _max_num_seqs(self, slot: int, generation: int) -> int:
        for instance in self._directory.snapshot().instances:
            if (instance.slot, instance.generation) == (slot, generation):
                return instance.max_num_seqs
        return 0

    def _forget_departed_rows(self, owners: dict[int, int], now: float) -> None:
        """A row whose owner changed or left (clean exit): its requests are gone."""
        for row, identity in list(self._owners.items()):
            if owners.get(row) != identity:
                self._drop_row(row, now)
                del self._owners[row]
        for row, identity in owners.items():
            self._owners.setdefault(row, identity)

    def _drop_row(self, row: int, now: float) -> None:
        if self.timelines.drop_keys(lambda key: RequestKey.row(key) == row, now):
            self._dirty = True

    def _housekeeping(self, now: float) -> None:
        live = {(s.slot, s.generation) for s in read_all(self._seg)}
        self.timelines.forget_instances(live, now)
        expired = self.timelines.expire(self._max_age, now)
        if expired:
            self.stats.expired_reservations += expired
            log.warning("expired %d reservations older than %.0fs (completion never reported)",
                        expired, self._max_age)
            self._dirty = True

    def _publish(self, now: float) -> None:
        # Every registered instance gets a record: an idle one is a measured zero, not unknown.
        now_us = int(now * 1e6)
        pressures = self.timelines.pressures()
        records = {}
        for instance in self._directory.snapshot().instances:
            pressure = pressures.get(instance.slot)
            if pressure is None or pressure.generation != instance.generation:
                pressure = Pressure(instance.generation, 0, 0, now_us, now_us, now_us)
            records[instance.slot] = pressure
        self._writer.publish(records)
        header.sidecar_heartbeat(self._seg)
        self._last_publish = time.monotonic()
        self._dirty = False
        self.stats.published += 1

    def describe(self) -> dict[str, Any]:
        pending, decoding = self.timelines.counts()
        return {"epoch": self.epoch, "timelines": self._describe_timelines(),
                "events_consumed": self.stats.consumed,
                "events_dropped_by_workers": self.stats.dropped_by_workers,
                "events_from_previous_epoch": self.stats.stale_epoch,
                "expired_reservations": self.stats.expired_reservations,
                "snapshots_published": self.stats.published,
                "pending_reservations": pending, "decoding": decoding,
                "affinity": None if self.affinity is None else self.affinity.describe(
                    {(i.slot, i.generation): i.instance_id for i in self._directory.snapshot().instances}),
                "prompt_homes": None if self.homes is None else self.homes.describe(),
                "doorbell": None if self._doorbell is None else {
                    "sleeping": header.sidecar_sleeping(self._seg), "rings": self._doorbell.rings}}

    def _describe_timelines(self) -> dict[str, dict[str, Any]]:
        """Per instance id: the slots its timeline models and its learned paces."""
        names = {(i.slot, i.generation): i.instance_id for i in self._directory.snapshot().instances}
        return {names[where]: {"slots": timeline.ready_slots,
                               "pace": round(timeline.pace.factor, 3),
                               "pace_observations": timeline.pace.observations,
                               "decode_pace": round(timeline.decode_factor, 3),
                               "decode_pace_observations": timeline.decode_pace.observations,
                               "marginal_backlog_ms": round(timeline.marginal_backlog_s() * 1000, 1)}
                for where, timeline in self.timelines.by_instance().items() if where in names}
