"""shm_schema's declarations: each record and bit-packed word round-trips, sits where layout.py's
byte map says, and spells exactly the bytes the code before the declarations wrote (a segment of
that code, tests/golden_segment_v3.py; layout 4, tests/golden_segment_v4.py, is that segment with
the affinity region added after it and every earlier word unchanged but the version and the size;
layout 5, tests/golden_segment_v5.py, adds the claims ring after that, a header word and a
snapshot word that were reserved; layout 6, tests/golden_segment_v6.py, the prompt-home table
after the claims ring)."""

from __future__ import annotations

import os
import re
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from shm_schema import (CountersReader, CounterWord, DirectoryWriter, Segment, WorkerRow, header,
                        layout, read_all, read_rows)
from shm_schema.bitfields import (EventTag, JournalWord, OptionalFloatWord, ProcessIdentity,
                                  RequestKey, SlotGeneration)
from shm_schema.events import Event, EventKind, EventReader, EventWriter
from shm_schema.affinity import AffinityReader, AffinityWriter, Resident
from shm_schema.bitfields import AffinityValue, ClaimValue
from shm_schema.claims import ClaimReader, Claimed, ClaimWriter, KeyGroup
from shm_schema.events import residency
from shm_schema.homes import HomeReader, HomeWriter
from shm_schema.records import (AFFINITY_ENTRY, AFFINITY_KNOWLEDGE, AFFINITY_PREFIX,
                                AFFINITY_ROW_HEADER, CLAIM, CLAIM_OP_CLAIM, CLAIM_OP_DROP,
                                COUNTER_LANES, EVENT, HEADER, HOME_ENTRY, HOME_TABLE_HEADER, PAYLOAD_START,
                                ROW_HEADER, SLOT, SNAPSHOT, CompletePayload, Record,
                                ReservePayload, ResidencyPayload, SnapshotRecord)
from shm_schema.segment import SegmentLayoutError
from shm_schema.snapshot import SnapshotReader, SnapshotWriter
from tests import golden_segment_v3, golden_segment_v4, golden_segment_v5, golden_segment_v6
from tests.harness import private_segment_name
from tests.shm_helpers import published

# No example database, and hypothesis's cache out of the (shared) checkout, as in test_fuzz.py.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"cacheroute-hypothesis-{os.getuid()}")
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
U64 = st.integers(0, (1 << 64) - 1)
RECORDS = {"HeaderWords": HEADER, "CounterLanes": COUNTER_LANES, "SlotRecord": SLOT,
           "SnapshotRecord": SNAPSHOT, "RowHeader": ROW_HEADER, "EventRecord": EVENT,
           "AffinityRowHeader": AFFINITY_ROW_HEADER, "AffinityEntry": AFFINITY_ENTRY,
           "ClaimRecord": CLAIM, "HomeTableHeader": HOME_TABLE_HEADER}


# --- the byte map --------------------------------------------------------------------------------
def _documented_blocks() -> dict[str, str]:
    """layout.py's byte-map blocks, keyed by the declaration their heading names."""
    paragraphs = (layout.__doc__ or "").split("\n\n")
    blocks = {}
    for heading, block in zip(paragraphs, paragraphs[1:]):
        named = re.search(r"\((\w+)[,;)]", heading)
        if heading.endswith("::") and named:
            blocks[named.group(1)] = block
    return blocks


@pytest.mark.parametrize("name", ["HeaderWords", "SlotRecord", "SnapshotRecord", "RowHeader",
                                  "EventRecord", "AffinityRowHeader", "ClaimRecord", "HomeTableHeader"])
def test_every_field_is_where_the_byte_map_says(name: str) -> None:
    record = RECORDS[name]
    documented = {field: int(offset) for offset, field in
                  re.findall(r"^    (\d+)\s+(\w+)", _documented_blocks()[name], re.MULTILINE)}
    assert {field: documented.get(field) for field in record.fields} == record.offset._asdict()
    beyond = {field: offset for field, offset in documented.items() if field not in record.fields}
    assert all(offset >= record.size for offset in beyond.values()), beyond  # what follows it


