"""Worker liveness and crash cleanup.

A worker is dead when the process its row names (pid + kernel start time) no longer runs, so
a recycled pid cannot keep a dead worker's row alive, and a stopped (SIGSTOP) worker is never
mistaken for a dead one: its share stays until it really exits. The dead worker's exact share
is subtracted; if it died between its two writes (journal names a slot), that slot is
re-derived from the live rows as soon as a quiescent moment allows.

Each tick (PROXY_REAPER_INTERVAL_S) looks at every row. Between ticks, a worker the reaper
watches is reaped the moment it exits: its pidfd (Linux 5.3+), opened at the first tick that
sees its row and checked to name that very process, becomes readable then. Where no pidfd can
be opened (an older kernel, a sandbox that forbids the call), the ticks alone find the dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cacheroute_proxy.clock import now_ms
from shm_schema import (
    Segment,
    header,
    layout,
    process_identity,
    read_all,
    read_rows,
    reap_row,
    reconcile,
    take_row,
)

log = logging.getLogger("cacheroute.sidecar.reaper")


@dataclass
class ReaperStats:
    reaped: int = 0
    subtracted: int = 0
    corrections: int = 0
    last_reaped: list[dict[str, Any]] = field(default_factory=list)


class WorkerReaper:
    def __init__(self, seg: Segment, audit_interval_s: float = 5.0) -> None:
        self._seg = seg
        self._pending_reconcile: set[tuple[int, int]] = set()
        self._audit_interval_s = audit_interval_s
        self._next_audit = time.monotonic() + audit_interval_s
        self._identity = process_identity.own_identity()
        self.stats = ReaperStats()
        # Called with (row, identity) after a dead row is taken and before its shares go: the
        # event consumer drains what the dead worker still had in its ring.
        self.before_reap: list[Callable[[int], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set while exits are watched
        self._watches: dict[int, tuple[int, int]] = {}  # row -> (identity, pidfd) watched

    def watch_exits(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the next tick on, reap a worker the moment it exits (its pidfd), not at a tick."""
        self._loop = loop

    def close(self) -> None:
        """Stop watching: every pidfd closed."""
        for row in list(self._watches):
            self._unwatch(row)
        self._loop = None

    @property
    def watched(self) -> int:
        return len(self._watches)

    def tick(self) -> None:
        """One pass: reap dead rows, watch the live ones, then reconcile what needs it."""
        rows = read_rows(self._seg)
        for row in rows:
            if not process_identity.is_alive(row.identity):
                self._reap(row.row, row.identity, row.pid, row.worker_index)
            elif self._loop is not None and self._watches.get(row.row, (0, 0))[0] != row.identity:
                self._watch(row.row, row.identity, row.pid)
        claimed = {row.row: row.identity for row in rows}
        for row, (identity, _) in list(self._watches.items()):
            if claimed.get(row) != identity:  # reaped, released, or claimed by another since
                self._unwatch(row)
        if time.monotonic() >= self._next_audit:
            self._next_audit = time.monotonic() + self._audit_interval_s
            self._pending_reconcile.update((slot, lane) for slot in self._active_slots()
                                           for lane in range(layout.LANES_USED))
        self._reconcile_pending()

    def _reap(self, row: int, identity: int, pid: int, worker_index: int) -> None:
        if not take_row(self._seg, row, identity, self._identity):
            return  # released and perhaps claimed again since the scan: not ours to touch
        for hook in self.before_reap:
            hook(row)
        reaped = reap_row(self._seg, row, identity, self._identity, taken=True)
        assert reaped is not None
        if reaped.pending is not None:
            self._pending_reconcile.add(reaped.pending)
        header.count_reaped_worker(self._seg)
        inflight = {slot: n for (slot, lane), n in reaped.subtracted.items() if lane == layout.LANE_INFLIGHT}
        total = sum(inflight.values())
        self.stats.reaped += 1
        self.stats.subtracted += total
        self.stats.last_reaped = (self.stats.last_reaped + [{
            "pid": pid, "worker_index": worker_index, "row": row, "subtracted": total,
            "died_mid_update": reaped.pending is not None,
            "at_ms": now_ms()}])[-10:]
        log.warning("worker pid %d (index %d, row %d) is gone: subtracted %d inflight %s%s",
                    pid, worker_index, row, total, inflight,
                    "" if reaped.pending is None else
                    f"; slot {reaped.pending[0]} lane {reaped.pending[1]} will be reconciled "
                    f"(died mid-update)")

    def _watch(self, row: int, identity: int, pid: int) -> None:
        self._unwatch(row)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # gone already: the next tick reaps it
        except (OSError, AttributeError) as exc:  # no pidfd here: the ticks alone find the dead
            log.warning("cannot watch worker exits (%s): dead workers are found at the reaper's "
                        "ticks (PROXY_REAPER_INTERVAL_S)", exc)
            self.close()
            return
        # The pid may name another process by now (the worker died and its pid was reused
        # between the tick's look and the open): then this pidfd is not the worker's.
        if not process_identity.is_alive(identity):
            os.close(pidfd)
            return
        assert self._loop is not None
        self._loop.add_reader(pidfd, self._exited, row)
        self._watches[row] = (identity, pidfd)

    def _exited(self, row: int) -> None:
        """A watched worker exited: the tick that reaps it now."""
        self._unwatch(row)
        self.tick()

    def _unwatch(self, row: int) -> None:
        watch = self._watches.pop(row, None)
        if watch is not None:
            if self._loop is not None:
                self._loop.remove_reader(watch[1])
            with contextlib.suppress(OSError):
                os.close(watch[1])

    def _reconcile_pending(self) -> None:
        for slot, lane in list(self._pending_reconcile):
            correction = reconcile(self._seg, slot, lane)
            if correction is None:
                continue  # busy right now; next tick
            self._pending_reconcile.discard((slot, lane))
            if correction:
                self.stats.corrections += 1
                log.warning("slot %d %s corrected by %+d to match the live workers' shares",
                            slot, layout.LANE_NAMES[lane], correction)

    def _active_slots(self) -> set[int]:
        return {s.slot for s in read_all(self._seg)}

    def workers(self) -> list[dict[str, Any]]:
        now_ns = time.time_ns()
        return [{"row": r.row, "pid": r.pid, "worker_index": r.worker_index,
                 "alive": process_identity.is_alive(r.identity),
                 "heartbeat_age_ms": (now_ns - r.heartbeat_ns) // 1_000_000,
                 "mid_update_slot": r.pending_slot,
                 "events_pending": r.ring_tail - r.ring_head, "events_dropped": r.events_dropped}
                for r in read_rows(self._seg)]
