"""The sidecar's per-instance timelines (reservation, first token, completion) and the snapshot
they publish, on a real segment."""

from __future__ import annotations

import random
import uuid

import pytest

from shm_schema import DirectoryWriter, Segment
from shm_schema.snapshot import Pressure, SnapshotReader, SnapshotWriter
from sidecar.timelines import InstanceTimeline, Timelines


def test_reservations_chain_prefill_and_hold_slots_through_decode():
    t = InstanceTimeline(ready_slots=2)
    a = t.reserve(1, 100.0, service_s=1.0, decode_s=3.0)
    b = t.reserve(2, 100.0, service_s=0.5, decode_s=1.0)
    c = t.reserve(3, 100.0, service_s=0.5, decode_s=1.0)
    assert a.predicted_first_token == 101.0            # idle: starts now
    assert b.predicted_first_token == 101.5            # second slot, behind a's prefill
    # Both slots are busy through decode (a until 104, b until 102.5): c waits for b's slot.
    assert c.predicted_first_token == 102.5 + 0.5
    p = t.pressure(generation=7)
    assert (p.generation, p.pending_prefill_count, p.active_decode_count) == (7, 3, 0)
    assert p.prefill_free_at_us == int(103.0 * 1e6)


def test_first_token_reanchors_pending_on_real_time():
    t = InstanceTimeline(ready_slots=4)
    t.reserve(1, 100.0, service_s=2.0, decode_s=1.0)
    second = t.reserve(2, 100.0, service_s=1.0, decode_s=1.0)
    assert second.predicted_first_token == 103.0
    t.first_token(1, 100.5)  # much sooner than predicted
    assert second.predicted_first_token == 101.5
    p = t.pressure(1)
    assert (p.pending_prefill_count, p.active_decode_count) == (1, 1)
    assert p.decode_free_at_us == int(101.5 * 1e6)


def test_completion_before_first_token_frees_the_chain():
    t = InstanceTimeline(ready_slots=4)
    t.reserve(1, 100.0, service_s=5.0, decode_s=1.0)
    later = t.reserve(2, 100.0, service_s=1.0, decode_s=1.0)
    assert later.predicted_first_token == 106.0
    t.complete(1, 100.2)  # failed or cancelled
    assert later.predicted_first_token == pytest.approx(101.2)
    t.complete(2, 101.0)
    t.complete(2, 101.0)  # idempotent
    assert t.pressure(1).pending_prefill_count == 0 and not t.decoding


def test_timelines_route_events_by_key_and_drop_a_workers_requests():
    tl = Timelines(ready_slots=8)
    row3 = 3 << 48
    tl.reserve(0, 5, row3 | 1, 10.0, 1.0, 1.0)
    tl.reserve(0, 5, row3 | 2, 10.0, 1.0, 1.0)
    tl.reserve(1, 2, (4 << 48) | 1, 10.0, 1.0, 1.0)
    tl.first_token(row3 | 1, 10.5)
    assert tl.counts() == (2, 1)
    assert tl.drop_keys(lambda k: k >> 48 == 3, 11.0) == 2
    assert tl.counts() == (1, 0)
    assert set(tl.pressures()) == {0, 1} and tl.pressures()[1].pending_prefill_count == 1
    tl.forget_instances({(1, 2)}, 11.0)
    assert set(tl.pressures()) == {1}


def test_reservation_reannounced_replaces_not_duplicates():
    tl = Timelines(ready_slots=8)
    tl.reserve(0, 1, 42, 10.0, 1.0, 1.0)
    tl.reserve(0, 1, 42, 10.0, 1.0, 1.0)
    assert tl.counts() == (1, 0)


def test_lost_completion_expires():
    tl = Timelines(ready_slots=8)
    tl.reserve(0, 1, 42, 10.0, 1.0, 1.0)
    assert tl.expire(max_age_s=60, now=50.0) == 0
    assert tl.expire(max_age_s=60, now=100.0) == 1
    assert tl.counts() == (0, 0)


