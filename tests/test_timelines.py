"""The sidecar's per-instance timelines (reservation, first token, completion) and the snapshot
they publish, on a real segment."""

from __future__ import annotations

import random

import pytest

from shm_schema import DirectoryWriter, Segment
from shm_schema.bitfields import RequestKey
from shm_schema.snapshot import Pressure, SnapshotReader, SnapshotWriter
from cacheroute_proxy.pace import Pace
from sidecar.timelines import InstanceTimeline, Timelines
from tests.harness import private_segment_name
from tests.shm_helpers import published


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
    tl.reserve(0, 5, RequestKey.pack(3, 1), 10.0, 1.0, 1.0)
    tl.reserve(0, 5, RequestKey.pack(3, 2), 10.0, 1.0, 1.0)
    tl.reserve(1, 2, RequestKey.pack(4, 1), 10.0, 1.0, 1.0)
    tl.first_token(RequestKey.pack(3, 1), 10.5)
    assert tl.counts() == (2, 1)
    assert tl.drop_keys(lambda k: RequestKey.row(k) == 3, 11.0) == 2
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
    name = private_segment_name()
    segment = Segment.create_or_attach(name, 8, 2, 64)
    try:
        yield segment
    finally:
        segment.close()
        Segment.unlink(name)


def test_snapshot_double_buffer_and_generation_cache(seg):
    writer, reader = SnapshotWriter(seg), SnapshotReader(seg)
    assert reader.records(4) == () and published(reader, 0, 1) is None
    slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    writer.publish({slot.slot: Pressure(slot.generation, 2, 1, 10, 20, 30)})
    assert published(reader, slot.slot, slot.generation) == Pressure(slot.generation, 2, 1, 10, 20, 30)
    assert published(reader, slot.slot, slot.generation + 1) is None  # another generation: unknown
    first = reader.records(4)
    assert reader.records(4) is first  # generation unchanged: no decode
    writer.publish({slot.slot: Pressure(slot.generation, 0, 0, 1, 1, 1)})
    assert published(reader, slot.slot, slot.generation).pending_prefill_count == 0
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


# --- learned pace and per-instance slots ------------------------------------------------------
def _serve_one_at_a_time(tl: Timelines, where: tuple[int, int], true_factor: float,
                         requests: int, service_s: float = 0.2) -> None:
    """Requests one after another on an idle instance that takes true_factor x the prediction."""
    now = 1000.0
    for key in range(requests):
        tl.reserve(*where, key, now, service_s, 0.0)
        now += service_s * true_factor
        tl.first_token(key, now)
        tl.complete(key, now)


def test_pace_converges_on_an_instance_three_times_slower_than_predicted():
    tl = Timelines(ready_slots=4, pace_step=0.2)
    _serve_one_at_a_time(tl, (0, 1), true_factor=3.0, requests=40)
    _serve_one_at_a_time(tl, (1, 1), true_factor=1.0, requests=40)
    paces = {where: t.pace for where, t in tl.by_instance().items()}
    assert paces[(0, 1)].factor == pytest.approx(3.0, rel=0.02) and paces[(0, 1)].observations == 40
    assert paces[(1, 1)].factor == pytest.approx(1.0)
    # What the next reservation predicts now includes the pace: 3x the workers' estimate.
    slow = tl.timeline(0, 1).reserve(99, 2000.0, 0.2, 0.5)
    assert slow.predicted_first_token == pytest.approx(2000.0 + 0.6, rel=0.02)
    assert slow.decode_s == pytest.approx(1.5, rel=0.02)


def test_the_pace_is_learned_only_from_first_tokens_that_were_not_predicted_to_queue():
    """An engine that batches the prefills of a queue answers a burst sooner than the serial chain
    predicts: learned from, the busiest engine would look the fastest and draw still more."""
    tl = Timelines(ready_slots=4, pace_step=0.5)
    for key in range(4):  # a burst: each predicted after the ones before it, answered together
        tl.reserve(0, 1, key, 1000.0, 0.2, 1.0)
    for key in range(4):
        tl.first_token(key, 1000.25)
    pace = tl.timeline(0, 1).pace
    assert (pace.observations, pace.factor) == (1, pytest.approx(1.25 ** 0.5))  # the first one only
    for key in range(4):
        tl.complete(key, 1002.0)
    tl.reserve(0, 1, 9, 1010.0, 0.2, 1.0)  # alone: it did not queue
    tl.first_token(9, 1010.4)
    assert pace.observations == 2


