"""The router's least_load plan decides exactly what the compiled scorer and the strategy's
own selection decide, on randomised tables: the same totals bit for bit, the same choice,
the same tie-breaks; and it steps aside (None: the generic path) whenever the directory moved
under it or the snapshot describes other generations."""

from __future__ import annotations

import gc
import itertools
import random
import time
import weakref

import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.strategies import DEFAULT_WEIGHTS, LeastLoadStrategy
from proxy_workers.fast_score import NATIVE_SELECTION, SelectionPlan
from proxy_workers.router import Router
from shm_schema import (CandidateLanes, CountersReader, DirectoryWriter, WorkerRow,
                        counter_value, layout)
from shm_schema.snapshot import Pressure, SnapshotReader, SnapshotWriter
from tests.reference_scorer import compile_scorer
from tests.shm_helpers import segment_with_row

STALE_US = 2_000_000


@pytest.fixture
def table():
    with segment_with_row() as made:
        yield made


def _weights(rng: random.Random) -> dict[str, float]:
    """Default, dyadic, arbitrary, or with some components switched off."""
    kind = rng.randrange(4)
    if kind == 0:
        return {}
    names = [n for n in DEFAULT_WEIGHTS if n != "qps_1m"]
    if kind == 1:
        return {n: rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) for n in names}
    if kind == 2:
        return {n: rng.choice([0.0, rng.uniform(0, 3)]) for n in names}
    return {n: rng.uniform(0, 0.01) if n == "predicted_total_backlog_ms" else rng.uniform(0, 2)
            for n in names}


def _load(seg, row, instances, rng: random.Random, now: int, wrong_generation: bool) -> None:
    for inst in instances:
        for lane in range(layout.LANES_USED):
            for _ in range(rng.choice([0, 0, 1, 2, 5])):
                row.add(lane, inst.slot, inst.generation)
    if rng.random() < 0.2:
        return  # never published: the queue terms alone
    records = {i.slot: Pressure(i.generation, rng.randrange(3), rng.randrange(3),
                                now + rng.randrange(-10**6, 3 * 10**6),
                                now + rng.randrange(-10**6, 10**6), now,
                                rng.choice([0, rng.randrange(10**6)]))
               for i in instances}
    if wrong_generation:
        victim = rng.choice(instances)
        records[victim.slot] = records[victim.slot]._replace(generation=victim.generation + 1)
    SnapshotWriter(seg).publish(records)


def _reference(strategy: LeastLoadStrategy, seg, snapshot, now: int):
    """compile_scorer over the 64-bit words, with the records a fresh snapshot offers."""
    scorer = compile_scorer(strategy, [i.slot for i in snapshot.alive],
                            [i.generation for i in snapshot.alive])
    assert scorer is not None
    reader = SnapshotReader(seg)
    published = reader.published_us()
    fresh = published and now - published <= STALE_US
    records = (reader.records(snapshot.slot_span) or None) if fresh else None
    return scorer(CountersReader(seg).lanes(snapshot.slot_span), records, now)


@pytest.mark.parametrize("native", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("seed", range(40))
def test_the_plan_decides_what_the_compiled_scorer_and_the_strategy_decide(table, seed, native):
    name, seg, row = table
    rng = random.Random(seed)
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(rng.randint(1, 24))]
    for inst in rng.sample(instances, rng.randrange(len(instances))):  # holes in the slots
        if len(instances) > 1 and rng.random() < 0.3:
            writer.free(inst.slot)
            instances.remove(inst)
    now = int(time.time() * 1e6)
    _load(seg, row, instances, rng, now, wrong_generation=rng.random() < 0.2)
    weights = _weights(rng)
    # Two strategies with the same tie cursor: one the plan breaks its ties with, one the
    # reference does; they must stay in step.
    plan_strategy = LeastLoadStrategy(weights, tie_cursor=itertools.count().__next__)
    reference_strategy = LeastLoadStrategy(weights, tie_cursor=itertools.count().__next__)
    snapshot = Router(Settings(shm_name=name), seg, row).view.directory.snapshot()
    assert SelectionPlan.supports(plan_strategy, snapshot)
    plan = SelectionPlan(plan_strategy, snapshot, seg, SnapshotReader(seg), STALE_US, native=native)
    for offset_us in (0, 1_500_000, 2_500_000):  # fresh, still fresh, stale
        at = now + offset_us
        expected = _reference(reference_strategy, seg, snapshot, at)
        assert plan.totals(at) == expected  # bit for bit, None included
        for _ in range(3):  # ties rotate: the same candidates, in the same order
            choice = plan.pick(at)
            if expected is None:
                assert choice is None
            else:
                assert choice is reference_strategy.select_by_totals(snapshot.alive, expected)


def test_a_directory_change_under_the_read_hands_the_choice_to_the_generic_path(table):
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    snapshot = router.view.directory.snapshot()
    plan = router._plan_for(snapshot)
    assert plan is not None and plan.pick(0).instance_id == "b"
    writer.set_alive(a.slot, False)  # the sequence moves on: the plan's snapshot is history
    assert plan.pick(0) is None and plan.totals(0) is None
    assert router.choose().instance_id == "b"  # a new snapshot, a new plan


def test_a_write_in_progress_reads_as_unknown(table):
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    lanes = CandidateLanes(seg, [a.slot], [layout.LANE_INFLIGHT], seq)
    assert lanes.read() is not None
    writer._begin()  # the sidecar is rewriting the directory (or died doing so)
    try:
        assert lanes.read() is None
    finally:
        writer._end()
    with pytest.raises(ValueError):
        CandidateLanes(seg, [a.slot], [layout.LANE_INFLIGHT], seq + 1)


