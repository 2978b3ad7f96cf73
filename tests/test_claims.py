"""The claims ring (shm_schema/claims.py): every worker appends, every worker reads, over the real
segment; records cut short, lapped or written by several processes at once."""

from __future__ import annotations


import pytest

from shm_schema import Segment, layout
from shm_schema.claims import HOLE_WAIT_US, ClaimReader, Claimed, ClaimWriter, KeyGroup, Lead, LeadParts
from shm_schema.bitfields import ClaimValue, SlotGeneration
from shm_schema.records import (AFFINITY_KNOWLEDGE, AFFINITY_PREFIX, CLAIM, CLAIM_OP_CLAIM, CLAIM_OP_DROP,
                                CLAIM_OP_LEAD)
from tests.shm_helpers import SPAWN, fresh_segment


@pytest.fixture
def seg():
    with fresh_segment(4, 2) as segment:
        yield segment


def prefix(*keys: int) -> list[KeyGroup]:
    return [KeyGroup(AFFINITY_PREFIX, 128, keys)]


def test_a_claim_and_its_drop_reach_a_reader_in_order_and_only_once(seg) -> None:
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    claim = writer.claim(1, 3, [KeyGroup(AFFINITY_KNOWLEDGE, 500, (7,)), *prefix(1, 2, 3, 4)], t_us=10)
    writer.drop(claim, 1, 3, prefix(4), t_us=20)
    assert reader.poll() == [
        Claimed(CLAIM_OP_CLAIM, claim, 1, 3, AFFINITY_KNOWLEDGE, 500, 10, (7,)),
        Claimed(CLAIM_OP_CLAIM, claim, 1, 3, AFFINITY_PREFIX, 128, 10, (1, 2, 3)),
        Claimed(CLAIM_OP_CLAIM, claim, 1, 3, AFFINITY_PREFIX, 128, 10, (4,)),
        Claimed(CLAIM_OP_DROP, claim, 1, 3, AFFINITY_PREFIX, 128, 20, (4,))]
    assert reader.poll() == []
    assert writer.claim(0, 1, []) == -1 and reader.poll() == []  # nothing to claim: no record


def leads_in(records: list[Claimed]) -> list[Lead]:
    parts = LeadParts()
    return [lead for record in records if record.op == CLAIM_OP_LEAD
            for lead in [parts.take(record)] if lead is not None]


def test_a_lead_spans_records_between_claims_and_is_put_back_together_whole(seg) -> None:
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    writer.claim(1, 3, prefix(1), t_us=10)
    writer.lead(0xABC, 9, tuple(range(101, 108)), t_us=11)  # 7 keys: 3 records
    writer.claim(1, 3, prefix(2), t_us=12)
    writer.lead(0xDEF, 1, (5,), t_us=13)
    records = reader.poll()
    assert [r.op for r in records] == [CLAIM_OP_CLAIM, *[CLAIM_OP_LEAD] * 3, CLAIM_OP_CLAIM, CLAIM_OP_LEAD]
    assert leads_in(records) == [Lead(0xABC, 9, tuple(range(101, 108))), Lead(0xDEF, 1, (5,))]
    writer.lead(0x123, 4, ())  # no keys: nothing written
    assert reader.poll() == []


def test_a_lead_with_a_record_missing_is_never_given(seg) -> None:
    """A writer killed inside a LEAD leaves a hole among its parts: the parts around it are
    passed over, and the next LEAD is whole again."""
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    first = seg.fetch_add(layout.H_CLAIMS_CURSOR, 3)
    value = ClaimValue.pack(CLAIM_OP_LEAD, AFFINITY_PREFIX, 7)
    for part in (0, 2):  # part 1 never published
        writer._write(first + part, 0xABC, SlotGeneration.pack(part, 3), value, 1, (part + 1,) * 3)
    writer.lead(0xDEF, 7, (1, 2, 3, 4))
    records = reader.poll(now_us=1_000) + reader.poll(now_us=1_000 + HOLE_WAIT_US + 1)
    assert leads_in(records) == [Lead(0xDEF, 7, (1, 2, 3, 4))] and reader.holes == 1