@pytest.fixture
def seg():
    name = f"/cacheroute_test_{uuid.uuid4().hex[:10]}"
    segment = Segment.create_or_attach(name, 8, 2, 64)
    try:
        yield segment
    finally:
        segment.close()
        Segment.unlink(name)


def test_snapshot_double_buffer_and_generation_cache(seg):
    writer, reader = SnapshotWriter(seg), SnapshotReader(seg)
    assert reader.records(4) == () and reader.pressure(0, 1) is None
    slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    writer.publish({slot.slot: Pressure(slot.generation, 2, 1, 10, 20, 30)})
    assert reader.pressure(slot.slot, slot.generation) == Pressure(slot.generation, 2, 1, 10, 20, 30)
    assert reader.pressure(slot.slot, slot.generation + 1) is None  # another generation: unknown
    first = reader.records(4)
    assert reader.records(4) is first  # generation unchanged: no decode
    writer.publish({slot.slot: Pressure(slot.generation, 0, 0, 1, 1, 1)})
    assert reader.pressure(slot.slot, slot.generation).pending_prefill_count == 0
    assert reader.published_us() > 0


def _linear_slots_reference(t: InstanceTimeline, ops: list[tuple[str, int, float, float, float]]) -> list:
    """The timeline's predictions from a plain model of READY slots (a list searched for its
    minimum every time), to hold the heap the sidecar keeps them in to the same answers."""
    slots = [0.0] * t.ready_slots
    prefill_free = 0.0
    pending: dict[int, list[float]] = {}   # key -> [service, decode, predicted_first_token]
    decoding: dict[int, float] = {}        # key -> predicted end
    out = []

    def recompute(now: float) -> None:
        nonlocal slots, prefill_free
        busy = sorted(max(now, end) for end in decoding.values())
        slots = (busy + [now] * t.ready_slots)[:t.ready_slots]
        cursor = now
        for res in pending.values():
            i = min(range(t.ready_slots), key=slots.__getitem__)
            res[2] = max(slots[i], cursor) + res[0]
            slots[i] = res[2] + res[1]
            cursor = res[2]
        prefill_free = cursor

    for op, key, at, service, decode in ops:
        if op == "reserve":
            i = min(range(t.ready_slots), key=slots.__getitem__)
            first = max(at, slots[i], prefill_free) + service
            slots[i] = first + decode
            prefill_free = first
            pending[key] = [service, decode, first]
        elif op == "first" and key in pending:
            service, decode, _ = pending.pop(key)
            decoding[key] = at + decode
            recompute(at)
        elif op == "complete":
            decoding.pop(key, None)
            if pending.pop(key, None) is not None:
                recompute(at)
        out.append((sorted(round(p[2], 9) for p in pending.values()), round(min(slots), 9),
                    round(prefill_free, 9)))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_heap_of_ready_slots_predicts_what_a_linear_search_does(seed):
    rng = random.Random(seed)
    timeline = InstanceTimeline(ready_slots=rng.choice([1, 2, 8, 64]))
    ops, live, now = [], [], 100.0
    for key in range(300):
        now += rng.expovariate(20.0)
        choice = rng.random()
        if choice < 0.5 or not live:
            ops.append(("reserve", key, now, rng.uniform(0.01, 0.5), rng.uniform(0.0, 2.0)))
            live.append(key)
        elif choice < 0.8:
            ops.append(("first", rng.choice(live), now, 0.0, 0.0))
        else:
            ops.append(("complete", live.pop(rng.randrange(len(live))), now, 0.0, 0.0))
    got = []
    for op, key, at, service, decode in ops:
        if op == "reserve":
            timeline.reserve(key, at, service, decode)
        elif op == "first":
            timeline.first_token(key, at)
        else:
            timeline.complete(key, at)
        got.append((sorted(round(r.predicted_first_token, 9) for r in timeline.pending.values()),
                    round(timeline.slot_free[0], 9), round(timeline.prefill_free, 9)))
    assert got == _linear_slots_reference(timeline, ops)
