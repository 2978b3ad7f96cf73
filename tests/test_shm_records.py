"""shm_schema's declarations: each record and bit-packed word round-trips, sits where layout.py's
byte map says, and spells exactly the words the layout has always stored."""

from __future__ import annotations

import os
import re
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from shm_schema import layout
from shm_schema.bitfields import (CounterWord, EventTag, JournalWord, OptionalFloatWord,
                                  ProcessIdentity, RequestKey, SlotGeneration)
from shm_schema.records import (COUNTER_LANES, EVENT, HEADER, ROW_HEADER, SLOT, SNAPSHOT,
                                EventKind, Record, SnapshotRecord)

# No example database, and hypothesis's cache out of the (shared) checkout, as in test_fuzz.py.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"cacheroute-hypothesis-{os.getuid()}")
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
U64 = st.integers(0, (1 << 64) - 1)
RECORDS = {"HeaderWords": HEADER, "CounterLanes": COUNTER_LANES, "SlotRecord": SLOT,
           "SnapshotRecord": SNAPSHOT, "RowHeader": ROW_HEADER, "EventRecord": EVENT}


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
                                  "EventRecord"])
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
    assert layout.LAYOUT_VERSION == 3
    assert (HEADER.size, COUNTER_LANES.size, SLOT.size, SNAPSHOT.size, ROW_HEADER.size,
            EVENT.size) == (256, 64, 320, 64, 128, 64)
    assert (layout.LANES, layout.LANES_USED, layout.MAX_ID_BYTES, layout.MAX_HOST_BYTES) == (8, 5, 112, 64)
    assert layout.Geometry(4, 2, 8).total_size == 4096
    assert layout.Geometry(256, 64).total_size == 5_382_400  # the defaults, as before


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
    assert eval(CounterWord.generation_source("w"), {"w": word}) == generation
    assert eval(CounterWord.count_source("w"), {"w": word}) == count


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
