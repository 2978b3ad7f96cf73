"""The generated least_load scorer agrees with the generic component-by-component path."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from cacheroute_proxy.config import Settings
from proxy_workers.fast_score import compile_scorer
from proxy_workers.router import Router
from shm_schema import DirectoryWriter, Segment, WorkerRow, layout
from shm_schema.snapshot import Pressure, SnapshotWriter


@pytest.fixture
def table():
    name = f"/cacheroute_test_{uuid.uuid4().hex[:10]}"
    seg = Segment.create_or_attach(name, 64, 2, 64)
    row = WorkerRow.claim(seg, 0)
    try:
        yield name, seg, row
    finally:
        row.release()
        seg.close()
        Segment.unlink(name)


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


@pytest.mark.parametrize("publish", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_fast_totals_equal_generic_totals(table, seed, publish):
    name, seg, row = table
    rng = random.Random(seed)
    writer = DirectoryWriter(seg)
    instances = [writer.allocate(f"i{n}", "127.0.0.1", 9000 + n) for n in range(rng.randint(1, 20))]
    _random_load(seg, row, instances, rng, publish)
    router = Router(Settings(shm_name=name, instance_strategy="least_load", snapshot_stale_ms=60_000),
                    seg, row)
    snapshot = router.view.directory.snapshot()
    fast = router._fast_totals(snapshot)
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
    lanes = router.view.lanes(snapshot.slot_span)
    assert scorer(lanes, None, 0) == [0.0, 0.0]
    writer.free(a.slot)
    assert scorer(router.view.lanes(snapshot.slot_span), None, 0) is None  # generic path decides


def test_weights_outside_the_compiled_set_use_the_generic_path(table):
    name, seg, row = table
    DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    router = Router(Settings(shm_name=name, instance_strategy="least_load",
                             least_load_weights={"qps_1m": 0.5}), seg, row)
    snapshot = router.view.directory.snapshot()
    assert router._fast_totals(snapshot) is None
    assert router.choose().instance_id == "a"


def test_requests_the_snapshot_has_not_seen_are_charged_at_the_marginal_backlog(table):
    name, seg, row = table
    a = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    for _ in range(3):  # three selected by some worker since the sidecar last published
        row.add(layout.LANE_INFLIGHT, a.slot, a.generation)
    now = int(time.time() * 1e6)
    # The timeline knows one of them (pending); the next slot is free 200 ms from now.
    SnapshotWriter(seg).publish({a.slot: Pressure(a.generation, 1, 0, now + 200_000, now, now, 500_000)})
    router = Router(Settings(shm_name=name, instance_strategy="least_load"), seg, row)
    snapshot = router.view.directory.snapshot()
    backlog = router.view.components(snapshot.alive)["predicted_total_backlog_ms"][0]
    assert backlog == pytest.approx(200 + 2 * 500, abs=5)  # two unannounced x 500 ms
    weights = router.scorer.weights
    expected = (3 * weights["inflight"] + weights["pending_prefill_count"]
                + backlog * weights["predicted_total_backlog_ms"])
    assert router._fast_totals(snapshot) == pytest.approx([expected], abs=1e-2)