def test_the_counter_lanes_are_the_ones_the_byte_map_lists() -> None:
    block = _documented_blocks()["CounterLanes"]
    listed = re.findall(r"(\d+) ([a-z_]+)", block[block.index("lane 0"):])
    assert {name: int(lane) for lane, name in listed if name != "reserved"} == \
        COUNTER_LANES.index._asdict()


def test_the_layout_version_and_the_sizes_are_unchanged() -> None:
    assert layout.LAYOUT_VERSION == 6
    assert (HEADER.size, COUNTER_LANES.size, SLOT.size, SNAPSHOT.size, ROW_HEADER.size,
            EVENT.size, AFFINITY_ROW_HEADER.size, AFFINITY_ENTRY.size, CLAIM.size,
            HOME_TABLE_HEADER.size, HOME_ENTRY.size) == (256, 64, 320, 64, 128, 64, 64, 16, 64, 64, 16)
    assert (layout.LANES, layout.LANES_USED, layout.MAX_ID_BYTES, layout.MAX_HOST_BYTES) == (8, 5, 112, 64)
    assert layout.AFFINITY_ROW_SIZE == 64 + 512 * 16
    # Layout 3's regions end where they did (4096; 5_382_400 for the defaults): the affinity
    # rows follow, one per instance slot.
    assert layout.Geometry(4, 2, 8).affinity_offset == 4096
    assert layout.Geometry(256, 64).affinity_offset == 5_382_400
    # Layout 4's end: the claims ring follows, 4,096 records of 64 bytes.
    assert layout.Geometry(4, 2, 8).claims_offset == 4096 + 4 * 8256
    assert layout.Geometry(256, 64).claims_offset == 5_382_400 + 256 * 8256
    # Layout 5's end: the prompt-home table follows, 64 + 1,024 x 16 bytes.
    assert layout.Geometry(4, 2, 8).homes_offset == 4096 + 4 * 8256 + 4096 * 64
    assert layout.Geometry(4, 2, 8).total_size == 4096 + 4 * 8256 + 4096 * 64 + 64 + 1024 * 16
    assert layout.Geometry(256, 64).homes_offset == 5_382_400 + 256 * 8256 + 4096 * 64
    assert layout.Geometry(256, 64).total_size == 5_382_400 + 256 * 8256 + 4096 * 64 + 64 + 1024 * 16


def test_a_record_that_does_not_fit_its_size_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        Record(SnapshotRecord, size=48)
    with pytest.raises(ValueError, match="no field"):
        Record(SnapshotRecord, text={"nothing": 8})


def _record_values(record: Record) -> st.SearchStrategy[tuple]:
    fields = [st.binary(min_size=record.text[name], max_size=record.text[name])
              if name in record.text else U64 for name in record.fields]
    return st.tuples(*fields)


@pytest.mark.parametrize("name", sorted(RECORDS))
@PROPERTY
@given(data=st.data())
def test_a_record_round_trips_with_each_field_at_its_offset(name: str, data: st.DataObject) -> None:
    record = RECORDS[name]
    values = record.make(data.draw(_record_values(record)))
    buffer = bytearray(b"\xff" * (record.size + 16))
    record.pack_into(buffer, 8, values)
    assert record.unpack_from(buffer, 8) == values
    for field, value in values._asdict().items():
        offset = 8 + getattr(record.offset, field)
        if field in record.text:
            assert bytes(buffer[offset:offset + len(value)]) == value
        else:
            assert struct.unpack_from("@Q", buffer, offset)[0] == value
    used = getattr(record.offset, record.fields[-1]) + record.text.get(record.fields[-1], 8)
    assert buffer[8 + used:8 + record.size] == bytes(record.size - used)  # reserved: zero
    assert buffer[:8] == buffer[8 + record.size:] == b"\xff" * 8  # nothing outside the record


