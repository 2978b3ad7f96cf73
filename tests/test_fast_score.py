"""The generated least_load scorer agrees with the generic component-by-component path."""

from __future__ import annotations

import random
import time

import pytest

from cacheroute_proxy import clock
from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.strategies import DEFAULT_WEIGHTS, LeastLoadStrategy
from proxy_workers import fast_score
from proxy_workers import router as router_module
from proxy_workers.router import Router
from shm_schema import CountersReader, CounterWord, DirectoryWriter, layout
from shm_schema.records import COUNTER_LANES, SNAPSHOT, CounterLanes, SnapshotRecord
from shm_schema.snapshot import Pressure, SnapshotWriter
from tests.reference_scorer import compile_scorer
from tests.shm_helpers import segment_with_row


@pytest.fixture
def table():
    with segment_with_row() as made:
        yield made


def _random_load(seg, row, instances, rng: random.Random, publish: bool) -> None:
    for inst in instances:
        for lane in range(layout.LANES_USED):
            for _ in range(rng.randrange(3)):
                row.add(lane, inst.slot, inst.generation)
    if publish:
        now = int(time.time() * 1e6)
        SnapshotWriter(seg).publish({
            # Few pending/decoding against up to 2 in flight, so some requests are unannounced.
            i.slot: Pressure(i.generation, rng.randrange(2), rng.randrange(2),
                             now + rng.randrange(-10**6, 3 * 10**6), now + rng.randrange(-10**6, 10**6), now,
                             rng.randrange(10**6))
            for i in instances})


def _fast_totals(router: Router, snapshot) -> list[float] | None:
    """The selection plan's totals for `snapshot`, or None where the router takes the generic path."""
    plan = router._plan_for(snapshot)
    return None if plan is None else plan.totals(router_module.now_us())


@pytest.mark.parametrize("publish", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_fast_totals_equal_generic_totals(table, seed, publish, monkeypatch):
    name, seg, row = table
    rng = random.Random(seed)
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(rng.randint(1, 20))]
    _random_load(seg, row, instances, rng, publish)
    # Both paths read "now" for the backlog; one clock reading for both, so a descheduling
    # between the two calls (a busy host) cannot move the backlog of one and not the other.
    now = clock.now_us()
    monkeypatch.setattr(clock, "now_us", lambda: now)
    monkeypatch.setattr(router_module, "now_us", lambda: now)
    router = Router(Settings(shm_name=name, instance_strategy="least_load", snapshot_stale_ms=60_000),
                    seg, row)
    snapshot = router.view.directory.snapshot()
    fast = _fast_totals(router, snapshot)
    components = router.view.components(snapshot.alive, snapshot.slot_span)
    generic = router.scorer.totals(len(snapshot.alive), components)
    assert fast is not None
    assert fast == pytest.approx(generic, abs=1e-3)


def test_falls_back_when_a_slot_changed_generation(table):
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    snapshot = router.view.directory.snapshot()
    scorer = compile_scorer(router.scorer, [i.slot for i in snapshot.alive],
                            [i.generation for i in snapshot.alive])
    lanes = CountersReader(seg).lanes
    assert scorer(lanes(snapshot.slot_span), None, 0) == [0.0, 0.0]
    writer.free(a.slot)
    assert scorer(lanes(snapshot.slot_span), None, 0) is None  # generic path decides


def test_weights_outside_the_compiled_set_use_the_generic_path(table):
    name, seg, row = table
    DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    router = Router(Settings(shm_name=name, instance_strategy="least_load",
                             least_load_weights={"qps_1m": 0.5}), seg, row)
    snapshot = router.view.directory.snapshot()
    assert _fast_totals(router, snapshot) is None
    assert router.choose().instance_id == "a"