def _decode_for(tl: Timelines, where: tuple[int, int], key: int, now: float, decode_s: float,
                took_s: float, failed: bool = False) -> float:
    """One request alone on its instance whose prefill takes the prediction (at its pace) and
    whose decode takes `took_s` (predicted `decode_s`); returns when it ended."""
    tl.reserve(*where, key, now, 0.1, decode_s)
    first = tl.timeline(*where).pending[key].predicted_first_token
    tl.first_token(key, first)
    tl.complete(key, first + took_s, failed)
    return first + took_s


def test_the_decode_pace_is_learned_from_completed_decodes_and_holds_the_slots_longer():
    tl = Timelines(ready_slots=2, pace_step=0.2)
    now = 1000.0
    for key in range(40):  # prefills as predicted, decodes twice as long
        now = _decode_for(tl, (0, 1), key, now, decode_s=0.5, took_s=1.0)
    timeline = tl.timeline(0, 1)
    assert timeline.pace.factor == pytest.approx(1.0)
    assert timeline.decode_pace.factor == pytest.approx(2.0, rel=0.02)
    assert timeline.decode_pace.observations == 40
    # Two decodes hold both slots for the learned time: a third request waits for them.
    for key in (100, 101, 102):
        tl.reserve(0, 1, key, 2000.0, 0.1, 0.5)
    third = timeline.pending[102]
    assert third.predicted_first_token == pytest.approx(2000.1 + 1.0 + 0.1, abs=0.01)


def test_the_decode_pace_starts_from_the_pace_and_learns_nothing_from_failures():
    tl = Timelines(ready_slots=4, pace_step=0.2)
    _serve_one_at_a_time(tl, (0, 1), true_factor=3.0, requests=40)  # the pace: 3
    timeline = tl.timeline(0, 1)
    assert timeline.decode_pace.observations == 0 and timeline.decode_factor == pytest.approx(3.0, rel=0.02)
    now = 5000.0
    for key in range(100, 110):  # cancelled early: a decode cut short says nothing of its pace
        now = _decode_for(tl, (0, 1), key, now, decode_s=0.5, took_s=0.01, failed=True)
    assert timeline.decode_pace.observations == 0
    # The first decode that ran to its end moves the decode pace from the pace's 3, not from 1.
    _decode_for(tl, (0, 1), 200, now, decode_s=0.5, took_s=1.5 * 0.5 * timeline.pace.factor)
    assert timeline.decode_pace.observations == 1
    assert timeline.decode_factor == pytest.approx(timeline.pace.factor * 1.5 ** 0.2, rel=1e-6)


def test_one_observation_moves_the_pace_a_bounded_step_and_noise_is_ignored():
    pace = Pace(step=0.2)
    pace.observe(predicted_s=0.1, observed_s=1000.0)   # a wild sample: ratio clamped to 10
    assert pace.factor == pytest.approx(10 ** 0.2)
    pace.observe(predicted_s=0.001, observed_s=1.0)    # below the noise floor: not learned
    assert pace.observations == 1 and pace.factor == pytest.approx(10 ** 0.2)
    for _ in range(200):
        pace.observe(predicted_s=0.1, observed_s=0.0)  # instant answers: clamped, never 0
    assert pace.factor == pytest.approx(0.05)
    for _ in range(500):
        pace.observe(predicted_s=0.1, observed_s=100.0)
    assert pace.factor == pytest.approx(50.0)


def test_pace_step_zero_keeps_the_profiles_predictions():
    tl = Timelines(ready_slots=4, pace_step=0.0)
    _serve_one_at_a_time(tl, (0, 1), true_factor=3.0, requests=10)
    assert tl.timeline(0, 1).pace.factor == 1.0
    assert tl.timeline(0, 1).reserve(99, 2000.0, 0.2, 0.5).predicted_first_token == pytest.approx(2000.2)


def test_a_reused_slot_starts_with_a_fresh_pace():
    tl = Timelines(ready_slots=4, pace_step=0.5)
    _serve_one_at_a_time(tl, (0, 1), true_factor=4.0, requests=20)
    assert tl.timeline(0, 1).pace.factor > 3.5
    tl.forget_instances({(0, 2)}, 3000.0)  # slot 0 now holds another instance (generation 2)
    assert tl.timeline(0, 2).pace.factor == 1.0 and set(tl.by_instance()) == {(0, 2)}


