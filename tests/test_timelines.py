"""The sidecar's per-instance timelines (reservation, first token, completion) and the snapshot
they publish, on a real segment."""

from __future__ import annotations

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
