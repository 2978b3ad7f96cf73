"""The shared segment itself: header and lifecycle, the instance directory, the counters'
single-process contract, and the router's Lease. Real POSIX segments, unique names, always
unlinked."""

from __future__ import annotations

import os
import stat

import posix_ipc
import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.policy import Choice
from proxy_workers.router import Lease, Router
from shm_schema import (CounterWord, DirectoryFull, DirectoryReader, DirectoryWriter, CountersReader, Segment,
                        SegmentError, SegmentLayoutError, SegmentNotFound, WorkerRow,
                        WorkerTableFull, encode_identity, layout, read_all, read_rows)
from shm_schema.bitfields import JournalWord
from tests.shm_helpers import count_of, fresh_segment, published, share_of, unique_name, word_of


@pytest.fixture
def seg():
    with fresh_segment(instance_capacity=4, worker_capacity=3) as segment:
        yield segment


@pytest.fixture
def name():
    """A unique name, unlinked at teardown whatever the test created under it."""
    shm_name = unique_name()
    try:
        yield shm_name
    finally:
        Segment.unlink(shm_name)


# --- header and lifecycle ----------------------------------------------------------------------

def test_created_with_mode_0600_and_a_valid_header(seg):
    mode = stat.S_IMODE(os.stat(f"/dev/shm{seg.name}").st_mode)
    assert mode == 0o600
    assert seg.load(layout.H_MAGIC) == layout.MAGIC
    assert seg.load(layout.H_LAYOUT_VERSION) == layout.LAYOUT_VERSION
    assert seg.load(layout.H_TOTAL_SIZE) == layout.Geometry(4, 3).total_size
    assert seg.creation_id != 0
    assert seg.load(layout.H_DIRECTORY_SEQ) == 0
    for slot in range(4):  # fresh slots carry generation 1: a zero word is never a live lease
        assert word_of(seg, slot) == (1, 0)


def test_attach_to_missing_segment_says_to_start_the_sidecar(name):
    with pytest.raises(SegmentNotFound) as err:
        Segment.attach(name)
    assert name in str(err.value)
    assert "start the sidecar" in str(err.value)


def test_attach_to_other_layout_version_names_both_versions(seg):
    other = layout.LAYOUT_VERSION + 41
    seg.store(layout.H_LAYOUT_VERSION, other)
    with pytest.raises(SegmentLayoutError) as err:
        Segment.attach(seg.name)
    message = str(err.value)
    assert f"layout version {other}" in message
    assert f"layout version {layout.LAYOUT_VERSION}" in message
    assert "unlink" in message  # and says what to do


def test_attach_to_bad_magic_fails_clearly(seg):
    seg.store(layout.H_MAGIC, 0x0123456789ABCDEF)
    with pytest.raises(SegmentLayoutError, match="not a CacheRoute load table"):
        Segment.attach(seg.name)


def test_attach_to_foreign_segment_fails_clearly(name):
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        os.pwrite(shm.fd, b"\xff" * 64, 0)  # not zero (not "initialising"), not our magic
    finally:
        shm.close_fd()
    with pytest.raises(SegmentLayoutError, match="not a CacheRoute load table"):
        Segment.attach(name)


def test_attach_to_segment_with_wrong_size_fails_clearly(seg):
    seg.store(layout.H_TOTAL_SIZE, seg.geometry.total_size + 64)
    with pytest.raises(SegmentLayoutError, match="damaged"):
        Segment.attach(seg.name)


def test_uninitialised_segment_is_not_found_after_the_wait(seg):
    seg.store(layout.H_MAGIC, 0)  # the creator has not finished initialising
    with pytest.raises(SegmentNotFound, match="not initialised"):
        Segment.attach(seg.name, wait_s=0.1)


def test_is_current_detects_unlink_and_recreate(name):
    first = Segment.create_or_attach(name, 2, 2)
    second = None
    try:
        assert first.is_current()
        Segment.unlink(name)
        assert not first.is_current()
        second = Segment.create_or_attach(name, 2, 2)
        assert second.created
        assert second.is_current()
        assert not first.is_current()
        assert second.creation_id != first.creation_id
    finally:
        first.close()
        if second is not None:
            second.close()


