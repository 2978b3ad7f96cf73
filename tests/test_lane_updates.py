"""The counter-lane update in C (shm_schema/_lanes.c) against the Python closures it replaces
(WorkerRow._update): the same random operations on two segments, one row on each path, must
return the same results and leave the same words (lanes, shares, journal) after every step.
Also: the build made it, and a closed segment's ops fail instead of touching unmapped memory."""

from __future__ import annotations

import random

import pytest

from shm_schema import DirectoryWriter, WorkerRow, layout, read_all
from shm_schema.bitfields import JournalWord
from shm_schema.counters import NATIVE_UPDATES, Admission
from tests.shm_helpers import count_of, fresh_segment, share_of

SLOTS = 4


def test_the_install_built_the_c_update():
    """`make install` compiles it (gcc is part of this project's machine); without a compiler
    the pure-Python path still works, but this test says so."""
    assert NATIVE_UPDATES


def _words(seg, row: WorkerRow) -> list[int]:
    geometry = seg.geometry
    lanes = [seg.load(geometry.counter_offset(slot, lane))
             for slot in range(SLOTS) for lane in range(layout.LANES_USED)]
    shares = [seg.load(geometry.contributions_base(row.row) + layout.WORD * (layout.LANES * slot + lane))
              for slot in range(SLOTS) for lane in range(layout.LANES_USED)]
    return lanes + shares + [seg.load(geometry.row_offset(row.row) + layout.R_JOURNAL)]


def _operations(rng: random.Random, generations: dict[int, int], count: int):
    for _ in range(count):
        slot = rng.randrange(SLOTS)
        generation = generations[slot] + (1 if rng.random() < 0.05 else 0)  # now and then stale
        lane = rng.randrange(layout.LANES_USED)
        kind = rng.choice(("begin", "end", "add", "remove", "admit", "admit", "remove_limited"))
        yield kind, lane, slot, generation, rng.randint(0, 4)


def _apply(row: WorkerRow, kind: str, lane: int, slot: int, generation: int, limit: int):
    if kind == "begin":
        return row.begin(slot, generation)
    if kind == "end":
        return row.end(slot, generation)
    if kind == "add":
        return row.add(lane, slot, generation)
    if kind == "remove":
        return row.remove(lane, slot, generation)
    if kind == "remove_limited":  # a decrement told a limit: refused above it, as an increment
        return row._removes[lane](slot, generation, limit)
    return row.try_admit(lane, slot, generation, limit)


@pytest.mark.parametrize("seed", range(12))
def test_c_and_python_updates_agree_word_for_word(seed):
    rng = random.Random(seed)
    with fresh_segment(SLOTS, 2) as native_seg, fresh_segment(SLOTS, 2) as python_seg:
        for seg in (native_seg, python_seg):
            writer = DirectoryWriter(seg)
            for slot in range(SLOTS):
                writer.allocate(f"i{slot}", "127.0.0.1", 9000 + slot)
        generations = _generations(native_seg)
        assert generations == _generations(python_seg)
        native, python = WorkerRow.claim(native_seg, 0), WorkerRow.claim(python_seg, 0)
        python._bind_updates(native=False)
        for step, op in enumerate(_operations(rng, generations, 400)):
            got, expected = _apply(native, *op), _apply(python, *op)
            assert got == expected and type(got) is type(expected), (step, op)
            assert _words(native_seg, native) == _words(python_seg, python), (step, op)
        assert native.own_words(SLOTS) == python.own_words(SLOTS)
        journal = _words(native_seg, native)[-1]
        assert JournalWord.pending_slot(journal) is None  # between operations
        assert journal == JournalWord.idle(400)  # one sequence number an operation


def _generations(seg) -> dict[int, int]:
    return {instance.slot: instance.generation for instance in read_all(seg)}


def test_a_row_that_changes_path_carries_its_journal_sequence_and_shares_over():
    with fresh_segment(SLOTS, 2) as seg:
        slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9000)
        row = WorkerRow.claim(seg, 0)
        journal = seg.geometry.row_offset(row.row) + layout.R_JOURNAL
        for native in (True, False, True, False):  # two begins a path, then one end
            row._bind_updates(native=native)
            assert row.begin(slot.slot, slot.generation) and row.begin(slot.slot, slot.generation)
            assert row.end(slot.slot, slot.generation)
        assert seg.load(journal) == JournalWord.idle(12)
        assert count_of(seg, slot.slot) == 4 and share_of(seg, row.row, slot.slot, slot.generation) == 4
        row._bind_updates(native=True)
        for _ in range(4):
            assert row.end(slot.slot, slot.generation)
        assert count_of(seg, slot.slot) == 0 and share_of(seg, row.row, slot.slot, slot.generation) == 0


def test_try_admit_answers_with_the_admission_members():
    with fresh_segment(SLOTS, 2) as seg:
        slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9000)
        row = WorkerRow.claim(seg, 0)
        lane = layout.LANE_READY_ACTIVE
        assert row.try_admit(lane, slot.slot, slot.generation, 1) is Admission.ADMITTED
        assert row.try_admit(lane, slot.slot, slot.generation, 1) is Admission.FULL
        assert row.try_admit(lane, slot.slot, slot.generation + 1, 1) is Admission.STALE


def test_a_closed_segment_refuses_the_update_instead_of_touching_unmapped_memory():
    with fresh_segment(SLOTS, 2) as seg:
        slot = DirectoryWriter(seg).allocate("a", "127.0.0.1", 9000)
        row = WorkerRow.claim(seg, 0)
        assert row.begin(slot.slot, slot.generation)
        seg.close()  # releases the updater's hold on the buffer first, or close would fail
        with pytest.raises(ValueError, match="closed"):
            row.end(slot.slot, slot.generation)


def test_a_slot_outside_the_segment_is_an_index_error():
    with fresh_segment(SLOTS, 2) as seg:
        row = WorkerRow.claim(seg, 0)
        with pytest.raises(IndexError):
            row.begin(seg.geometry.instance_capacity + 10 ** 6, 0)
        with pytest.raises(IndexError):
            row.begin(-1, 0)
