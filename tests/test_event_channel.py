"""The worker -> sidecar event channel: per-worker rings in the segment, a bounded spill, drops
counted, and a restarted sidecar getting the live requests re-announced."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest

from shm_schema import Segment, WorkerRow, header, layout, read_rows
from shm_schema.bitfields import RequestKey
from shm_schema.events import EventHandlers, EventKind, EventReader, EventWriter
from proxy_workers.event_channel import EventChannelWriter
from tests.harness import private_segment_name

SPAWN = multiprocessing.get_context("spawn")
PRODUCERS = 4
EVENTS_EACH = 12_500  # 50,000 in all


@pytest.fixture
def seg_name():
    name = private_segment_name()
    seg = Segment.create_or_attach(name, 8, 8, 1024)
    try:
        yield name, seg
    finally:
        seg.close()
        Segment.unlink(name)


def _produce(name: str, index: int, count: int, start, done, stop) -> None:
    seg = Segment.attach(name)
    row = WorkerRow.claim(seg, index)
    writer = EventWriter(seg, row.row)
    start.wait()
    for seq in range(count):
        writer.reserve(1, RequestKey.pack(row.row, seq), index, 1, seq, 0, 0, 0, 0)
        if writer.spilled and seq % 256 == 0:
            time.sleep(0)  # a real worker yields to its loop; the spill keeps order meanwhile
    deadline = time.monotonic() + 30
    while writer.flush() and time.monotonic() < deadline:
        time.sleep(0.001)
    done.put((row.row, writer.written, writer.dropped))
    stop.wait(30)  # keep the row claimed until the parent has read everything
    seg.close()


def test_burst_of_50000_events_from_4_workers_none_lost(seg_name):
    name, seg = seg_name
    start, stop, done = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_produce, args=(name, i, EVENTS_EACH, start, done, stop))
             for i in range(PRODUCERS)]
    for p in procs:
        p.start()
    try:
        while len(read_rows(seg)) < PRODUCERS:
            time.sleep(0.01)
        reader = EventReader(seg)
        received: dict[int, list[int]] = {}
        start.set()
        finished: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for row in read_rows(seg):
                for event in reader.drain(row.row):
                    received.setdefault(RequestKey.row(event.request_key), []).append(
                        RequestKey.sequence(event.request_key))
            while not done.empty():
                finished.append(done.get())
            if len(finished) == PRODUCERS and sum(map(len, received.values())) >= PRODUCERS * EVENTS_EACH:
                break
            time.sleep(0.005)  # the sidecar's poll interval
        assert sum(w for _, w, _ in finished) == PRODUCERS * EVENTS_EACH
        assert all(dropped == 0 for _, _, dropped in finished)
        assert all(r.events_dropped == 0 for r in read_rows(seg))
        assert {row: len(seqs) for row, seqs in received.items()} == {r: EVENTS_EACH for r, _, _ in finished}
        for seqs in received.values():  # in order, none twice
            assert seqs == list(range(EVENTS_EACH))
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_full_ring_spills_in_order_and_counts_drops(seg_name):
    _, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    writer = EventWriter(seg, row.row, spill_limit=10)
    results = [writer.complete(1, i, 0, 1, i, failed=False) for i in range(1024 + 30)]
    assert results.count(False) == 20 and writer.dropped == 20
    assert read_rows(seg)[0].events_dropped == 20
    reader = EventReader(seg)
    first = [e.request_key for e in reader.drain(row.row)]
    assert first == list(range(1024))
    assert writer.flush() == 0  # the spill moves in once the ring has room, oldest first
    assert [e.request_key for e in reader.drain(row.row)] == list(range(1024, 1034))


def test_consume_hands_each_kind_its_fields_and_a_completion_whether_it_failed(seg_name):
    _, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    writer = EventWriter(seg, row.row)
    writer.reserve(1, 7, 2, 3, 1_000_000, 40_000, 500_000, 0, 0)
    writer.first_token(1, 7, 2, 3, 1_050_000)
    writer.complete(1, 7, 2, 3, 1_600_000, failed=False)
    writer.complete(1, 8, 2, 3, 1_700_000, failed=True)
    writer.complete(2, 9, 2, 3, 1_800_000, failed=False)  # another epoch's: not handed on
    seen: list[tuple] = []
    handlers = EventHandlers(lambda *a: seen.append(("reserve", *a)),
                             lambda *a: seen.append(("first_token", *a)),
                             lambda *a: seen.append(("complete", *a)), seen.append)
    assert EventReader(seg).consume(row.row, 1, handlers) == (5, 1)
    assert seen == [("reserve", 2, 3, 7, 1.0, 0.04, 0.5), ("first_token", 7, 1.05),
                    ("complete", 7, 1.6, False), ("complete", 8, 1.7, True)]


def test_new_sidecar_epoch_discards_spill_and_resyncs_live_requests(seg_name):
    _, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    events = EventChannelWriter(seg, row)
    reader = EventReader(seg)
    live, done = events.new_key(), events.new_key()
    events.reserve(live, 2, 1, service_ms=100, decode_ms=500, decode_tokens=20, prompt_tokens=50)
    events.first_token(live)
    events.reserve(done, 2, 1, service_ms=100, decode_ms=500, decode_tokens=20, prompt_tokens=50)
    events.complete(done, failed=False)
    before = list(reader.drain(row.row))
    assert [e.kind for e in before] == [EventKind.RESERVE, EventKind.FIRST_TOKEN, EventKind.RESERVE,
                                        EventKind.COMPLETE]
    assert all(e.epoch == 0 for e in before)
    seg.fetch_add(layout.H_SIDECAR_EPOCH, 1)  # a sidecar restarted
    events.tick()
    after = list(reader.drain(row.row))
    assert [(e.kind, e.request_key, e.epoch) for e in after] == [
        (EventKind.RESYNC, live, 1), (EventKind.FIRST_TOKEN, live, 1)]
    assert after[0].service_us == 100_000 and after[0].decode_us == 500_000
    assert (after[0].decode_tokens, after[0].prompt_tokens) == (20, 50)
    assert after[0].t_us == before[0].t_us
    assert events.resyncs == 1


def test_dropped_events_stay_counted_after_the_worker_is_gone(seg_name):
    from sidecar.pressure import PressurePublisher

    _, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    writer = EventWriter(seg, row.row, spill_limit=0)
    for i in range(1024 + 20):
        writer.complete(0, i, 0, 1, i, failed=False)
    publisher = PressurePublisher(seg, epoch=0, ready_slots=8)
    publisher.tick()
    assert publisher.stats.dropped_by_workers == 20
    row.release()  # the worker leaves (a reaped one goes through the same free_row)
    WorkerRow.claim(seg, 1)  # and another takes its row, starting from 0
    publisher.tick()
    assert publisher.stats.dropped_by_workers == 20


def test_a_wall_clock_set_back_does_not_hold_the_publishes(seg_name, monkeypatch):
    """Publishes are paced on the monotonic clock: with the wall clock set back an hour (an NTP
    step), the heartbeat and a changed snapshot still go out on time."""
    from sidecar import pressure

    _, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    writer = EventWriter(seg, row.row)
    publisher = pressure.PressurePublisher(seg, epoch=0, ready_slots=8, min_publish_interval_s=0.01,
                                           heartbeat_s=0.05)
    publisher.tick()
    published = publisher.stats.published
    wall = time.time
    monkeypatch.setattr(pressure.time, "time", lambda: wall() - 3600)
    time.sleep(0.06)
    publisher.tick()  # nothing changed: the heartbeat's publish
    writer.complete(0, 1, 0, 1, int(wall() * 1e6), failed=False)
    time.sleep(0.02)
    publisher.tick()  # a change, the minimum interval past
    assert publisher.stats.published == published + 2
    assert publisher._next_publish_in() <= 0.01
    row.release()


def test_one_scan_sees_every_rows_owner_unread_events_and_drops(seg_name):
    """What the sidecar reads of every row on every poll, in one struct call, against the
    rows' own headers (read_rows) and the rings themselves, ring wrap included."""
    _, seg = seg_name
    reader = EventReader(seg)
    assert reader.scan() == ((0,) * 8, [], 0)
    quiet, busy, lossy = (WorkerRow.claim(seg, index, identity=1000 + index) for index in range(3))
    busy_writer = EventWriter(seg, busy.row)
    for seq in range(1000):  # most of the ring, then taken, then past its end: a wrap
        busy_writer.first_token(1, seq, 0, 1, seq)
    assert len(reader.take(busy.row)) == 1000
    for seq in range(100):
        busy_writer.first_token(1, seq, 0, 1, seq)
    lossy_writer = EventWriter(seg, lossy.row, spill_limit=0)
    results = [lossy_writer.complete(1, i, 0, 1, i, failed=False) for i in range(1024 + 5)]
    assert results.count(False) == 5
    scan = reader.scan()
    assert scan.identities == tuple(r.identity for r in sorted(read_rows(seg), key=lambda r: r.row)) \
        + (0,) * 5
    assert scan.identities[:3] == (quiet.identity, busy.identity, lossy.identity)
    assert scan.unread == [busy.row, lossy.row] and scan.dropped == 5
    assert [e.request_key for e in reader.drain(busy.row)] == list(range(100))  # across the wrap
    lossy.release()
    assert reader.scan() == ((quiet.identity, busy.identity) + (0,) * 6, [], 0)