def test_create_or_attach_on_existing_segment_keeps_counts(name):
    """A restarted sidecar re-attaches: directory, counts and rows survive."""
    first = Segment.create_or_attach(name, 4, 2)
    try:
        assert first.created
        inst = DirectoryWriter(first).allocate("inst-a", "127.0.0.1", 9001)
        row = WorkerRow.claim(first, 0)
        for _ in range(3):
            assert row.begin(inst.slot, inst.generation)
        again = Segment.create_or_attach(name, 4, 2)
        try:
            assert not again.created
            assert again.creation_id == first.creation_id
            assert word_of(again, inst.slot) == (inst.generation, 3)
            assert DirectoryReader(again).snapshot().instances == (inst,)
            assert [r.row for r in read_rows(again)] == [row.row]
            assert share_of(again, row.row, inst.slot, inst.generation) == 3
        finally:
            again.close()
        row.release()
    finally:
        first.close()


def test_unlink_reports_whether_a_segment_was_removed(name):
    assert Segment.unlink(name) is False
    Segment.create_or_attach(name, 1, 1).close()
    assert Segment.unlink(name) is True
    with pytest.raises(SegmentNotFound):
        Segment.attach(name)


# --- directory ---------------------------------------------------------------------------------

def test_allocate_and_free_bump_the_generation(seg):
    writer = DirectoryWriter(seg)
    reader = DirectoryReader(seg)
    a = writer.allocate("inst-a", "10.0.0.1", 9001, now_ms=1000)
    assert (a.slot, a.generation, a.instance_id, a.host, a.port, a.alive) == \
        (0, 2, "inst-a", "10.0.0.1", 9001, True)
    assert a.qps_1m is None
    assert word_of(seg, a.slot) == (a.generation, 0)
    assert seg.load(layout.H_DIRECTORY_SEQ) == 2
    writer.free(a.slot)
    freed_gen, _ = word_of(seg, a.slot)
    assert freed_gen == a.generation + 1
    assert reader.snapshot().instances == ()
    b = writer.allocate("inst-b", "10.0.0.2", 9002)
    assert b.slot == a.slot and b.generation == freed_gen + 1
    assert word_of(seg, b.slot) == (b.generation, 0)


def test_max_num_seqs_is_stored_updated_and_not_inherited_by_the_next_instance(seg):
    writer = DirectoryWriter(seg)
    a = writer.allocate("inst-a", "10.0.0.1", 9001, cp_port=9002, max_num_seqs=4)
    assert (a.cp_port, a.max_num_seqs) == (9002, 4)
    writer.update_registration(a.slot, "10.0.0.1", 9001, 9002, max_num_seqs=16)
    assert read_all(seg)[0].max_num_seqs == 16
    writer.free(a.slot)
    b = writer.allocate("inst-b", "10.0.0.2", 9003)
    assert b.slot == a.slot and b.max_num_seqs == 0  # the reused slot says "unknown"


def test_generation_wraps_past_zero(seg):
    base = seg.geometry.slot_offset(0)
    seg.store(base + layout.S_GENERATION, CounterWord.MAX_GENERATION)
    inst = DirectoryWriter(seg).allocate("inst-a", "h", 1)
    assert inst.generation == 1  # never 0
    seg.store(base + layout.S_GENERATION, CounterWord.MAX_GENERATION)
    DirectoryWriter(seg).free(0)
    assert seg.load(base + layout.S_GENERATION) == 1
    assert word_of(seg, 0) == (1, 0)


def test_alive_flag_controls_the_candidate_set(seg):
    writer = DirectoryWriter(seg)
    reader = DirectoryReader(seg)
    a = writer.allocate("inst-a", "h", 1, now_ms=1)
    b = writer.allocate("inst-b", "h", 2, now_ms=2)
    assert [s.instance_id for s in reader.snapshot().alive] == ["inst-a", "inst-b"]
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    writer.set_alive(a.slot, False)
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq + 2
    snap = reader.snapshot()
    assert [s.instance_id for s in snap.instances] == ["inst-a", "inst-b"]
    assert [s.instance_id for s in snap.alive] == ["inst-b"]
    assert snap.slot_span == 2 and snap.stable
    writer.set_alive(a.slot, False)  # no change, no sequence bump
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq + 2
    writer.set_alive(a.slot, True)
    assert [s.instance_id for s in reader.snapshot().alive] == ["inst-a", "inst-b"]
    assert b.generation == reader.snapshot().alive[1].generation