# --- the bit-packed words ---------------------------------------------------------------------------
def test_each_word_is_spelled_as_the_layout_always_stored_it() -> None:
    """Hex literals, written independently of the code: the words the old code stored."""
    assert CounterWord.pack(5, 7) == 0x0000_0005_0000_0007
    assert JournalWord.idle(7) == 0x0700_0000
    assert JournalWord.pending(7, slot=2, lane=3, is_end=True) == 0x0707_0003
    assert RequestKey.pack(1, 2) == 0x0001_0000_0000_0002
    assert ProcessIdentity.pack(4321, 987_654) == 0x0000_03C4_8180_10E1
    assert EventTag.pack(EventKind.RESERVE, 2) == 0x201
    assert AffinityValue.pack(AFFINITY_PREFIX, 64) == 0x0000_0002_0000_0040
    assert SlotGeneration.pack(1, 4) == 0x0000_0001_0000_0004
    assert OptionalFloatWord.pack(1.5) == 0x3FF8_0000_0000_0000
    assert OptionalFloatWord.pack(None) == 0x7FF8_0000_0000_0000


@PROPERTY
@given(st.integers(0, CounterWord.MAX_GENERATION), st.integers(0, CounterWord.COUNT_MASK))
def test_counter_word_round_trips(generation: int, count: int) -> None:
    word = CounterWord.pack(generation, count)
    assert (CounterWord.generation(word), CounterWord.count(word)) == (generation, count)
    assert CounterWord.count_under(word, generation) == count
    assert CounterWord.count_under(word, generation + 1) is None
    # Its native 32-bit halves, as a reader in C loads them (CountersReader.count_offset).
    halves = dict(zip(CounterWord.HALVES, struct.unpack("=II", struct.pack("=Q", word))))
    assert halves == {"generation": generation, "count": count}


@PROPERTY
@given(st.integers(0, (1 << 40) - 1), st.integers(0, 4095), st.integers(0, layout.LANES - 1),
       st.booleans())
def test_journal_word_round_trips(sequence: int, slot: int, lane: int, is_end: bool) -> None:
    journal = JournalWord.pending(sequence, slot, lane, is_end)
    assert (JournalWord.pending_slot(journal), JournalWord.pending_lane(journal),
            JournalWord.pending_is_end(journal)) == (slot, lane, is_end)
    idle = JournalWord.idle(sequence)
    assert (JournalWord.pending_slot(idle), JournalWord.pending_is_end(idle)) == (None, False)
    assert idle != JournalWord.idle(sequence + 1)  # the sequence tells operations apart


@PROPERTY
@given(st.integers(0, (1 << 16) - 1), st.integers(0, RequestKey.SEQUENCE_MASK))
def test_request_key_round_trips(row: int, sequence: int) -> None:
    key = RequestKey.pack(row, sequence)
    assert (RequestKey.row(key), RequestKey.sequence(key)) == (row, sequence)


@PROPERTY
@given(st.integers(0, ProcessIdentity.PID_MASK), st.integers(0, (1 << 42) - 1))
def test_process_identity_round_trips(pid: int, ticks: int) -> None:
    identity = ProcessIdentity.pack(pid, ticks)
    assert ProcessIdentity.unpack(identity) == (pid, ticks)
    assert ProcessIdentity.pid(identity) == pid


@PROPERTY
@given(st.sampled_from(EventKind), st.integers(0, (1 << 56) - 1),
       st.integers(0, (1 << 32) - 1), st.integers(0, SlotGeneration.GENERATION_MASK))
def test_event_tag_and_slot_generation_round_trip(kind: EventKind, epoch: int, slot: int,
                                                   generation: int) -> None:
    tag = EventTag.pack(kind, epoch)
    assert (EventTag.kind(tag), EventTag.epoch(tag)) == (kind, epoch)
    where = SlotGeneration.pack(slot, generation)
    assert (SlotGeneration.slot(where), SlotGeneration.generation(where)) == (slot, generation)


@PROPERTY
@given(st.none() | st.floats(allow_nan=False))
def test_optional_float_word_round_trips(value: float | None) -> None:
    assert OptionalFloatWord.unpack(OptionalFloatWord.pack(value)) == value


@PROPERTY
@given(st.sampled_from([AFFINITY_KNOWLEDGE, AFFINITY_PREFIX]), st.integers(0, AffinityValue.TOKENS_MASK))
def test_affinity_value_round_trips(kind: int, tokens: int) -> None:
    word = AffinityValue.pack(kind, tokens)
    assert (AffinityValue.kind(word), AffinityValue.tokens(word)) == (kind, tokens)


