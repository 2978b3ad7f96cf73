"""least_load's score is least_load_totals over LoadView.components (the component path); a
selector per directory snapshot computes it from the words it reads, in C (_least_load.c) where
the install built it, else in Python (PythonSelector). On randomised tables each selector gives
the component path's totals bit for bit and its choices, ties included; a selector steps aside
(None) exactly where it would not see what the component path sees, and the component path then
chooses; without the compiled part the Python selector serves."""

from __future__ import annotations

import gc
import itertools
import random
import struct
import subprocess
import sys
import time
import weakref
from typing import Any

import pytest

from cacheroute_proxy import clock
from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.least_load import (BACKLOG, DEFAULT_WEIGHTS, LANES, NATIVE_COMPONENTS,
                                                 NATIVE_SELECTION, LeastLoadPolicy, PythonSelector)
from cacheroute_proxy.routing.load_view import LoadView
from proxy_workers.router import Router
from shm_schema import CountersReader, DirectoryWriter, WorkerRow, counter_value, layout
from shm_schema.records import COUNTER_LANES
from shm_schema.snapshot import Pressure, SnapshotWriter
from tests.harness import ROOT
from tests.shm_helpers import fresh_segment, segment_with_row

STALE_MS = 2000.0
STALE_US = int(STALE_MS * 1000)


# The two selectors: the C one (where the install built it) and the Python one.
SELECTORS = [pytest.param(True, id="c", marks=pytest.mark.skipif(
                 not NATIVE_SELECTION, reason="the C selector was not built")),
             pytest.param(False, id="python")]


@pytest.fixture
def table():
    with segment_with_row() as made:
        yield made


def _weights(rng: random.Random) -> dict[str, float]:
    """Default, dyadic, arbitrary (sums that round differently in another order), or with some
    components switched off."""
    kind = rng.randrange(4)
    if kind == 0:
        return {}
    names = [n for n in DEFAULT_WEIGHTS if n != "qps_1m"]
    if kind == 1:
        return {n: rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) for n in names}
    if kind == 2:
        return {n: rng.choice([0.0, rng.uniform(0, 3)]) for n in names}
    return {n: rng.uniform(0, 0.01) if n == BACKLOG else rng.uniform(0, 2) for n in names}


def _instances(seg, rng: random.Random, most: int = 24, batch_limits: tuple[int, ...] = (0,)) -> list:
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n, max_num_seqs=rng.choice(batch_limits))
                 for n in range(rng.randint(1, most))]
    for inst in rng.sample(instances, rng.randrange(len(instances))):  # holes in the slots
        if len(instances) > 1 and rng.random() < 0.3:
            writer.free(inst.slot)
            instances.remove(inst)
    return instances


def _load(seg, row, instances, rng: random.Random, now: int, wrong_generation: bool) -> bool:
    """Random lanes and (four times in five) a snapshot; True if one was published."""
    for inst in instances:
        for lane in range(layout.LANES_USED):
            for _ in range(rng.choice([0, 0, 1, 2, 5])):
                row.add(lane, inst.slot, inst.generation)
    if rng.random() < 0.2:
        return False  # never published: the lanes alone
    records = {i.slot: Pressure(i.generation, rng.randrange(3), rng.randrange(3),
                                now + rng.randrange(-10**6, 3 * 10**6),
                                now + rng.randrange(-10**6, 10**6), now,
                                rng.choice([0, rng.randrange(10**6)]))
               for i in instances}
    if wrong_generation:
        victim = rng.choice(instances)
        records[victim.slot] = records[victim.slot]._replace(generation=victim.generation + 1)
    SnapshotWriter(seg).publish(records)
    return True


def _python_totals(seg, row, weights, at: int, monkeypatch) -> list[float | None]:
    """What the component path scores: least_load_totals over LoadView.components, at `at`."""
    monkeypatch.setattr(clock, "now_us", lambda: at)
    view = LoadView(seg, "shared", row, stale_ms=STALE_MS)
    snapshot = view.directory.snapshot()
    python = LeastLoadPolicy(weights, native=False)
    return python.totals(len(snapshot.alive), view.components(snapshot.alive, snapshot.slot_span))


def _bits(totals: list[float | None] | None) -> list[str | None] | None:
    return None if totals is None else [None if t is None else t.hex() for t in totals]


def _selector(policy: LeastLoadPolicy, seg, row):
    """(view, directory snapshot, the policy's C selector over it or None)."""
    view = LoadView(seg, "shared", row, stale_ms=STALE_MS)
    snapshot = view.directory.snapshot()
    return view, snapshot, policy.selector(view, snapshot)