def test_a_new_reader_starts_a_lap_back_so_a_restarted_worker_sees_the_standing_claims(seg) -> None:
    writer = ClaimWriter(seg)
    for key in range(1, 6):
        writer.claim(0, 1, prefix(key))
    assert [c.keys for c in ClaimReader(seg).poll()] == [(1,), (2,), (3,), (4,), (5,)]


def test_a_reserved_record_not_published_yet_is_read_once_it_is(seg) -> None:
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    # A writer between its fetch_add and its last store: the position is reserved, seq not set.
    position = seg.fetch_add(layout.H_CLAIMS_CURSOR, 1)
    writer.claim(2, 5, prefix(9))  # a later writer finished first
    assert [c.keys for c in reader.poll(now_us=1_000)] == [(9,)]
    # The slow writer publishes: the record's words, seq last.
    base = seg.geometry.claim_offset(position)
    CLAIM.struct.pack_into(seg.buf, base, 0, position, SlotGeneration.pack(2, 5),
                           ClaimValue.pack(CLAIM_OP_CLAIM, AFFINITY_PREFIX, 128), 77, 8, 0, 0)
    seg.store(base + layout.C_SEQ, position + 1)
    assert reader.poll(now_us=2_000) == [Claimed(CLAIM_OP_CLAIM, position, 2, 5, AFFINITY_PREFIX, 128, 77, (8,))]
    assert (reader.holes, reader.lapped) == (0, 0)


def test_a_writer_killed_between_reserve_and_publish_leaves_a_hole_that_is_passed_over(seg) -> None:
    reader = ClaimReader(seg)
    seg.fetch_add(layout.H_CLAIMS_CURSOR, 1)  # reserved, never published
    ClaimWriter(seg).claim(0, 1, prefix(3))
    assert [c.keys for c in reader.poll(now_us=0)] == [(3,)]
    assert reader.poll(now_us=HOLE_WAIT_US // 2) == [] and reader.holes == 0  # still waited for
    assert reader.poll(now_us=HOLE_WAIT_US + 1) == [] and reader.holes == 1
    assert reader.poll(now_us=10 * HOLE_WAIT_US) == []  # and forgotten


def test_records_the_writers_lapped_are_counted_not_misread(seg) -> None:
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    total = layout.CLAIM_RING_CAPACITY + 10
    for key in range(1, total + 1):
        writer.claim(0, 1, prefix(key))
    found = reader.poll()
    assert [c.keys[0] for c in found] == list(range(11, total + 1))  # the last lap, in order
    assert reader.lapped == 10


def test_a_record_rewritten_while_it_is_copied_is_not_taken(seg) -> None:
    writer, reader = ClaimWriter(seg), ClaimReader(seg)
    writer.claim(0, 1, prefix(5))
    base = seg.geometry.claim_offset(0)
    seg.store(base + layout.C_SEQ, 0)  # the next lap's writer has begun on it
    assert reader.poll(now_us=0) == []  # not whole: looked at again later...
    seg.store(base + layout.C_SEQ, layout.CLAIM_RING_CAPACITY + 1)  # ...and now it is a later lap's
    assert reader.poll(now_us=1) == [] and reader.lapped == 1


def _append(name: str, writer_index: int, count: int) -> None:
    seg = Segment.attach(name)
    try:
        writer = ClaimWriter(seg)
        for i in range(count):
            writer.claim(writer_index, 1, prefix(writer_index * 100_000 + i + 1, i + 1))
    finally:
        seg.close()


def test_workers_appending_at_once_each_see_every_record_exactly_once(seg) -> None:
    """Four processes append 400 two-key claims each (one record a claim) while this one reads:
    no record is lost, torn or read twice, and each writer's come in its own order."""
    writers, count = 4, 400
    reader = ClaimReader(seg)
    processes = [SPAWN.Process(target=_append, args=(seg.name, w, count)) for w in range(writers)]
    for process in processes:
        process.start()
    seen: list[Claimed] = []
    while any(p.is_alive() for p in processes) or len(seen) < writers * count:
        seen += reader.poll()
        if not any(p.is_alive() for p in processes) and len(seen) < writers * count:
            seen += reader.poll()
            break
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    seen += reader.poll()
    assert len(seen) == writers * count and reader.lapped == reader.holes == 0
    for w in range(writers):
        mine = [c for c in seen if c.slot == w]
        assert [c.keys for c in mine] == [(w * 100_000 + i + 1, i + 1) for i in range(count)]