def test_a_scan_reads_the_claimed_rows_and_finds_new_ones_at_once_or_within_a_full_scan(seg_name):
    """A scan reads up to one past the highest claimed row (each row is a page of its own) and
    further while the last one read is claimed: rows claimed together since the last scan are
    all seen at once. The one claim it can miss (above a row claimed and freed again between
    two scans) is seen by the next full scan, every FULL_SCAN_EVERY scans."""
    from shm_schema.events import FULL_SCAN_EVERY

    _, seg = seg_name
    reader = EventReader(seg)
    assert reader.scan().identities == (0,) * 8   # the first scan reads every row
    rows = [WorkerRow.claim(seg, index, identity=2000 + index) for index in range(6)]
    assert reader.scan().identities == tuple(r.identity for r in rows) + (0, 0)  # one scan
    for row in rows[2:]:
        row.release()
    reader.scan()  # rows 0 and 1 remain: the next scans read rows 0..2
    hole, above = (WorkerRow.claim(seg, index, identity=3000 + index) for index in range(2))
    assert (hole.row, above.row) == (2, 3)
    EventWriter(seg, above.row).first_token(1, 7, 0, 1, 7)
    hole.release()  # between two scans: row 3 is claimed above a free row 2
    scans = [reader.scan() for _ in range(FULL_SCAN_EVERY)]
    first_seen = next(i for i, scan in enumerate(scans) if scan.identities[3] == above.identity)
    assert first_seen < FULL_SCAN_EVERY and scans[first_seen].unread == [above.row]
    assert reader.scan().identities[:4] == (rows[0].identity, rows[1].identity, 0, above.identity)