def test_requests_the_snapshot_has_not_seen_are_charged_at_the_marginal_backlog(table, monkeypatch):
    name, seg, row = table
    a = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    for _ in range(3):  # three selected by some worker since the sidecar last published
        row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
    now = int(time.time() * 1e6)
    # Both paths read the clock at `now`: arithmetic, not the time a loaded machine takes
    # between the publish and the reads.
    monkeypatch.setattr(clock, "now_us", lambda: now)
    monkeypatch.setattr(router_module, "now_us", lambda: now)
    # The timeline knows one of them (pending); the next slot is free 200 ms from now.
    SnapshotWriter(seg).publish({a.slot: Pressure(a.generation, 1, 0, now + 200_000, now, now, 500_000)})
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    snapshot = router.view.directory.snapshot()
    backlog = router.view.components(snapshot.alive)["predicted_total_backlog_ms"][0]
    assert backlog == pytest.approx(200 + 2 * 500)  # two unannounced x 500 ms
    weights = router.scorer.weights
    expected = (3 * weights["inflight"] + weights["pending_prefill_count"]
                + backlog * weights["predicted_total_backlog_ms"])
    assert _fast_totals(router, snapshot) == pytest.approx([expected])


# --- the scorer's raw indices are shm_schema's ----------------------------------------------------
def test_the_scorer_tables_are_the_declarations() -> None:
    """The words the generated code reads, by component, equal the declared positions."""
    assert fast_score.LANE_FIELDS == COUNTER_LANES.index._asdict()
    assert fast_score.RECORD_FIELDS == {name: getattr(SNAPSHOT.index, name)
                                        for name in ("pending_prefill_count", "active_decode_count")}
    assert fast_score.SUPPORTED == {*COUNTER_LANES.fields, "pending_prefill_count",
                                     "active_decode_count", fast_score.BACKLOG}


def _distinct_table(generations: tuple[int, ...], now: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                    list[CounterLanes], list[SnapshotRecord]]:
    """Lanes and snapshot records with a different value in every field, built by name, and the
    flat tuples CountersReader.lanes / SnapshotReader.records make of them."""
    lanes = [CounterLanes(*(CounterWord.pack(gen, 10 * slot + lane + 1)
                            for lane in range(layout.LANES_USED)))
             for slot, gen in enumerate(generations)]
    records = [SnapshotRecord(generation=gen, pending_prefill_count=slot + 1,
                              active_decode_count=slot + 2,
                              next_slot_free_at_us=now + 3_000 * (slot + 1),
                              prefill_free_at_us=now + 5_000 * (slot + 1),
                              decode_free_at_us=now + 7_000, marginal_backlog_us=11_000 * (slot + 1))
               for slot, gen in enumerate(generations)]
    return (tuple(word for slot in lanes for word in slot),
            tuple(field for record in records for field in record), lanes, records)


def _expected(component: str, lanes: CounterLanes, record: SnapshotRecord, now: int) -> float:
    if component in COUNTER_LANES.fields:
        return CounterWord.count(getattr(lanes, component))
    if component != fast_score.BACKLOG:
        return getattr(record, component)
    unseen = max(0, CounterWord.count(lanes.inflight) - record.pending_prefill_count
                 - record.active_decode_count)
    free_at = max(record.next_slot_free_at_us, record.prefill_free_at_us, now)
    return (free_at - now + unseen * record.marginal_backlog_us) / 1000


@pytest.mark.parametrize("component", sorted(fast_score.SUPPORTED))
def test_each_component_alone_reads_the_word_its_name_declares(component: str) -> None:
    """One weight at a time, so two components whose indices were swapped cannot hide behind
    equal weights."""
    now = 1_000_000
    generations = (3, 5)
    flat_lanes, flat_records, lanes, records = _distinct_table(generations, now)
    weights = {name: 0.0 for name in DEFAULT_WEIGHTS}
    weights[component] = 1.0
    scorer = compile_scorer(LeastLoadStrategy(weights), [0, 1], generations)
    assert scorer is not None
    expected = [_expected(component, lane, record, now) for lane, record in zip(lanes, records)]
    assert scorer(flat_lanes, flat_records, now) == pytest.approx(expected)
    if component in COUNTER_LANES.fields:
        assert scorer(flat_lanes, None, now) == pytest.approx(expected)