@pytest.mark.parametrize("native", SELECTORS)
@pytest.mark.parametrize("seed", range(60))
def test_the_selector_scores_and_chooses_as_the_component_path(table, seed, native, monkeypatch):
    name, seg, row = table
    rng = random.Random(seed)
    instances = _instances(seg, rng)
    now = int(time.time() * 1e6)
    wrong_generation = rng.random() < 0.2
    published = _load(seg, row, instances, rng, now, wrong_generation)
    weights = _weights(rng)
    # The C selector's policy breaks its ties on one cursor, the Python reference on another:
    # they must stay in step.
    chosen = LeastLoadPolicy(weights, tie_cursor=itertools.count().__next__, native=native)
    python = LeastLoadPolicy(weights, tie_cursor=itertools.count().__next__, native=False)
    view, snapshot, selector = _selector(chosen, seg, row)
    if not any(chosen.weights.values()):  # nothing weighted: round-robin, no score to compute
        assert selector is None
        return
    assert isinstance(selector, PythonSelector) is not native
    for offset_us in (0, 1_500_000, 2_500_000):  # fresh, still fresh, stale
        at = now + offset_us
        expected = _python_totals(seg, row, weights, at, monkeypatch)
        fresh = published and offset_us <= STALE_US
        if (wrong_generation and fresh) or all(t is None for t in expected):
            # A record of another generation, or nothing weighted known: the component path's.
            assert selector.totals(at) is None and selector.pick(at) is None
            continue
        assert _bits(selector.totals(at)) == _bits(expected)  # bit for bit
        for _ in range(3):  # ties rotate: the same candidates, in the same order
            assert selector.pick(at) is python.select_by_totals(snapshot.alive, expected)


@pytest.mark.parametrize("native", SELECTORS)
@pytest.mark.parametrize("seed", range(12))
def test_the_selector_follows_the_component_path_through_changing_load_and_snapshots(
        table, seed, native, monkeypatch):
    """One selector over the table while it changes: lanes move, snapshots are published (the
    selector re-reads them), go stale, name another generation. After every change the totals
    are the Python ones, and so are the choices, ties included."""
    name, seg, row = table
    rng = random.Random(1000 + seed)
    instances = _instances(seg, rng, most=16)
    weights = rng.choice([{}, {n: rng.choice([0.0, 0.5, 1.0, 2.0]) for n in DEFAULT_WEIGHTS
                               if n != "qps_1m"}])
    chosen = LeastLoadPolicy(weights, tie_cursor=itertools.count().__next__, native=native)
    python = LeastLoadPolicy(weights, tie_cursor=itertools.count().__next__, native=False)
    view, snapshot, selector = _selector(chosen, seg, row)
    now = int(time.time() * 1e6)
    served = 0
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
        expected = _python_totals(seg, row, weights, at, monkeypatch)
        totals = selector.totals(at)
        if totals is None:
            continue  # stepped aside (a record of another generation): the component path chooses
        served += 1
        assert _bits(totals) == _bits(expected), step
        for _ in range(2):
            assert selector.pick(at) is python.select_by_totals(snapshot.alive, expected), step
    assert served


# --- the booking's read ----------------------------------------------------------------------------
@pytest.mark.parametrize("native", SELECTORS)
@pytest.mark.parametrize("seed", range(40))
def test_the_selector_books_as_the_view(table, seed, native):
    """A request's booking (its ready wait and decode batch) from the selector is the view's,
    bit for bit, for every candidate, fresh, stale or never published, in any batch; it steps
    aside (None) only where a fresh record describes another generation."""
    name, seg, row = table
    rng = random.Random(2000 + seed)
    instances = _instances(seg, rng, most=12, batch_limits=(0, 0, 1, 2, 3))
    now = int(time.time() * 1e6)
    wrong_generation = rng.random() < 0.2
    published = _load(seg, row, instances, rng, now, wrong_generation)
    view, snapshot, selector = _selector(LeastLoadPolicy({}, native=native), seg, row)
    for offset_us in (0, 1_500_000, 2_500_000):  # fresh, still fresh, stale
        at = now + offset_us
        fresh = published and offset_us <= STALE_US
        for inst in snapshot.alive:
            booked, expected = selector.booking(inst, at), view.booking(inst, at)
            if wrong_generation and fresh:
                assert booked is None
                continue
            assert booked == expected and type(booked[0]) is type(expected[0])
            assert booked[0] is None or booked[0].hex() == expected[0].hex()
            assert (booked[0] is None) is not fresh