# The tests of close events poll 20 ms apart, their steps 5 ms apart: under two polls apart on a
# busy machine too (polled 1 ms apart, a starved test's steps came far apart: another regime).
CLOSE_RUN_POLL_S = 0.02


# The busy run polls every 5 ms and publishes at most every 50 ms: ten polls a publish.
BUSY_RUN_POLL_S, BUSY_RUN_PUBLISH_S = 0.005, 0.05


def _reserve(rig, request: int) -> int:
    """The worker's reserve event for its `request`th request (an event that rings); its key."""
    key = RequestKey.pack(rig.row.row, request)
    rig.writer.reserve(1, key, 0, 1, 1, 10_000, 20_000, 8, 64)
    return key


def _sidecar_on_its_doorbell(seg_name, scenario, poll_s: float = 0.001, ring_requests: bool = True,
                            **publisher_settings) -> None:
    """Runs `await scenario(rig)` while a PressurePublisher ticks every `poll_s` on its doorbell
    (heartbeat 30 s away) beside one worker row that rings it (its request events too unless
    `ring_requests` is False). The rig: `writer` and `row` (the worker's), `publisher`, `ticks`
    (one entry a tick), `doorbell`, `sleeping()`."""
    import asyncio
    from types import SimpleNamespace

    from cacheroute_proxy.doorbell import Bell, open_doorbell
    from sidecar.pressure import PressurePublisher

    name, seg = seg_name
    row = WorkerRow.claim(seg, 0)
    bell = Bell(name)
    publisher = PressurePublisher(seg, epoch=1, ready_slots=8, heartbeat_s=30.0, **publisher_settings)
    ticks: list[int] = []
    tick = publisher.tick
    publisher.tick = lambda: ticks.append(1) or tick()  # type: ignore[method-assign]

    async def run() -> None:
        doorbell = open_doorbell(name)
        assert doorbell is not None
        task = asyncio.create_task(publisher.run(poll_s, doorbell))
        try:
            await scenario(SimpleNamespace(
                writer=EventWriter(seg, row.row, wake=bell.ring, ring_requests=ring_requests),
                row=row, publisher=publisher,
                ticks=ticks, doorbell=doorbell,
                sleeping=lambda: seg.load(layout.H_SIDECAR_SLEEPING) == 1))
        finally:
            task.cancel()
            doorbell.close()

    try:
        asyncio.run(run())
    finally:
        bell.close()
        row.release()