@PROPERTY
@given(st.sampled_from([CLAIM_OP_CLAIM, CLAIM_OP_DROP]), st.sampled_from([AFFINITY_KNOWLEDGE, AFFINITY_PREFIX]),
       st.integers(0, AffinityValue.TOKENS_MASK))
def test_claim_value_round_trips(op: int, kind: int, tokens: int) -> None:
    word = ClaimValue.pack(op, kind, tokens)
    assert (ClaimValue.op(word), ClaimValue.kind(word), ClaimValue.tokens(word)) == (op, kind, tokens)
    assert ClaimValue.pack(CLAIM_OP_DROP, AFFINITY_PREFIX, 128) == 0x0002_0002_0000_0080


# --- events: one writer method per kind, the payload by name ------------------------------------------
def test_the_decoded_event_names_the_payload_declarations() -> None:
    head = ("kind", "epoch", "request_key", "slot", "generation", "t_us")
    assert Event._fields == head + ReservePayload._fields + CompletePayload._fields
    payload_words = EVENT.count - PAYLOAD_START
    assert len(ReservePayload._fields) <= payload_words
    assert len(CompletePayload._fields) <= payload_words


@pytest.fixture
def seg():
    name = private_segment_name()
    segment = Segment.create_or_attach(name, 4, 2, 8)
    try:
        yield segment
    finally:
        segment.close()
        Segment.unlink(name)


def test_each_writer_method_puts_its_payload_where_the_declaration_says(seg) -> None:
    row = WorkerRow.claim(seg, 0)
    writer = EventWriter(seg, row.row)
    key = RequestKey.pack(row.row, 9)
    writer.reserve(5, key, 3, 7, 1234, service_us=11, decode_us=22, decode_tokens=33, prompt_tokens=44)
    writer.complete(5, key, 3, 7, 1240, failed=True)
    ring = seg.geometry.ring_offset(row.row)
    reserve = EVENT.unpack_from(seg.buf, ring)
    assert (EventTag.kind(reserve.tag), EventTag.epoch(reserve.tag)) == (EventKind.RESERVE, 5)
    assert (reserve.request_key, reserve.t_us) == (key, 1234)
    assert (SlotGeneration.slot(reserve.slot_generation),
            SlotGeneration.generation(reserve.slot_generation)) == (3, 7)
    assert ReservePayload._make(reserve[PAYLOAD_START:]) == ReservePayload(11, 22, 33, 44)
    complete = EVENT.unpack_from(seg.buf, ring + EVENT.size)
    assert EventTag.kind(complete.tag) == EventKind.COMPLETE
    assert complete[PAYLOAD_START:] == CompletePayload(failed=1) + (0,) * 3
    writer.prefix(5, 3, 7, 1250, (0xA1, 0xA2, 0xA3), 128, prompt_blocks=4)  # names the prompt
    writer.prefix(5, 3, 7, 1250, (0xA4,), 128)
    named, rest = (EVENT.unpack_from(seg.buf, ring + n * EVENT.size) for n in (2, 3))
    assert (named.request_key, ResidencyPayload._make(named[PAYLOAD_START:])) == \
        (4, ResidencyPayload(0xA1, 0xA2, 0xA3, 128))
    assert (rest.request_key, ResidencyPayload._make(rest[PAYLOAD_START:])) == \
        (0, ResidencyPayload(0xA4, 0, 0, 128))
    row.release()


_EVENT_ARGS = st.tuples(st.integers(0, (1 << 56) - 1), st.integers(0, (1 << 64) - 1),
                        st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 32) - 1), U64)


@settings(PROPERTY, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(EventKind), head=_EVENT_ARGS,
       payload=st.tuples(U64, U64, U64, U64), failed=st.booleans())