@pytest.mark.parametrize("native", SELECTORS)
def test_the_booking_steps_aside_where_its_snapshot_is_history_and_the_router_books_from_the_view(table, native):
    writer, a, router = _busy_a_idle_b(table, native)
    view = router.view
    snapshot = view.directory.snapshot()
    assert router.choose().instance_id == "b"  # the policy builds its selector
    selector = router.policy.selector(view, snapshot)
    inst_a = snapshot.alive[0]
    assert selector.booking(inst_a, 0) == view.booking(inst_a, 0) == (None, 1)
    writer.allocate("c", "127.0.0.1", 9003, max_num_seqs=1)  # not one of the selector's candidates
    c = view.directory.snapshot().alive[2]
    assert selector.booking(c, 0) is None
    assert router.booking(c, 0) == view.booking(c, 0) == (None, 1)
    writer.free(a.slot)  # a's slot changes generation under the old snapshot
    assert selector.booking(inst_a, 0) is None
    assert router.booking(inst_a, 0) == view.booking(inst_a, 0) == (None, 1)


def test_the_router_books_with_its_policys_selector_where_least_load_chooses(table, monkeypatch):
    writer, a, router = _busy_a_idle_b(table)
    b = router.choose()
    seen: list[Any] = []
    selector = router.policy.selector(router.view, router.view.directory.snapshot())
    monkeypatch.setattr(router.view, "booking", lambda instance, now: seen.append(instance))
    assert router.booking(b, 0) == selector.booking(b, 0) == (None, 1) and not seen
    name, seg, row = table
    other = Router(Settings(shm_name=name, instance_strategy="round_robin"), seg, row)
    assert other.booking == other.view.booking


# --- what the selector reads is what shm_schema declares -------------------------------------------
def test_the_c_selector_adds_in_the_order_of_the_weights() -> None:
    """Lanes, then the snapshot's counts, then the backlog: DEFAULT_WEIGHTS' order, the order of
    the Python sum; and each lane is the one its name declares."""
    assert list(NATIVE_COMPONENTS) == [n for n in DEFAULT_WEIGHTS if n in NATIVE_COMPONENTS]
    assert set(DEFAULT_WEIGHTS) - set(NATIVE_COMPONENTS) == {"qps_1m"}
    assert LANES == {name: COUNTER_LANES.index._asdict()[name]
                     for name in DEFAULT_WEIGHTS if name in COUNTER_LANES.fields}


def test_the_offsets_name_the_halves_of_the_words(table) -> None:
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
    half = struct.Struct("=I")
    for inst in instances:
        for lane in range(layout.LANES_USED):
            count = half.unpack_from(seg.buf, CountersReader.count_offset(inst.slot, lane))[0]
            assert count == counter_value(seg, inst.slot, inst.generation, lane)
        generation = half.unpack_from(seg.buf, CountersReader.generation_offset(inst.slot))[0]
        assert generation == inst.generation
    sequence = struct.unpack_from("=Q", seg.buf, CountersReader.directory_seq_offset)[0]
    assert sequence == seg.load(layout.H_DIRECTORY_SEQ)


def _expected(component: str, counts: dict[str, int], record: Pressure, now: int) -> float:
    """One component's value, from what was written under its name."""
    if component in COUNTER_LANES.fields:
        return counts[component]
    if component != BACKLOG:
        return getattr(record, component)
    unseen = max(0, counts["inflight"] - record.pending_prefill_count - record.active_decode_count)
    free_at = max(record.next_slot_free_at_us, record.prefill_free_at_us, now)
    return (free_at - now + unseen * record.marginal_backlog_us) / 1000


@pytest.mark.parametrize("component", NATIVE_COMPONENTS)
def test_each_component_alone_reads_the_word_its_name_declares(table, component, monkeypatch) -> None:
    """One weight at a time and a different value in every field, so two components whose
    offsets were swapped cannot hide behind equal weights or equal values."""
    name, seg, row = table
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(2)]
    now = int(time.time() * 1e6)
    counts: list[dict[str, int]] = []
    records: dict[int, Pressure] = {}
    for k, inst in enumerate(instances):
        counts.append({lane: 10 * k + index + 1 for index, lane in enumerate(COUNTER_LANES.fields)})
        for lane, count in counts[-1].items():
            for _ in range(count):
                row.add(COUNTER_LANES.fields.index(lane), inst.slot, inst.generation)
        records[inst.slot] = Pressure(inst.generation, k + 1, k + 2, now + 3_000 * (k + 1),
                                      now + 5_000 * (k + 1), now + 7_000, 11_000 * (k + 1))
    SnapshotWriter(seg).publish(records)
    weights = {n: 0.0 for n in DEFAULT_WEIGHTS}
    weights[component] = 1.0
    expected = [_expected(component, counts[k], records[i.slot], now) for k, i in enumerate(instances)]
    assert _python_totals(seg, row, weights, now, monkeypatch) == pytest.approx(expected)
    if NATIVE_SELECTION:
        _, _, selector = _selector(LeastLoadPolicy(weights), seg, row)
        assert selector.totals(now) == pytest.approx(expected)


