"""What a selection sees: the alive candidates and their load components, read from the
shared table with plain loads (no lock, no syscall, no IPC).

Three layers, each with its own source:
- lifecycle: `inflight`, the host-wide lane every worker's begin/end changes;
- instantaneous queue: `active_prepare`, `active_ready`, `prepare_queue_depth`,
  `ready_queue_depth`, host-wide lanes changed by the workers' pipelines;
- predicted reservation pressure: `pending_prefill_count`, `active_decode_count`,
  `predicted_total_backlog_ms`, from the sidecar's snapshot (absolute times, turned into "in N
  ms" against this process's clock); the backlog also charges the requests in flight that the
  snapshot has not seen yet (host-wide inflight lane - pending - decoding) at the instance's
  marginal cost, so a burst split over several workers does not all read the same old
  backlog. Unknown (None) when the snapshot is older than `stale_ms` or the sidecar never
  published one: a dead sidecar must not read as an idle host.

`per_worker` is the ablation: only this worker's own inflight share, nothing host-wide, which
is what N independent copies of the original Proxy would see.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from cacheroute_proxy import clock
from shm_schema import (
    CountersReader,
    DirectoryReader,
    InstanceSlot,
    Segment,
    WorkerRow,
    inflight_count,
    layout,
)
from shm_schema.bitfields import CounterWord
from shm_schema.records import SNAPSHOT, SnapshotRecord
from shm_schema.snapshot import SnapshotReader, fields_at, record_at

# A record's fields by position in the flat records (`ready_wait_ms` reads them so).
_PENDING, _DECODING, _NEXT_SLOT_FREE, _PREFILL_FREE = (
    getattr(SNAPSHOT.index, name) for name in ("pending_prefill_count", "active_decode_count",
                                               "next_slot_free_at_us", "prefill_free_at_us"))

QUEUE_LANES = ("active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth")
_QUEUE_LANE_IDS = tuple(layout.LANE_NAMES.index(name) for name in QUEUE_LANES)
PREDICTED = ("pending_prefill_count", "active_decode_count", "predicted_total_backlog_ms")
RAW_PREDICTED = ("next_slot_ready_in_ms", "prefill_free_in_ms")

SOURCES = {
    "shared": {"inflight": "shared_table_inflight", "qps_1m": "instance_heartbeat",
               **dict.fromkeys(QUEUE_LANES, "shared_table_queue_lanes"),
               **dict.fromkeys(PREDICTED, "sidecar_reservation_timeline")},
    "per_worker": {"inflight": "worker_local_counter", "qps_1m": "instance_heartbeat"},
}


class SlotRef(Protocol):
    """Anything naming a slot under a generation (InstanceSlot, the sidecar's records)."""

    @property
    def slot(self) -> int: ...

    @property
    def generation(self) -> int: ...


class LoadView:
    def __init__(self, seg: Segment, mode: str = "shared", own_row: WorkerRow | None = None,
                 stale_ms: float = 2000.0) -> None:
        if mode == "per_worker" and own_row is None:
            raise ValueError("the per_worker view needs the worker's own row")
        self.mode = mode
        self._seg = seg
        self.directory = DirectoryReader(seg)
        self.snapshots = SnapshotReader(seg)
        self._counters = CountersReader(seg)
        self._own_row = own_row
        self._stale_us = int(stale_ms * 1000)
        self.sources = SOURCES[mode]

    @property
    def stale_us(self) -> int:
        """How old the predicted layer may be and still count as fresh."""
        return self._stale_us

    # --- layer availability ----------------------------------------------------------------
    def predicted_source(self, now_us: int | None = None) -> str:
        """'fresh', 'stale' (older than the limit) or 'unavailable' (never published)."""
        if self.mode != "shared":
            return "unavailable"
        published = self.snapshots.published_us()
        if not published:
            return "unavailable"
        return "fresh" if self._fresh(published, clock.now_us() if now_us is None else now_us) else "stale"

    def _fresh(self, published_us: int, now_us: int) -> bool:
        """A snapshot published at `published_us` (0: never) is fresh enough to predict from."""
        return bool(published_us) and now_us - published_us <= self._stale_us

    def ready_wait_ms(self, instance: SlotRef) -> float | None:
        """Predicted wait before a new request on `instance` could start prefill, from a fresh
        snapshot, less the completions it has not seen (as `queue_waits`); None if the predicted
        layer is unknown."""
        if self.mode != "shared":
            return None
        return self._ready_wait(instance, inflight_count(self._seg, instance.slot, instance.generation),
                                clock.now_us())

    def booking(self, instance: InstanceSlot, now_us: int) -> tuple[float | None, int]:
        """What a request's booking predicts from, once per request, at `now_us`, with one read
        of the instance's inflight count: (`ready_wait_ms`, its decode batch). The decode batch
        is how many sequences a request sent to `instance` now decodes beside (itself
        included): the requests in flight there host-wide, at most its registered max_num_seqs;
        1 in the per-worker view, which knows no host-wide count."""
        if self.mode != "shared":
            return None, 1
        inflight = inflight_count(self._seg, instance.slot, instance.generation)
        return self._ready_wait(instance, inflight, now_us), decode_batch(instance.max_num_seqs, inflight)

    def _ready_wait(self, instance: SlotRef, inflight: int | None, now_us: int) -> float | None:
        """`ready_wait_ms` with the instance's live inflight count read, at `now_us`: the four
        fields it needs read from the flat records by position, with no record built."""
        if not self._fresh(self.snapshots.published_us(), now_us):
            return None
        slot = instance.slot
        records = self.snapshots.records(slot + 1)
        at = fields_at(records, slot, instance.generation)
        if at is None:
            return None
        free_at = max(records[at + _NEXT_SLOT_FREE], records[at + _PREFILL_FREE])
        return ready_wait(free_at, now_us, records[at + _PENDING] + records[at + _DECODING], inflight)

    def queue_waits(self, instances: Sequence[SlotRef], span: int,
                    inflight: Sequence[int | None]) -> list[tuple[float | None, float]]:
        """Per instance, for kv_aware: (the predicted wait in ms before a new request's prefill
        could start, None when the predicted layer is unknown; its pace: observed / predicted
        durations, 1.0 until the sidecar has learned one).

        The wait is the backlog least_load weighs, with the completions the snapshot has not
        seen yet taken off: fewer requests in flight now than the snapshot counts means some of
        those it counts have ended since, and the backlog shrinks in proportion (none in
        flight: no wait). Without it a request sent right after another one ended would read
        the instance as busy for a snapshot's lag."""
        now_us = clock.now_us()
        fresh = self.mode == "shared" and self.predicted_source(now_us) == "fresh"
        records = self.snapshots.records(span) if fresh else ()
        waits: list[tuple[float | None, float]] = []
        for inst, count in zip(instances, inflight, strict=True):
            record = record_at(records, inst.slot, inst.generation)
            if record is None:
                waits.append((None, 1.0))
                continue
            wait = _backlog_ms(record, now_us, count) * _seen_share(record, count)
            waits.append((wait, record.pace_ppm / 1e6 if record.pace_ppm else 1.0))
        return waits

    def snapshot_age_ms(self) -> float | None:
        published = self.snapshots.published_us()
        return None if not published else (clock.now_us() - published) / 1000

    # --- reads for the selection path ---------------------------------------------------------
    def candidates(self) -> tuple[InstanceSlot, ...]:
        return self.directory.snapshot().alive

    def words(self, span: int) -> Sequence[int]:
        if self.mode == "shared" or self._own_row is None:
            return self._counters.words(span)
        return self._own_row.own_words(span)

    # --- components of any instance list (least_load's component path, debug reports) --------
    def inflight(self, instances: Sequence[SlotRef], span: int | None = None) -> list[int | None]:
        """Inflight per instance. In the shared view, None if the slot has been reused since
        the directory snapshot (unknown, not zero); in the per-worker view a share of another
        generation is this worker's 0."""
        if not instances:
            return []
        words = self.words(span or 1 + max(s.slot for s in instances))
        counts = [CounterWord.count_under(words[i.slot], i.generation) for i in instances]
        if self.mode == "per_worker":
            return [0 if count is None else count for count in counts]
        return counts

    def components(self, instances: Sequence[InstanceSlot], span: int | None = None,
                   with_raw: bool = False) -> dict[str, list[Any]]:
        """Every component (and with `with_raw`, the predicted raw times) for any instances."""
        span = span or (1 + max((s.slot for s in instances), default=-1))
        result: dict[str, list[Any]] = {"inflight": self.inflight(instances, span),
                                         "qps_1m": [inst.qps_1m for inst in instances]}
        if self.mode == "shared" and instances:
            result.update(self._queue_lanes(instances, span))
            result.update(self._predicted(instances, span, result["inflight"], with_raw))
        return result

    def _queue_lanes(self, instances: Sequence[SlotRef], span: int) -> dict[str, list[Any]]:
        lanes = self._counters.lanes(span)
        result: dict[str, list[Any]] = {name: [] for name in QUEUE_LANES}
        for inst in instances:
            for lane, name in zip(_QUEUE_LANE_IDS, QUEUE_LANES):
                word = lanes[layout.lane_index(inst.slot, lane)]
                result[name].append(CounterWord.count_under(word, inst.generation))
        return result

    def _predicted(self, instances: Sequence[SlotRef], span: int, inflight: Sequence[int | None],
                   with_raw: bool = False) -> dict[str, list[Any]]:
        now_us = clock.now_us()
        names = PREDICTED + (RAW_PREDICTED if with_raw else ())
        result: dict[str, list[Any]] = {name: [] for name in names}
        fresh = self.predicted_source(now_us) == "fresh"
        records = self.snapshots.records(span) if fresh else ()
        for inst, count in zip(instances, inflight, strict=True):
            record = record_at(records, inst.slot, inst.generation)
            if record is None:
                for name in names:
                    result[name].append(None)
                continue
            slot_in, prefill_in = _free_in_ms(record, now_us)
            result["pending_prefill_count"].append(record.pending_prefill_count)
            result["active_decode_count"].append(record.active_decode_count)
            result["predicted_total_backlog_ms"].append(_backlog_ms(record, now_us, count))
            if with_raw:
                result["next_slot_ready_in_ms"].append(slot_in)
                result["prefill_free_in_ms"].append(prefill_in)
        return result


def decode_batch(limit: int, inflight: int | None) -> int:
    """`LoadView.booking`'s decode batch, from the instance's host-wide inflight count and its
    max_num_seqs (`limit`, 0 for none known)."""
    count = inflight or 1
    return count if not limit or count < limit else limit


def _announced(record: SnapshotRecord) -> int:
    """The requests the snapshot counts on an instance. Live inflight above it: some were sent
    since (`_backlog_ms` charges them); below it: some ended since (`_seen_share`)."""
    return record.pending_prefill_count + record.active_decode_count


def _seen_share(record: SnapshotRecord, inflight: int | None) -> float:
    return seen_share(_announced(record), inflight)


def seen_share(announced: int, inflight: int | None) -> float:
    """The share of the `announced` requests the snapshot counts on an instance that are still
    in flight: below 1 when some ended since (completions reach the sidecar with its next tick),
    and the predicted wait shrinks in proportion (none in flight: no wait)."""
    return inflight / announced if inflight is not None and inflight < announced else 1.0


def _backlog_ms(record: SnapshotRecord, now_us: int, inflight: int | None) -> float:
    return backlog_ms(max(record.next_slot_free_at_us, record.prefill_free_at_us), now_us,
                      0 if inflight is None else inflight, _announced(record),
                      record.marginal_backlog_us)


def ready_wait(free_at_us: int, now_us: int, announced: int, inflight: int | None) -> float:
    """A request's predicted wait on an instance before its prefill could start: until
    `free_at_us` (the backlog without the unseen requests' charge), times the share of the
    `announced` requests still in flight. The one spelling of the booking's wait (the C
    selector's `booking` computes the same)."""
    return backlog_ms(free_at_us, now_us, 0, 0, 0) * seen_share(announced, inflight)


def backlog_ms(free_at_us: int, now_us: int, inflight: int, announced: int, marginal_us: int) -> float:
    """How long before a new request's prefill could start: until `free_at_us`, the later of the
    next free slot and the free prefill chain (never negative), plus the requests in flight
    beyond the `announced` ones the timeline has seen (selected since the snapshot, by any
    worker) at the instance's marginal cost each. The one spelling of the backlog: least_load's
    Python selector maps it over its columns."""
    unseen = inflight - announced if inflight > announced else 0
    return ((free_at_us - now_us) / 1000 if free_at_us > now_us else 0.0) + unseen * marginal_us / 1000


def _free_in_ms(record: SnapshotRecord, now_us: int) -> tuple[float, float]:
    """(next READY slot free in, prefill chain free in), ms from now, never negative."""
    return (max(0.0, (record.next_slot_free_at_us - now_us) / 1000),
            max(0.0, (record.prefill_free_at_us - now_us) / 1000))