def test_every_kind_round_trips_through_the_ring(seg, kind, head, payload, failed) -> None:
    epoch, key, slot, generation, t_us = head
    writer = EventWriter(seg, 1)
    if kind in (EventKind.RESIDENT, EventKind.PREFIX):
        write = writer.resident if kind == EventKind.RESIDENT else writer.prefix
        keys = tuple(p for p in payload[:3] if p) or (1,)
        write(epoch, slot, generation, t_us, keys, payload[3])
        [event] = list(EventReader(seg).drain(1))
        assert (event.kind, event.epoch, event.slot, event.generation, event.t_us) == \
            (kind, epoch, slot, generation, t_us)
        assert residency(event) == ResidencyPayload(*(*keys, 0, 0)[:3], payload[3])
        return
    if kind in (EventKind.RESERVE, EventKind.RESYNC):
        write = writer.reserve if kind == EventKind.RESERVE else writer.resync
        write(epoch, key, slot, generation, t_us, *payload)
        expected = Event(kind, epoch, key, slot, generation, t_us, *payload)
    elif kind == EventKind.COMPLETE:
        writer.complete(epoch, key, slot, generation, t_us, failed=failed)
        expected = Event(kind, epoch, key, slot, generation, t_us, failed=failed)
    else:
        writer.first_token(epoch, key, slot, generation, t_us)
        expected = Event(kind, epoch, key, slot, generation, t_us)
    assert list(EventReader(seg).drain(1)) == [expected]


# --- a segment of the code before the declarations ----------------------------------------------------
def write_reference(seg: Segment) -> None:
    """The steps behind tests/golden_segment_v3.py: every region gets something."""
    directory = DirectoryWriter(seg)
    a = directory.allocate("inst-a", "10.0.0.1", 9001, now_ms=1_000, cp_port=9101, max_num_seqs=8)
    gone = directory.allocate("inst-gone", "10.0.0.9", 9009, now_ms=1_500)
    directory.free(gone.slot)
    b = directory.allocate("inst-b", "host-b.example", 9002, now_ms=2_000)
    directory.touch(b.slot, 2_500, qps_1m=1.5)
    directory.set_alive(b.slot, False)
    WorkerRow.claim(seg, 0, identity=ProcessIdentity.pack(1111, 2222))  # idle, holds row 0
    row = WorkerRow.claim(seg, 3, identity=ProcessIdentity.pack(4321, 987_654))
    for _ in range(3):
        row.begin(a.slot, a.generation)
    row.end(a.slot, a.generation)
    row.add(layout.LANE_PREPARE_WAITING, b.slot, b.generation)
    row.try_admit(layout.LANE_READY_ACTIVE, b.slot, b.generation, 4)
    row.end(gone.slot, gone.generation)  # stale: refused
    events = EventWriter(seg, row.row)
    key = RequestKey.pack(row.row, 1)
    events.reserve(2, key, a.slot, a.generation, 1_000_000, service_us=250_000, decode_us=900_000,
                   decode_tokens=64, prompt_tokens=512)
    events.first_token(2, key, a.slot, a.generation, 1_300_000)
    events.complete(2, key, a.slot, a.generation, 2_200_000, failed=True)
    events.resync(3, RequestKey.pack(row.row, 2), b.slot, b.generation, 1_100_000,
                  service_us=50_000, decode_us=70_000, decode_tokens=7, prompt_tokens=9)
    SnapshotWriter(seg).publish({
        a.slot: SnapshotRecord(a.generation, 1, 2, 3_000_000, 4_000_000, 5_000_000, 600_000),
        b.slot: SnapshotRecord(b.generation, 0, 0, 6_000_000, 6_000_000, 6_000_000)})
    header.next_round_robin(seg)
    header.next_round_robin(seg)
    header.next_tie_break(seg)
    seg.fetch_add(layout.H_SIDECAR_EPOCH, 3)


def write_affinity_reference(seg: Segment) -> None:
    """Layout 4's addition to write_reference: an affinity row for each instance."""
    affinity = AffinityWriter(seg)
    affinity.publish(0, 2, [Resident(0xAAAA, AFFINITY_KNOWLEDGE, 1000),
                            Resident(0xBBBB, AFFINITY_PREFIX, 64)], capacity_tokens=5000)
    affinity.publish(1, 4, [Resident(0xCCCC, AFFINITY_KNOWLEDGE, 300)], capacity_tokens=0)
    affinity.publish(1, 4, [Resident(0xDDDD, AFFINITY_PREFIX, 64)], capacity_tokens=0)  # replaced