def test_requests_the_snapshot_has_not_seen_are_charged_at_the_marginal_backlog(table, monkeypatch):
    name, seg, row = table
    a = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    for _ in range(3):  # three selected by some worker since the sidecar last published
        row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
    now = int(time.time() * 1e6)
    # Both paths read the clock at `now`: arithmetic, not the time a loaded machine takes
    # between the publish and the reads.
    monkeypatch.setattr(clock, "now_us", lambda: now)
    # The timeline knows one of them (pending); the next slot is free 200 ms from now.
    SnapshotWriter(seg).publish({a.slot: Pressure(a.generation, 1, 0, now + 200_000, now, now, 500_000)})
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    snapshot = router.view.directory.snapshot()
    backlog = router.view.components(snapshot.alive)["predicted_total_backlog_ms"][0]
    assert backlog == pytest.approx(200 + 2 * 500)  # two unannounced x 500 ms
    weights = router.scorer.weights
    expected = (3 * weights["inflight"] + weights["pending_prefill_count"]
                + backlog * weights["predicted_total_backlog_ms"])
    assert router.scorer.table_totals(router.view, snapshot, snapshot.alive) == pytest.approx([expected])


@pytest.mark.parametrize("inflight, share", [(2, 1.0), (1, 0.5), (0, 0.0)])
def test_completions_the_snapshot_has_not_seen_shrink_the_predicted_waits(table, monkeypatch, inflight, share):
    """Completions reach the sidecar with its next tick: the snapshot announces two requests on
    `a` (one pending, one decoding) after fewer remain in flight, and the waits kv_aware and the
    injection choice read shrink in proportion."""
    name, seg, row = table
    a = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    for _ in range(inflight):
        row.begin(a.slot, a.generation)
    now = int(time.time() * 1e6)
    monkeypatch.setattr(clock, "now_us", lambda: now)
    SnapshotWriter(seg).publish({a.slot: Pressure(a.generation, 1, 1, now + 200_000, now, now, 500_000)})
    view = Router(Settings(shm_name=name, instance_strategy="kv_aware"), seg, row).view
    [instance] = view.directory.snapshot().alive
    assert view.ready_wait_ms(instance) == pytest.approx(200 * share)
    [(wait, _)] = view.queue_waits([instance], instance.slot + 1, view.inflight([instance]))
    assert wait == pytest.approx(200 * share)


# --- where a selector steps aside, the component path chooses ----------------------------------------
@pytest.mark.parametrize("native", SELECTORS)
@pytest.mark.parametrize("marginal, unseen, served", [
    (2 ** 30, 1, True),        # a large marginal backlog, the product still exact as a float
    (2 ** 45, 2 ** 8, False),  # unseen x marginal = 2**53: only Python's int division is exact
    (2 ** 52, 2, False),
])
def test_a_backlog_beyond_what_a_float_holds_exactly_is_the_python_scores(
        table, monkeypatch, marginal, unseen, served, native):
    """The C selector steps aside there; the Python one, on Python's ints, serves throughout."""
    name, seg, row = table
    a = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    for _ in range(unseen):
        row.begin(a.slot, a.generation)
    now = int(time.time() * 1e6)
    SnapshotWriter(seg).publish({a.slot: Pressure(a.generation, 0, 0, now + 1_234, now, now, marginal)})
    expected = _python_totals(seg, row, {}, now, monkeypatch)
    _, _, selector = _selector(LeastLoadPolicy({}, native=native), seg, row)
    assert _bits(selector.totals(now)) == (_bits(expected) if served or not native else None)


def _busy_a_idle_b(table, native: bool = True) -> tuple[DirectoryWriter, Any, Router]:
    """Instances a (one request in flight) and b (idle), and a least_load router over them."""
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
    return writer, a, Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row,
                             native_selection=native)