def test_unhealthy_says_why_an_instance_is_out_and_never_outlives_its_slot(seg):
    writer = DirectoryWriter(seg)
    reader = DirectoryReader(seg)
    a = writer.allocate("inst-a", "h", 1)
    assert not a.unhealthy and a.alive
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    writer.set_alive(a.slot, False, unhealthy=True)
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq + 2  # one bracket for both words
    (out,) = reader.snapshot().instances
    assert (out.alive, out.unhealthy) == (False, True) and reader.snapshot().alive == ()
    writer.set_alive(a.slot, False)  # out for its TTL now: the reason changes, so does the seq
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq + 4
    assert reader.snapshot().instances[0].unhealthy is False
    writer.set_alive(a.slot, True, unhealthy=True)  # a candidate is never unhealthy
    assert (reader.snapshot().instances[0].alive, reader.snapshot().instances[0].unhealthy) == (True, False)
    writer.set_alive(a.slot, False, unhealthy=True)
    writer.free(a.slot)
    again = writer.allocate("inst-b", "h", 2)
    assert again.slot == a.slot and (again.alive, again.unhealthy) == (True, False)
    held = writer.allocate("inst-c", "h", 3, unhealthy=True)  # registered, not yet a candidate
    assert (held.alive, held.unhealthy) == (False, True)
    assert [s.instance_id for s in reader.snapshot().alive] == ["inst-b"]