def write_claims_reference(seg: Segment) -> int:
    """Layout 5's addition: a claim of one knowledge id and four prompt blocks on inst-a, and
    the withdrawal of one block; returns the claim's id."""
    claims = ClaimWriter(seg)
    claim = claims.claim(0, 2, [KeyGroup(AFFINITY_KNOWLEDGE, 1000, (0xAAAA,)),
                                KeyGroup(AFFINITY_PREFIX, 64, (0x11, 0x22, 0x33, 0x44))], t_us=7_000_000)
    claims.drop(claim, 0, 2, [KeyGroup(AFFINITY_PREFIX, 64, (0x44,))], t_us=8_000_000)
    return claim


def write_homes_reference(seg: Segment) -> None:
    """Layout 6's addition: two prompts' homes."""
    HomeWriter(seg).publish({0x5151: (1, 4), 0x6262: (0, 2)})


def _zero_the_clock_and_chance(seg: Segment) -> None:
    rows = (seg.geometry.row_offset(0), seg.geometry.row_offset(1))
    published = AFFINITY_ROW_HEADER.offset.published_us
    for offset in (layout.H_CREATION_ID, layout.H_CREATED_AT_NS, layout.H_SNAPSHOT_PUBLISHED_US,
                   *(base + layout.R_HEARTBEAT_NS for base in rows),
                   *(base + layout.R_CLAIMED_AT_NS for base in rows),
                   *(seg.geometry.affinity_row_offset(s) + published for s in range(4)),
                   seg.geometry.homes_offset + HOME_TABLE_HEADER.offset.published_us):
        seg.store(offset, 0)


def _nonzero_words(seg: Segment) -> dict[int, int]:
    words = struct.unpack_from(f"@{seg.geometry.total_size // 8}Q", seg.buf, 0)
    return {8 * i: word for i, word in enumerate(words) if word}


def test_the_new_spelling_writes_the_bytes_the_old_code_wrote(seg) -> None:
    write_reference(seg)
    write_affinity_reference(seg)
    write_claims_reference(seg)
    write_homes_reference(seg)
    _zero_the_clock_and_chance(seg)
    assert _nonzero_words(seg) == golden_segment_v6.WORDS


def test_layout_6_changed_no_word_of_layout_5_but_the_version_and_the_size() -> None:
    v5, v6 = golden_segment_v5.WORDS, golden_segment_v6.WORDS
    end_of_v5 = v5[layout.H_TOTAL_SIZE]
    assert (v5[layout.H_LAYOUT_VERSION], v6[layout.H_LAYOUT_VERSION]) == (5, 6)
    assert v6[layout.H_TOTAL_SIZE] == end_of_v5 + layout.HOME_TABLE_SIZE
    same = {layout.H_LAYOUT_VERSION, layout.H_TOTAL_SIZE}
    assert {o: w for o, w in v6.items() if o < end_of_v5 and o not in same} == \
        {o: w for o, w in v5.items() if o not in same}
    assert min(o for o in v6 if o >= end_of_v5) == end_of_v5  # the home table's seqlock word


def test_layout_5_changed_no_word_of_layout_4_but_the_version_the_size_and_the_claims_cursor() -> None:
    v4, v5 = golden_segment_v4.WORDS, golden_segment_v5.WORDS
    end_of_v4 = v4[layout.H_TOTAL_SIZE]
    assert (v4[layout.H_LAYOUT_VERSION], v5[layout.H_LAYOUT_VERSION]) == (4, 5)
    assert v5[layout.H_TOTAL_SIZE] == end_of_v4 + layout.CLAIM_RING_CAPACITY * layout.CLAIM_SIZE
    assert (layout.H_CLAIMS_CURSOR not in v4, v5[layout.H_CLAIMS_CURSOR]) == (True, 4)
    same = {layout.H_LAYOUT_VERSION, layout.H_TOTAL_SIZE, layout.H_CLAIMS_CURSOR}
    assert {o: w for o, w in v5.items() if o < end_of_v4 and o not in same} == \
        {o: w for o, w in v4.items() if o not in same}
    assert min(o for o in v5 if o >= end_of_v4) == end_of_v4  # the first claim record