@pytest.mark.parametrize("native", SELECTORS)
def test_a_directory_change_steps_the_selector_aside_and_the_next_snapshot_gets_its_own(table, native):
    writer, a, router = _busy_a_idle_b(table, native)
    snapshot = router.view.directory.snapshot()
    selector = router.policy.selector(router.view, snapshot)
    assert selector.pick(0).instance_id == "b"
    writer._begin()  # the sidecar is rewriting the directory (or died doing so)
    assert selector.pick(0) is None and selector.totals(0) is None
    writer._end()
    writer.set_alive(a.slot, False)  # the sequence moved on: the selector's snapshot is history
    assert selector.pick(0) is None and selector.totals(0) is None
    assert router.choose().instance_id == "b"
    assert router.policy.selector(router.view, router.view.directory.snapshot()) is not selector


def test_a_slot_of_another_generation_is_the_python_scores_to_choose(table):
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    view = router.view
    snapshot = view.directory.snapshot()
    selector = router.policy.selector(view, snapshot)
    writer.free(a.slot)  # a's slot changes generation under the old snapshot
    if selector is not None:
        assert selector.totals(0) is None
    # The component path reads a's inflight as unknown, never zero.
    assert router.scorer.totals(2, view.components(snapshot.alive, snapshot.slot_span))[0] is None


def test_weights_the_selector_does_not_read_are_the_python_scores(table):
    name, seg, row = table
    DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    router = Router(Settings(shm_name=name, instance_strategy="least_load",
                             least_load_weights={"qps_1m": 0.5}), seg, row)
    assert router.policy.selector(router.view, router.view.directory.snapshot()) is None
    assert router.choose().instance_id == "a"


@pytest.mark.skipif(not NATIVE_SELECTION, reason="the C selector was not built")
def test_the_install_built_the_c_selector_and_the_router_chooses_with_it(table, monkeypatch):
    """`make install` compiles _least_load.c; the router's least_load choice is the C one (the
    Python path, made to fail here, is not taken)."""
    _, _, router = _busy_a_idle_b(table)
    monkeypatch.setattr(router.view, "components", lambda *args, **kw: pytest.fail("Python path"))
    assert [router.choose().instance_id for _ in range(3)] == ["b"] * 3


@pytest.mark.parametrize("native", SELECTORS)
def test_the_selector_refuses_a_closed_segment(native):
    with fresh_segment(8, 2) as seg:
        writer = DirectoryWriter(seg)
        writer.allocate("a", "127.0.0.1", 9001)
        row = WorkerRow.claim(seg, 0)
        _, _, selector = _selector(LeastLoadPolicy({}, native=native), seg, row)
        assert selector.pick(0).instance_id == "a"
        row.release()
    with pytest.raises(ValueError):  # the segment's memoryview is released: no dangling read
        selector.pick(0)


@pytest.mark.parametrize("native", SELECTORS)
def test_a_replaced_selector_is_collected(table, native):
    """A selector and its policy refer to each other (its tie-break is the policy's); a policy
    replaces its selector at every directory change, so the collector must free the old one."""
    name, seg, row = table
    writer = DirectoryWriter(seg)
    a = writer.allocate("a", "127.0.0.1", 9001)
    writer.allocate("b", "127.0.0.1", 9002)
    policy = LeastLoadPolicy({}, native=native)
    view = LoadView(seg, "shared", row, stale_ms=STALE_MS)
    selectors = []
    for alive in (False, True, False):
        selectors.append(weakref.ref(policy.selector(view, view.directory.snapshot())))
        writer.set_alive(a.slot, alive)
    del policy
    gc.collect()
    assert [r() for r in selectors] == [None, None, None]


# --- without the compiled part --------------------------------------------------------------------
NO_COMPILER = """
import sys
sys.modules["cacheroute_proxy.routing._least_load"] = None  # as if the install found no compiler
from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing import least_load
from proxy_workers.router import Router
from shm_schema import DirectoryWriter, layout
from tests.shm_helpers import segment_with_row

assert not least_load.NATIVE_SELECTION
with segment_with_row() as (name, seg, row):
    writer = DirectoryWriter(seg)
    busy, idle = writer.allocate("busy", "127.0.0.1", 9001), writer.allocate("idle", "127.0.0.1", 9002)
    row.add(layout.LANE_INFLIGHT, busy.slot, busy.generation)
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    selector = router.policy.selector(router.view, router.view.directory.snapshot())
    assert isinstance(selector, least_load.PythonSelector)
    print(",".join(router.choose().instance_id for _ in range(3)))
"""


def test_without_the_compiled_part_the_python_selector_chooses():
    done = subprocess.run([sys.executable, "-c", NO_COMPILER], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["idle,idle,idle"]