def test_an_idle_sidecar_sleeps_until_a_workers_event_rings_its_doorbell(seg_name):
    """After a tick that took no event the sidecar stops polling (the header's sleeping word)
    until the doorbell rings; a worker's next event rings it and is taken at once, long before
    the sidecar's next periodic wake (30 s here)."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        polls = len(rig.ticks)
        await asyncio.sleep(0.3)
        assert len(rig.ticks) == polls and rig.sleeping()  # asleep: no tick in 300 ms
        _reserve(rig, 1)
        await _until(lambda: rig.publisher.stats.consumed == 1, 5)
        assert rig.doorbell.rings == 1

    _sidecar_on_its_doorbell(seg_name, scenario)


def test_a_first_token_and_a_completion_ring_no_one_and_go_with_the_next_event_that_does(seg_name):
    """A first token only corrects the prefill end the timeline predicts, and a completion the
    snapshot has not seen shows in the live inflight counters: neither wakes a sleeping sidecar,
    which takes them with the next event that rings."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        key = _reserve(rig, 1)
        await _until(lambda: rig.publisher.stats.consumed == 1 and rig.sleeping(), 5)
        rig.writer.first_token(1, key, 0, 1, 2)
        rig.writer.complete(1, key, 0, 1, 3, failed=False)
        await asyncio.sleep(0.2)
        assert rig.publisher.stats.consumed == 1 and rig.sleeping()  # still asleep
        assert rig.doorbell.rings == 1
        _reserve(rig, 2)
        await _until(lambda: rig.publisher.stats.consumed == 4, 5)
        assert rig.doorbell.rings == 2

    _sidecar_on_its_doorbell(seg_name, scenario)