def test_layout_4_changed_no_word_of_layout_3_but_the_version_and_the_size() -> None:
    v3, v4 = golden_segment_v3.WORDS, golden_segment_v4.WORDS
    end_of_v3 = v3[layout.H_TOTAL_SIZE]
    assert (v3[layout.H_LAYOUT_VERSION], v4[layout.H_LAYOUT_VERSION]) == (3, 4)
    assert v4[layout.H_TOTAL_SIZE] == end_of_v3 + 4 * layout.AFFINITY_ROW_SIZE
    same = {layout.H_LAYOUT_VERSION, layout.H_TOTAL_SIZE}
    assert {o: w for o, w in v4.items() if o < end_of_v3 and o not in same} == \
        {o: w for o, w in v3.items() if o not in same}
    assert min(o for o in v4 if o >= end_of_v3) == end_of_v3  # the first affinity row


@pytest.mark.parametrize("golden", [golden_segment_v3, golden_segment_v4, golden_segment_v5],
                         ids=["layout 3", "layout 4", "layout 5"])
def test_an_older_layout_is_refused_with_the_remedy(seg, golden) -> None:
    for offset, word in golden.WORDS.items():
        struct.pack_into("@Q", seg.buf, offset, word)
    version = golden.WORDS[layout.H_LAYOUT_VERSION]
    with pytest.raises(SegmentLayoutError,
                       match=f"layout version {version}, but this build uses layout version 6"):
        Segment.attach(seg.name)


def test_an_affinity_row_is_seen_only_under_its_generation_and_reread_when_it_changes(seg) -> None:
    writer, reader = AffinityWriter(seg), AffinityReader(seg)
    assert reader.row(2, 7).knowledge == frozenset()
    writer.publish(2, 7, [Resident(11, AFFINITY_KNOWLEDGE, 100), Resident(12, AFFINITY_PREFIX, 64)], 900)
    row = reader.row(2, 7)
    assert (row.knowledge, row.prefix, row.tokens, row.capacity_tokens, row.engine_fed) == \
        (frozenset({11}), frozenset({12}), 164, 900, False)
    assert reader.row(2, 8).knowledge == frozenset()  # the slot's next instance sees nothing
    assert reader.row(2, 7) is row  # unchanged seqlock word: the cached copy
    writer.publish(2, 7, [Resident(13, AFFINITY_KNOWLEDGE, 5)], 900, engine_fed=True)
    assert (reader.row(2, 7).knowledge, reader.row(2, 7).engine_fed) == (frozenset({13}), True)
    assert writer.read(2)[3] is True  # what a restarted sidecar takes back
    writer.clear(2)
    assert (reader.row(2, 7).knowledge, reader.row(2, 7).engine_fed) == (frozenset(), False)
    assert writer.read(2) == (0, [], 0, False)


def test_an_affinity_row_keeps_the_most_recent_entries_when_there_are_too_many(seg) -> None:
    writer = AffinityWriter(seg)
    writer.publish(0, 1, [Resident(k, AFFINITY_PREFIX, 1) for k in range(1, 600)], 0)
    generation, entries, _, _ = writer.read(0)
    assert (generation, len(entries), entries[0].key, entries[-1].key) == (1, 512, 88, 599)


def test_a_reader_never_takes_a_row_the_writer_is_rewriting(seg) -> None:
    writer, reader = AffinityWriter(seg), AffinityReader(seg)
    writer.publish(0, 1, [Resident(5, AFFINITY_KNOWLEDGE, 1)], 0)
    assert reader.row(0, 1).knowledge == {5}
    base = seg.geometry.affinity_row_offset(0)
    seq = seg.load(base + layout.A_SEQ)
    seg.store(base + layout.A_SEQ, seq + 1)  # a writer stopped half way (odd)
    seg.store(seg.geometry.affinity_entries_offset(0), 99)  # a torn entry
    assert reader.row(0, 1).knowledge == {5}  # the last stable copy
    assert reader.torn_reads == 1


