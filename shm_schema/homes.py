"""The prompt-home table: the instance kv_aware treats as holding each shared prompt, as the
sidecar places them to balance the instances' work, and the instance a prompt seen nowhere yet
goes to (`next_home`).

One table for the host (layout.py's byte map: HomeTableHeader, then HOME_ENTRIES entries),
written whole by the sidecar under its seqlock word (seqlock.py), read by every worker with
one atomic load when nothing changed; next_home is one word of its own, stored and loaded
atomically. An entry names its instance by slot and generation, so a freed or reused slot's
entries name nobody a worker can choose.
"""

from __future__ import annotations

import time
from typing import Mapping

from . import layout, seqlock
from .bitfields import SlotGeneration
from .records import HOME_ENTRIES, HOME_ENTRY, HOME_TABLE_HEADER
from .segment import Segment

__all__ = ["HOME_ENTRIES", "HomeReader", "HomeWriter"]

_ENTRIES = HOME_ENTRY.array(HOME_ENTRIES)
_HEADER = HOME_TABLE_HEADER

Homes = Mapping[int, tuple[int, int]]  # prompt key -> (slot, generation)


class HomeWriter:
    """The sidecar's side."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def publish(self, homes: Homes) -> None:
        """Replace the table with `homes` (at most HOME_ENTRIES; keys of 0 are left out)."""
        seg = self._seg
        kept = [(key, SlotGeneration.pack(slot, generation))
                for key, (slot, generation) in homes.items() if key][:HOME_ENTRIES]
        words = [word for entry in kept for word in entry]
        words += (0,) * (2 * HOME_ENTRIES - len(words))
        base = seg.geometry.homes_offset

        def rewrite(odd: int) -> None:
            _ENTRIES.pack_into(seg.buf, seg.geometry.home_entries_offset(), *words)
            _HEADER.pack_into(seg.buf, base, _HEADER.make((
                odd, len(kept), time.time_ns() // 1000, seg.load(base + layout.HT_NEXT_HOME))))
        seqlock.write(seg, base + layout.HT_SEQ, rewrite)

    def set_next_home(self, where: tuple[int, int] | None) -> None:
        """Name the instance (slot, generation) a prompt held nowhere goes to; None: nobody."""
        self._seg.store(self._seg.geometry.homes_offset + layout.HT_NEXT_HOME,
                        0 if where is None else SlotGeneration.pack(*where))

    def read(self) -> dict[int, tuple[int, int]]:
        """The table as it stands, for a restarted sidecar (the only writer: no seqlock check)."""
        seg = self._seg
        header = _HEADER.unpack_from(seg.buf, seg.geometry.homes_offset)
        return _decoded(header.count, _ENTRIES.unpack_from(seg.buf, seg.geometry.home_entries_offset()))


class HomeReader:
    """A worker's copy of the table, decoded again only when its seqlock word moved."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._seq = -1
        self._homes: dict[int, tuple[int, int]] = {}
        self.torn_reads = 0  # reads that overlapped a write too often and kept the old copy

    def homes(self) -> dict[int, tuple[int, int]]:
        seg = self._seg
        at = seg.geometry.homes_offset + layout.HT_SEQ
        seq = seg.load(at)
        if seq != self._seq:
            base, entries_at = seg.geometry.homes_offset, seg.geometry.home_entries_offset()
            copied = seqlock.read(seg, at, seq, lambda stable: (stable, _decoded(
                _HEADER.unpack_from(seg.buf, base).count, _ENTRIES.unpack_from(seg.buf, entries_at))))
            if copied is None:
                self.torn_reads += 1
            else:
                self._seq, self._homes = copied
        return self._homes

    def home_of(self, key: int) -> tuple[int, int] | None:
        """(slot, generation) of the prompt's published home; None if the table does not list it."""
        return self.homes().get(key)

    def next_home(self) -> tuple[int, int] | None:
        """(slot, generation) of the instance a prompt held nowhere goes to; None if none is named."""
        packed = self._seg.load(self._seg.geometry.homes_offset + layout.HT_NEXT_HOME)
        return SlotGeneration.unpack(packed) if packed else None


def _decoded(count: int, words: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    homes = {}
    for i in range(min(count, HOME_ENTRIES)):
        homes[words[2 * i]] = SlotGeneration.unpack(words[2 * i + 1])
    return homes