def test_woken_by_heartbeat_a_requests_events_ring_no_one_and_acknowledged_knowledge_does(seg_name):
    """PROXY_SIDECAR_WAKE=heartbeat: a request's reserve and prompt (PREFIX) events wait in the
    ring like completions; an acknowledged knowledge id (RESIDENT) still wakes the sidecar,
    which then takes everything waiting."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        _reserve(rig, 1)
        rig.writer.prefix(1, 0, 1, 5, (11, 12), 128, 2)
        await asyncio.sleep(0.2)
        assert rig.publisher.stats.consumed == 0 and rig.sleeping() and rig.doorbell.rings == 0
        rig.writer.resident(1, 0, 1, 6, (13,), 1000)
        await _until(lambda: rig.publisher.stats.consumed == 3, 5)
        assert rig.doorbell.rings == 1

    _sidecar_on_its_doorbell(seg_name, scenario, ring_requests=False)


def test_a_workers_rings_wait_for_its_current_step_and_are_one_datagram(seg_name):
    """A worker rings once the step that wrote its events is done (it may be sending a request
    on, and the woken sidecar would take its core): rings asked for in one step are one."""
    import asyncio

    from cacheroute_proxy.doorbell import Bell

    name, _ = seg_name
    sidecar = _doorbell_socket(name)

    def datagrams() -> int:
        return _datagrams(sidecar)

    async def scenario() -> None:
        bell = Bell(name)
        try:
            for _ in range(3):
                bell.ring()
            assert datagrams() == 0  # still this step: nothing sent
            await asyncio.sleep(0)
            assert datagrams() == 1
            bell.ring()
            await asyncio.sleep(0)
            assert datagrams() == 1  # a later step rings again
        finally:
            bell.close()

    try:
        asyncio.run(scenario())
    finally:
        sidecar.close()


def test_events_far_apart_wake_the_sidecar_once_each(seg_name):
    """A request's events on a real engine come tens of milliseconds apart: once the sidecar
    has seen them come so, the tick that takes one is the only one, and it sleeps until the
    next rings -- no poll after it, which would find nothing."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        ticks_per_event = []
        for request in range(1, 9):
            before = len(rig.ticks)
            _reserve(rig, request)
            await _until(lambda: rig.publisher.stats.consumed == request and rig.sleeping(), 5)
            await asyncio.sleep(0.05)  # a gap between two events: 50 polls' worth
            assert rig.sleeping()  # not polling through the gap
            ticks_per_event.append(len(rig.ticks) - before)
        assert ticks_per_event[-4:] == [1, 1, 1, 1]  # learned: the event's tick alone
        assert max(ticks_per_event) <= 2  # before that, at most one poll more
        assert rig.doorbell.rings == 8

    _sidecar_on_its_doorbell(seg_name, scenario, min_publish_interval_s=0.0)


def test_events_close_together_are_polled_for_not_rung_for_each(seg_name):
    """Events coming faster than the poll: the sidecar keeps polling while they come, taking
    several a tick, so the workers ring for few of them; when they stop it sleeps again."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        events = 200
        for request in range(1, events + 1):
            _reserve(rig, request)
            if request % 5 == 0:
                await asyncio.sleep(0.005)  # five events every quarter poll
        await _until(lambda: rig.publisher.stats.consumed == events and rig.sleeping(), 5)
        # Polled: the first event rings, the polls take the rest (one ring, ~13 ticks here).
        # Asleep after each tick, the sidecar would be rung by every step of five (40 rings, 41
        # ticks): the worker's bell rings once a loop step, so a bound must sit below that.
        assert rig.doorbell.rings <= events / 40
        assert len(rig.ticks) < events / 8

    _sidecar_on_its_doorbell(seg_name, scenario, poll_s=CLOSE_RUN_POLL_S, min_publish_interval_s=0.0)


def test_busy_the_sidecar_ticks_when_a_publish_is_due_not_every_poll(seg_name):
    """Events coming many a poll: a tick between two publishes would only drain events (they
    carry their own times), so a busy sidecar sleeps until the next publish is due, and each of
    its ticks publishes; it still polls (no rings) and sleeps again when the events stop."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        published, ticks = rig.publisher.stats.published, len(rig.ticks)
        events, started = 400, time.monotonic()
        for request in range(1, events + 1):
            _reserve(rig, request)
            if request % 10 == 0:
                await asyncio.sleep(0.005)  # ten events every poll
        elapsed = time.monotonic() - started
        await _until(lambda: rig.publisher.stats.consumed == events and rig.sleeping(), 5)
        polls, publishes_due = elapsed / BUSY_RUN_POLL_S, elapsed / BUSY_RUN_PUBLISH_S
        ticked, publishes = len(rig.ticks) - ticks, rig.publisher.stats.published - published
        assert ticked < polls / 2, (ticked, polls)  # not a tick every poll
        assert ticked <= publishes_due + 4, (ticked, publishes_due)
        assert publishes >= ticked - 3, (publishes, ticked)  # the busy ticks publish
        assert rig.doorbell.rings <= 3  # polled for, not rung for

    _sidecar_on_its_doorbell(seg_name, scenario, poll_s=BUSY_RUN_POLL_S, min_publish_interval_s=BUSY_RUN_PUBLISH_S)


