"""The event-ring write in C (shm_schema/_ring.c) against its Python twin (events.PythonRing):
the same random events, the sidecar consuming now and then and sleeping now and then, on two
segments, one writer on each path, must answer the same, ring the same and leave the same
words (the row's ring, tail and head) after every step; both behind the writer that the
sidecar's reader reads. Also: the build made it, and a closed segment's writes fail instead of
touching unmapped memory."""

from __future__ import annotations

import contextlib
import random

import pytest

from shm_schema import Segment, header, layout
from shm_schema.events import NATIVE_RING, EventReader, EventWriter
from shm_schema.records import EVENT
from tests.shm_helpers import fresh_segment

RING = 64  # records: small, so the writers fill it and wrap around


def test_the_install_built_the_c_ring_write():
    """`make install` compiles it (gcc is part of this project's machine); without a compiler
    the Python twin still works, but this test says so."""
    assert NATIVE_RING


def _segment() -> contextlib.AbstractContextManager[Segment]:
    return fresh_segment(4, 2, ring_capacity=RING)


def _words(seg: Segment) -> tuple[int, ...]:
    """Row 0's ring and its tail and head words."""
    geometry = seg.geometry
    base = geometry.row_offset(0)
    ring = geometry.ring_offset(0)
    records = bytes(seg.buf[ring:ring + EVENT.size * RING])
    return (seg.load(base + layout.R_RING_TAIL), seg.load(base + layout.R_RING_HEAD),
            hash(records))


def _write(writer: EventWriter, rng: random.Random, key: int) -> bool:
    slot, generation, t_us = rng.randrange(4), rng.randrange(1, 9), rng.randrange(1 << 50)
    kind = rng.choice(("reserve", "first_token", "complete", "prefix"))
    if kind == "reserve":
        return writer.reserve(3, key, slot, generation, t_us, rng.randrange(1 << 40), rng.randrange(1 << 40),
                              rng.randrange(4096), rng.randrange(1 << 20))
    if kind == "first_token":
        return writer.first_token(3, key, slot, generation, t_us)
    if kind == "complete":
        return writer.complete(3, key, slot, generation, t_us, rng.random() < 0.2)
    keys = tuple(rng.randrange(1 << 64) for _ in range(rng.randint(1, 3)))
    return writer.prefix(3, slot, generation, t_us, keys, 16, rng.randrange(64))


@pytest.mark.parametrize("seed", range(8))
def test_c_and_python_ring_writes_agree_word_for_word(seed):
    rng = random.Random(seed)
    with _segment() as native_seg, _segment() as python_seg:
        rings: dict[str, list[int]] = {"native": [], "python": []}
        native = EventWriter(native_seg, 0, spill_limit=40, wake=lambda: rings["native"].append(1),
                             native=True)
        python = EventWriter(python_seg, 0, spill_limit=40, wake=lambda: rings["python"].append(1),
                             native=False)
        readers = EventReader(native_seg), EventReader(python_seg)
        for step in range(600):
            if rng.random() < 0.03:  # the sidecar takes some of what is there, slower than it comes
                limit = rng.randrange(1, RING // 2)
                taken = [reader.take(0, limit) for reader in readers]
                assert taken[0] == taken[1], step
            if rng.random() < 0.05:
                sleeping = rng.random() < 0.5
                for seg in (native_seg, python_seg):
                    header.set_sidecar_sleeping(seg, sleeping)
            if rng.random() < 0.05:
                assert native.flush() == python.flush(), step
            state = rng.getstate()
            got = _write(native, rng, step)
            rng.setstate(state)
            assert got == _write(python, rng, step), step
            assert _words(native_seg) == _words(python_seg), step
            assert (native.written, native.dropped, native.spilled) == \
                   (python.written, python.dropped, python.spilled), step
            assert rings["native"] == rings["python"], step
        assert native.written > RING and native.dropped > 0  # it wrapped, and it was full
        assert rings["native"]  # and it rang


def test_a_closed_segment_refuses_the_write():
    with _segment() as seg:
        writer = EventWriter(seg, 0, native=True)
        assert writer.complete(1, 1, 0, 1, 5, False)
        seg.close()
        with pytest.raises(ValueError, match="closed"):
            writer.complete(1, 2, 0, 1, 6, False)


def test_a_record_of_the_wrong_shape_is_refused():
    from shm_schema._ring import RingWriter
    with _segment() as seg:
        geometry = seg.geometry
        base = geometry.row_offset(0)
        ring = RingWriter(seg.buf, base + layout.R_RING_TAIL, base + layout.R_RING_HEAD,
                          layout.H_SIDECAR_SLEEPING, geometry.ring_offset(0), RING, 8)
        try:
            with pytest.raises(TypeError):
                ring.put((1, 2, 3))
            with pytest.raises(OverflowError):
                ring.put((-1, 0, 0, 0, 0, 0, 0, 0))
            assert ring.written == 0 and seg.load(base + layout.R_RING_TAIL) == 0
            with pytest.raises(ValueError, match="outside"):
                RingWriter(seg.buf, base, base, 0, len(seg.buf) - EVENT.size, RING, 8)
        finally:
            ring.close()