def test_the_halves_are_the_counts_and_generations_of_the_words(table):
    name, seg, row = table
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(5)]
    writer.free(instances[2].slot)
    instances[2] = writer.allocate("again", "127.0.0.1", 9100)  # the same slot, a new generation
    rng = random.Random(7)
    for inst in instances:
        for lane in range(layout.LANES_USED):
            for _ in range(rng.randrange(4)):
                row.add(lane, inst.slot, inst.generation)
    slots = [instances[i].slot for i in (3, 0, 2)]  # any subset, any order
    lanes = CandidateLanes(seg, slots, [layout.LANE_READY_WAITING, layout.LANE_PREPARE_ACTIVE],
                           seg.load(layout.H_DIRECTORY_SEQ))
    values = lanes.read()
    # Each slot: its inflight count, the two lanes' counts, its generation.
    assert values is not None and len(values) == lanes.size == 3 * 4
    for slot in slots:
        inst = next(i for i in instances if i.slot == slot)
        for lane in (layout.LANE_INFLIGHT, layout.LANE_READY_WAITING, layout.LANE_PREPARE_ACTIVE):
            expected = counter_value(seg, slot, inst.generation, lane)
            assert values[lanes.count_index(slot, lane)] == expected
        assert values[lanes.generation_index(slot)] == inst.generation


def test_the_install_built_the_c_plan_and_the_router_runs_it(table):
    """`make install` compiles proxy_workers/_select.c; with the default weights (an exact
    scale) the router's plan is the C one."""
    name, seg, row = table
    assert NATIVE_SELECTION
    DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    plan = router._plan_for(router.view.directory.snapshot())
    assert plan is not None and plan._native is not None
    assert plan.pick == plan._native.pick


@pytest.mark.parametrize("seed", range(12))
def test_the_c_plan_follows_the_python_plan_through_changing_load_and_snapshots(table, seed):
    """One plan of each over the same table while it changes: lanes move, snapshots are
    published (the C plan re-derives through the Python side), go stale, name another
    generation. After every change the totals are equal, and so are the choices, ties included."""
    name, seg, row = table
    rng = random.Random(1000 + seed)
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(rng.randint(1, 16))]
    weights = rng.choice([{}, {n: rng.choice([0.0, 0.5, 1.0, 2.0]) for n in DEFAULT_WEIGHTS
                               if n != "qps_1m"}])
    strategies = [LeastLoadStrategy(weights, tie_cursor=itertools.count().__next__) for _ in range(2)]
    snapshot = Router(Settings(shm_name=name), seg, row).view.directory.snapshot()
    python, c = (SelectionPlan(strategy, snapshot, seg, SnapshotReader(seg), STALE_US, native=native)
                 for strategy, native in zip(strategies, (False, True)))
    assert c._native is not None and python._native is None
    now = int(time.time() * 1e6)
    for step in range(60):
        action = rng.randrange(4)
        if action == 0:
            _load(seg, row, instances, rng, now, wrong_generation=rng.random() < 0.2)
        elif action == 1:  # requests end: some lanes go down
            for inst in rng.sample(instances, max(1, len(instances) // 2)):
                lane = rng.randrange(layout.LANES_USED)
                if counter_value(seg, inst.slot, inst.generation, lane):
                    row.remove(lane, inst.slot, inst.generation)
        elif action == 2:  # idle: every total equal, the tie cursor decides
            for inst in instances:
                for lane in range(layout.LANES_USED):
                    while counter_value(seg, inst.slot, inst.generation, lane):
                        row.remove(lane, inst.slot, inst.generation)
        at = now + rng.choice([0, 10, 1_000_000, 3_000_000])
        assert c.totals(at) == python.totals(at), step
        for _ in range(2):
            assert c.pick(at) is python.pick(at), step


def test_the_c_plan_steps_aside_when_the_directory_moves_and_refuses_a_closed_segment():
    from tests.shm_helpers import fresh_segment
    with fresh_segment(8, 2) as seg:
        writer = DirectoryWriter(seg)
        a = writer.allocate("a", "127.0.0.1", 9001)
        writer.allocate("b", "127.0.0.1", 9002)
        row = WorkerRow.claim(seg, 0)
        row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
        snapshot = Router(Settings(shm_name="/unused"), seg, row).view.directory.snapshot()
        plan = SelectionPlan(LeastLoadStrategy({}), snapshot, seg, SnapshotReader(seg), STALE_US,
                             native=True)
        assert plan.pick(0).instance_id == "b"
        writer.set_alive(a.slot, False)
        assert plan.pick(0) is None and plan.totals(0) is None
        row.release()
    with pytest.raises(ValueError):  # the segment's memoryview is released: no dangling read
        plan.pick(0)


def test_a_replaced_c_plan_is_collected(table):
    """The C plan and its SelectionPlan refer to each other; a router replaces its plan at
    every directory change, so the collector must free the old pair (no leak per change)."""
    name, seg, row = table
    DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    snapshot = Router(Settings(shm_name=name), seg, row).view.directory.snapshot()
    plans = [SelectionPlan(LeastLoadStrategy({}), snapshot, seg, SnapshotReader(seg), STALE_US,
                           native=True) for _ in range(3)]
    assert all(p.pick(0) is not None for p in plans)
    alive = [weakref.ref(p) for p in plans]
    del plans
    gc.collect()
    assert [r() for r in alive] == [None, None, None]
