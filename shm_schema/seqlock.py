"""One writer, many readers, no lock: the seqlock word before a region the sidecar rewrites
whole (an affinity row, the prompt-home table).

The writer makes the word odd, rewrites the region, makes it even again. A reader loads the
word, copies the region and loads the word again: an odd or moved word means a write
overlapped, and the reader tries again a few times, then gives up (it never spins on a writer
that was descheduled or killed) and keeps what it had.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from .segment import Segment

T = TypeVar("T")
READ_TRIES = 4


def write(seg: Segment, seq_offset: int, rewrite: Callable[[int], None]) -> None:
    """Run `rewrite(odd_seq)` between making the word odd and making it even again."""
    seq = seg.load(seq_offset)
    odd = seq | 1
    seg.store(seq_offset, odd)  # odd: writing (an odd word left by a killed writer stays odd)
    rewrite(odd)
    seg.store(seq_offset, odd + 1)  # even again: stable


def read(seg: Segment, seq_offset: int, seq: int, copy: Callable[[int], T]) -> T | None:
    """`copy(seq)` of the region, taken while the word stood even and unchanged, starting from
    the `seq` the caller loaded; None if writes kept overlapping."""
    for _ in range(READ_TRIES):
        if seq % 2 == 0:
            copied = copy(seq)
            again = seg.load(seq_offset)
            if again == seq:
                return copied
            seq = again
        else:
            time.sleep(0)  # let the writer finish
            seq = seg.load(seq_offset)
    return None