def test_a_segment_of_the_old_code_reads_the_same(seg) -> None:
    seg.buf[:] = bytes(seg.geometry.total_size)
    for offset, word in golden_segment_v6.WORDS.items():
        struct.pack_into("@Q", seg.buf, offset, word)
    old = Segment.attach(seg.name)  # the header validates
    try:
        assert ClaimReader(old).poll() == [
            Claimed(CLAIM_OP_CLAIM, 0, 0, 2, AFFINITY_KNOWLEDGE, 1000, 7_000_000, (0xAAAA,)),
            Claimed(CLAIM_OP_CLAIM, 0, 0, 2, AFFINITY_PREFIX, 64, 7_000_000, (0x11, 0x22, 0x33)),
            Claimed(CLAIM_OP_CLAIM, 0, 0, 2, AFFINITY_PREFIX, 64, 7_000_000, (0x44,)),
            Claimed(CLAIM_OP_DROP, 0, 0, 2, AFFINITY_PREFIX, 64, 8_000_000, (0x44,))]
        assert HomeReader(old).homes() == {0x5151: (1, 4), 0x6262: (0, 2)}
        affinity = AffinityReader(old)
        assert (affinity.row(0, 2).knowledge, affinity.row(0, 2).prefix, affinity.row(0, 2).capacity_tokens) \
            == ({0xAAAA}, {0xBBBB}, 5000)
        assert (affinity.row(1, 4).knowledge, affinity.row(1, 4).prefix) == (set(), {0xDDDD})
        a, b = read_all(old)
        assert (a.slot, a.generation, a.instance_id, a.host, a.port, a.alive, a.registered_at_ms,
                a.qps_1m, a.cp_port, a.max_num_seqs) == \
            (0, 2, "inst-a", "10.0.0.1", 9001, True, 1_000, None, 9101, 8)
        assert (b.slot, b.generation, b.instance_id, b.host, b.alive, b.last_seen_ms, b.qps_1m) == \
            (1, 4, "inst-b", "host-b.example", False, 2_500, 1.5)
        lanes = CountersReader(old).lanes(2)
        assert [CounterWord.count_under(word, a.generation) for word in lanes[:layout.LANES_USED]] == \
            [2, 0, 0, 0, 0]
        assert [CounterWord.count_under(word, b.generation) for word in lanes[layout.LANES_USED:]] == \
            [0, 1, 0, 1, 0]
        idle, worker = read_rows(old)
        assert (idle.pid, idle.row) == (1111, 0)
        assert (worker.row, worker.pid, worker.worker_index, worker.pending_slot,
                worker.ring_tail, worker.ring_head) == (1, 4321, 3, None, 4, 0)
        key = RequestKey.pack(1, 1)
        assert list(EventReader(old).drain(1)) == [
            Event(EventKind.RESERVE, 2, key, 0, 2, 1_000_000, service_us=250_000,
                  decode_us=900_000, decode_tokens=64, prompt_tokens=512),
            Event(EventKind.FIRST_TOKEN, 2, key, 0, 2, 1_300_000),
            Event(EventKind.COMPLETE, 2, key, 0, 2, 2_200_000, failed=True),
            Event(EventKind.RESYNC, 3, RequestKey.pack(1, 2), 1, 4, 1_100_000, service_us=50_000,
                  decode_us=70_000, decode_tokens=7, prompt_tokens=9)]
        snapshots = SnapshotReader(old)
        assert published(snapshots, 0, 2) == SnapshotRecord(2, 1, 2, 3_000_000, 4_000_000, 5_000_000, 600_000)
        assert published(snapshots, 1, 4) == SnapshotRecord(4, 0, 0, 6_000_000, 6_000_000, 6_000_000, 0)
        described = header.describe(old)
        assert (described["sidecar_epoch"], described["directory_seq"], described["sidecar_pid"]) == \
            (3, 10, None)
        assert (header.next_round_robin(old), header.next_tie_break(old)) == (2, 1)
    finally:
        old.close()