def test_a_tick_a_ring_woke_publishes_at_once(seg_name):
    """Asleep, the sidecar is woken by a worker's event and publishes it in that tick, the
    minimum interval (200 ms here) notwithstanding: a wake of its own for the publish would
    cost as much as the tick."""
    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        published = rig.publisher.stats.published
        _reserve(rig, 1)
        written = time.monotonic()
        await _until(lambda: rig.publisher.stats.published > published, 5)
        assert time.monotonic() - written < 0.1
        await _until(rig.sleeping, 5)

    _sidecar_on_its_doorbell(seg_name, scenario, min_publish_interval_s=0.2)


def test_a_publish_held_back_while_polling_goes_out_without_polling(seg_name):
    """Polling through a run of close events, publishes keep the minimum interval; the one
    held back when the run ends goes out when the interval has passed, the sidecar asleep
    until then rather than polling every millisecond."""
    import asyncio

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        published = rig.publisher.stats.published
        for request in range(1, 101):
            _reserve(rig, request)
            if request % 5 == 0:
                await asyncio.sleep(0.005)
        await _until(lambda: rig.publisher.stats.consumed == 100, 5)
        # The run's first tick (a ring woke it) publishes; the polls after it within the
        # minimum interval do not: not one publish a tick.
        assert rig.publisher.stats.published - published <= 2
        before = len(rig.ticks)
        await _until(lambda: not rig.publisher._dirty, 5)
        assert len(rig.ticks) - before <= 3  # the held-back publish's own tick, not ~50 polls
        await _until(rig.sleeping, 5)

    _sidecar_on_its_doorbell(seg_name, scenario, poll_s=CLOSE_RUN_POLL_S, min_publish_interval_s=1.0)


def test_an_engines_kv_events_wake_the_sleeping_sidecar_to_publish_the_row(seg_name):
    """An affinity change made outside a tick (an engine's KV event batch, a heartbeat's resident
    keys) rings the doorbell from inside the sidecar: the row is published at once, not at the
    next heartbeat (30 s here)."""
    from shm_schema import DirectoryWriter
    from shm_schema.affinity import AffinityReader
    from sidecar.affinity import AffinityModels

    _, seg = seg_name
    slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
    models = AffinityModels(seg, lambda s, g: 0)

    async def scenario(rig) -> None:
        await _until(rig.sleeping, 5)
        models.engine_stored(slot.slot, slot.generation, [7, 8], 128)
        await _until(lambda: AffinityReader(seg).row(slot.slot, slot.generation).prefix == {7, 8}, 5)
        assert rig.doorbell.rings == 0  # no worker rang: the sidecar woke itself
        await _until(rig.sleeping, 5)

    _sidecar_on_its_doorbell(seg_name, scenario, affinity=models)


async def _until(predicate, timeout_s: float) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("wake, datagrams", [("reservation", 1), ("heartbeat", 0)])
def test_a_workers_request_events_ring_as_its_settings_say(seg_name, wake, datagrams):
    """The worker as assembled (proxy_workers/server.py): with PROXY_SIDECAR_WAKE=heartbeat its
    reserve rings no sleeping sidecar."""
    import asyncio

    from cacheroute_proxy.config import Settings
    from proxy_workers.server import assemble

    name, seg = seg_name
    sidecar = _doorbell_socket(name)
    row = WorkerRow.claim(seg, 0)

    async def scenario() -> int:
        events = assemble(Settings(sidecar_wake=wake), seg, row, 0).events
        await asyncio.sleep(0)
        _datagrams(sidecar)  # the new row's own ring
        header.set_sidecar_sleeping(seg, True)
        events.reserve(events.new_key(), 0, 1, 10.0, 20.0, 8, 64)
        await asyncio.sleep(0)
        return _datagrams(sidecar)

    try:
        assert asyncio.run(scenario()) == datagrams
    finally:
        row.release()
        sidecar.close()


def _doorbell_socket(seg_name: str) -> socket.socket:
    """What a sidecar's doorbell listens on (cacheroute_proxy/doorbell.py), non-blocking."""
    from cacheroute_proxy.doorbell import address

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address(seg_name))
    sock.setblocking(False)
    return sock


def _datagrams(sock: socket.socket) -> int:
    """The rings waiting on `sock`, taken."""
    count = 0
    while True:
        try:
            sock.recv(16)
        except BlockingIOError:
            return count
        count += 1