def test_encode_identity_rejects_what_does_not_fit(seg):
    assert encode_identity("a" * layout.MAX_ID_BYTES, "h" * layout.MAX_HOST_BYTES)
    with pytest.raises(ValueError, match="^instance_id:"):
        encode_identity("a" * (layout.MAX_ID_BYTES + 1), "h")
    with pytest.raises(ValueError, match="^instance_id:"):
        encode_identity("é" * (layout.MAX_ID_BYTES // 2 + 1), "h")  # bytes, not characters
    with pytest.raises(ValueError, match="^host:"):
        encode_identity("a", "h" * (layout.MAX_HOST_BYTES + 1))
    with pytest.raises(ValueError, match="^instance_id:"):
        encode_identity("", "h")
    with pytest.raises(ValueError, match="^host:"):
        encode_identity("a", "")
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    with pytest.raises(ValueError, match="^host:"):
        DirectoryWriter(seg).allocate("a", "h" * (layout.MAX_HOST_BYTES + 1), 1)
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq
    assert DirectoryReader(seg).snapshot().instances == ()


def test_max_length_identity_round_trips(seg):
    iid = "i" * (layout.MAX_ID_BYTES - 2) + "é"
    host = "h" * layout.MAX_HOST_BYTES
    inst = DirectoryWriter(seg).allocate(iid, host, 65535)
    assert (inst.instance_id, inst.host, inst.port) == (iid, host, 65535)


def test_directory_full_leaves_other_slots_untouched(seg):
    writer = DirectoryWriter(seg)
    row = WorkerRow.claim(seg, 0)
    placed = [writer.allocate(f"inst-{i}", "h", 9000 + i) for i in range(4)]
    for inst in placed:
        assert row.begin(inst.slot, inst.generation)
    snapshot = DirectoryReader(seg).snapshot()
    words = CountersReader(seg).words(4)
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    with pytest.raises(DirectoryFull, match="4 instance slots"):
        writer.allocate("one-too-many", "h", 1)
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq
    assert CountersReader(seg).words(4) == words
    assert DirectoryReader(seg).snapshot().instances == snapshot.instances
    row.release()


def test_reader_keeps_cached_snapshot_while_a_write_is_in_progress(seg):
    writer = DirectoryWriter(seg)
    reader = DirectoryReader(seg)
    a = writer.allocate("inst-a", "h", 1)
    before = reader.snapshot()
    assert before.stable and [s.instance_id for s in before.alive] == ["inst-a"]
    # A sidecar killed mid-write: sequence odd, the slot half changed.
    seg.fetch_add(layout.H_DIRECTORY_SEQ, 1)
    seg.store(seg.geometry.slot_offset(a.slot) + layout.S_ALIVE, 0)
    assert reader.snapshot() is before
    assert reader.snapshot() is before
    # A reader that starts meanwhile uses what it reads, but does not trust it as stable.
    late = DirectoryReader(seg)
    unstable = late.snapshot()
    assert not unstable.stable and unstable.alive == ()
    writer.repair()
    seq = seg.load(layout.H_DIRECTORY_SEQ)
    assert seq % 2 == 0
    after = reader.snapshot()
    assert after.stable and after.seq == seq and after.alive == ()
    assert late.snapshot().stable
    writer.repair()  # already even: a no-op
    assert seg.load(layout.H_DIRECTORY_SEQ) == seq


def test_reader_snapshot_is_cached_on_the_sequence(seg):
    writer = DirectoryWriter(seg)
    reader = DirectoryReader(seg)
    writer.allocate("inst-a", "h", 1)
    first = reader.snapshot()
    assert reader.snapshot() is first
    writer.touch(0, last_seen_ms=123, qps_1m=2.5)  # not part of selection: no sequence bump
    assert reader.snapshot() is first
    writer.update_registration(0, "other-host", 7)
    second = reader.snapshot()
    assert second is not first and (second.instances[0].host, second.instances[0].port) == ("other-host", 7)
    assert second.instances[0].qps_1m == 2.5


# --- counters -----------------------------------------------------------------------------------

def test_begin_on_stale_generation_returns_false(seg):
    inst = DirectoryWriter(seg).allocate("inst-a", "h", 1)
    row = WorkerRow.claim(seg, 0)
    assert not row.begin(inst.slot, inst.generation + 1)
    assert not row.begin(inst.slot, inst.generation - 1)
    assert word_of(seg, inst.slot) == (inst.generation, 0)
    assert share_of(seg, row.row, inst.slot, inst.generation) == 0
    assert row.begin(inst.slot, inst.generation)
    assert word_of(seg, inst.slot) == (inst.generation, 1)
    row.release()


def test_end_floors_at_zero_and_returns_false(seg):
    inst = DirectoryWriter(seg).allocate("inst-a", "h", 1)
    row = WorkerRow.claim(seg, 0)
    assert not row.end(inst.slot, inst.generation)
    assert word_of(seg, inst.slot) == (inst.generation, 0)
    assert row.begin(inst.slot, inst.generation)
    assert row.end(inst.slot, inst.generation)
    assert not row.end(inst.slot, inst.generation)
    assert word_of(seg, inst.slot) == (inst.generation, 0)
    assert share_of(seg, row.row, inst.slot, inst.generation) == 0
    assert [r.pending_slot for r in read_rows(seg)] == [None]  # journal closed on every path
    row.release()


def test_router_lease_double_release_decrements_once(seg):
    DirectoryWriter(seg).allocate("inst-a", "127.0.0.1", 9001)
    settings = Settings(instance_strategy="least_load", shm_name=seg.name,
                        shm_instance_capacity=4, shm_worker_capacity=3, workers=1)
    row = WorkerRow.claim(seg, 0)
    router = Router(settings, seg, row)
    first, second = router.acquire(), router.acquire()
    assert first.instance.instance_id == second.instance.instance_id == "inst-a"
    assert first.base_url == "http://127.0.0.1:9001"
    slot = first.instance.slot
    assert count_of(seg, slot) == 2
    assert first.release() is True
    assert first.release() is False
    assert count_of(seg, slot) == 1
    assert share_of(seg, row.row, slot, first.instance.generation) == 1
    assert second.release() is True
    assert count_of(seg, slot) == 0
    # A Lease made by hand follows the same at-most-once rule.
    inst = first.instance
    assert row.begin(inst.slot, inst.generation)
    lease = Lease(Choice(inst), row)
    assert [lease.release(), lease.release()] == [True, False]
    assert count_of(seg, slot) == 0
    row.release()


def test_worker_table_full(seg):
    rows = [WorkerRow.claim(seg, i) for i in range(3)]
    assert sorted(r.row for r in rows) == [0, 1, 2]
    with pytest.raises(WorkerTableFull, match="all 3 worker rows"):
        WorkerRow.claim(seg, 3)
    rows[1].release()
    again = WorkerRow.claim(seg, 4)
    assert again.row == 1
    assert [r.worker_index for r in read_rows(seg)] == [0, 4, 2]
    for r in (rows[0], again, rows[2]):
        r.release()
    assert read_rows(seg) == []


def test_claim_starts_from_a_clean_row(seg):
    inst = DirectoryWriter(seg).allocate("inst-a", "h", 1)
    geometry = seg.geometry
    # Garbage left in a free row (a row is only zeroed for the slots that held something).
    seg.store(geometry.contribution_offset(0, inst.slot), CounterWord.pack(inst.generation, 9))
    seg.store(geometry.row_offset(0) + layout.R_JOURNAL,
              JournalWord.pending(3, inst.slot, layout.LANE_INFLIGHT, is_end=False))
    row = WorkerRow.claim(seg, 5)
    assert row.row == 0
    assert share_of(seg, 0, inst.slot, inst.generation) == 0
    assert [(r.worker_index, r.pending_slot) for r in read_rows(seg)] == [(5, None)]
    row.release()


def test_inflight_reader_words_match_the_words(seg):
    writer = DirectoryWriter(seg)
    row = WorkerRow.claim(seg, 0)
    insts = [writer.allocate(f"inst-{i}", "h", i + 1) for i in range(3)]
    for inst, n in zip(insts, (2, 0, 5)):
        for _ in range(n):
            assert row.begin(inst.slot, inst.generation)
    writer.free(insts[1].slot)
    reader = CountersReader(seg)
    for span in (1, 3, 4):
        words = reader.words(span)
        assert words == tuple(seg.load(seg.geometry.inflight_offset(s)) for s in range(span))
    assert [CounterWord.count(w) for w in reader.words(3)] == [2, 0, 5]
    assert [CounterWord.generation(w) for w in reader.words(3)] == \
        [insts[0].generation, insts[1].generation + 1, insts[2].generation]
    row.release()


def test_segment_error_is_the_common_base():
    assert issubclass(SegmentNotFound, SegmentError)
    assert issubclass(SegmentLayoutError, SegmentError)


def test_a_snapshot_publish_writes_only_up_to_its_highest_slot_and_clears_what_it_held(seg):
    """The writer packs slots 0 .. the highest it publishes in one call: a slot published
    before and absent now reads as cleared in both buffers, and a new writer (a restarted
    sidecar) clears whatever its predecessor left above its own span."""
    from shm_schema.records import SnapshotRecord
    from shm_schema.snapshot import SnapshotReader, SnapshotWriter

    full = {slot: SnapshotRecord(slot + 1, 1, 2, 3, 4, 5, 6) for slot in range(4)}
    writer, reader = SnapshotWriter(seg), SnapshotReader(seg)
    writer.publish(full)
    writer.publish(full)  # both buffers hold four slots
    for _ in range(3):  # then only slot 0, through both buffers and back
        writer.publish({0: full[0]})
        assert [published(reader, slot, slot + 1) for slot in range(4)] == [full[0], None, None, None]
    writer.publish(full)
    SnapshotWriter(seg).publish({1: full[1]})  # a new writer, over a buffer holding four slots
    assert [published(reader, slot, slot + 1) for slot in range(4)] == [None, full[1], None, None]


def test_a_snapshot_read_that_overlaps_a_publish_never_returns_fewer_slots_than_asked(seg):
    """The pressure reader keeps its previous records when the writer moves on mid-read, but
    only if they cover the span asked for: the fast scorer indexes every slot below it (a
    shorter tuple was an IndexError under kv_aware's benchmark)."""
    from shm_schema.records import SnapshotRecord
    from shm_schema.snapshot import SnapshotReader, SnapshotWriter

    writer, reader = SnapshotWriter(seg), SnapshotReader(seg)
    writer.publish({0: SnapshotRecord(1, 0, 0, 0, 0, 0)})
    assert len(reader.records(1)) == len(SnapshotRecord._fields)
    writer.publish({0: SnapshotRecord(1, 0, 0, 0, 0, 0), 1: SnapshotRecord(1, 0, 0, 0, 0, 0)})
    real_generation, calls = reader.generation, []

    def generation_moving_on() -> int:  # the second generation load sees a newer publish
        value = real_generation()
        calls.append(value)
        return value + (len(calls) - 1)
    reader.generation = generation_moving_on
    try:
        assert reader.records(2) == ()  # not the one-slot records kept from before
        calls.clear()
        assert len(reader.records(1)) == len(SnapshotRecord._fields)  # those do cover one slot
    finally:
        reader.generation = real_generation