def test_timeline_models_the_instances_own_slots_when_fewer_than_ready_concurrency():
    limits = {(0, 1): 2, (1, 1): 0, (2, 1): 64}
    tl = Timelines(ready_slots=8, max_num_seqs=lambda slot, gen: limits[(slot, gen)])
    assert [tl.timeline(s, 1).ready_slots for s in range(3)] == [2, 8, 8]
    # Two slots busy through a long decode: the third request waits for a slot, not just prefill.
    for key in range(3):
        tl.reserve(0, 1, key, 100.0, 0.1, 10.0)
    third = tl.timeline(0, 1).pending[2]
    assert third.predicted_first_token == pytest.approx(100.1 + 10.0 + 0.1)


def test_marginal_backlog_is_the_prefill_or_the_slot_share_whichever_is_more():
    t = InstanceTimeline(ready_slots=4, pace=Pace(step=0.0))
    assert t.pressure(1).marginal_backlog_us == 0  # nothing reserved yet: nothing to charge
    t.reserve(1, 100.0, service_s=0.2, decode_s=0.2)
    assert t.pressure(1).marginal_backlog_us == 200_000           # prefill dominates
    for key in range(2, 40):
        t.reserve(key, 100.0, service_s=0.4, decode_s=4.0)       # long decodes fill the slots
    assert t.pressure(1).marginal_backlog_us == pytest.approx((0.4 + 4.0) / 4 * 1e6, rel=0.01)


# --- deferred re-anchoring ----------------------------------------------------------------------
def _observed(t: InstanceTimeline) -> tuple:
    """Everything a reader of a timeline can see (reading it brings a deferral up to date)."""
    return (t.pressure(3), sorted(r.predicted_first_token for r in t.pending.values()),
            sorted(r.predicted_end for r in t.decoding.values()), t.slot_free[0], t.prefill_free,
            t.pace.factor, t.pace.observations, t.decode_pace.factor, t.decode_pace.observations)


@pytest.mark.parametrize("seed", range(30))
def test_deferred_reanchoring_gives_what_reanchoring_on_every_event_gives(seed, monkeypatch):
    """The same random event sequence into two timelines: one settles after every event (what
    re-anchoring on every first token and early completion did), the other only when something
    reads it, at random moments. Every reading must be equal, float for float."""
    rng = random.Random(seed)
    slots = rng.choice([1, 2, 8, 64])
    eager = InstanceTimeline(slots, Pace(step=0.3))
    deferred = InstanceTimeline(slots, Pace(step=0.3))
    recomputes = {"eager": 0, "deferred": 0}
    original = InstanceTimeline._recompute

    def counting(self: InstanceTimeline, now: float) -> None:
        recomputes["eager" if self is eager else "deferred"] += 1
        original(self, now)

    monkeypatch.setattr(InstanceTimeline, "_recompute", counting)
    live: list[int] = []
    now = 100.0
    for key in range(400):
        now += rng.expovariate(50.0)
        at = now - rng.uniform(0.0, 0.01)  # rows' clocks and drain order: not monotone
        choice = rng.random()
        if choice < 0.4 or not live:
            service, decode = rng.uniform(0.005, 0.3), rng.uniform(0.0, 1.0)
            eager.reserve(key, at, service, decode)
            deferred.reserve(key, at, service, decode)
            live.append(key)
        elif choice < 0.75:
            target = rng.choice(live)
            eager.first_token(target, at)
            deferred.first_token(target, at)
        elif choice < 0.97:
            target = live.pop(rng.randrange(len(live)))
            failed = rng.random() < 0.2
            eager.complete(target, at, failed)
            deferred.complete(target, at, failed)
        else:
            doomed = {k for k in live if rng.random() < 0.3}
            live = [k for k in live if k not in doomed]
            eager.drop(doomed, at)
            deferred.drop(doomed, at)
        eager.settle()
        if rng.random() < 0.1:
            assert _observed(deferred) == _observed(eager), f"after event {key}"
    assert _observed(deferred) == _observed(eager)
    assert recomputes["deferred"] < recomputes["eager"]  # the deferral did defer
