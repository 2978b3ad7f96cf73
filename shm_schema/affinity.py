"""The affinity index: per instance slot, the keys whose KV the instance is believed to hold.

One row per instance slot (layout.py's byte map: AffinityRowHeader, then AFFINITY_ENTRIES
entries), written only by the sidecar, read by every worker with plain loads and no IPC. A
key is a 64-bit hash of a knowledge id or of a block of a prompt prefix; its value says which
(AffinityValue's kind) and how many tokens of KV it stands for.

The writer rewrites a whole row under the row's seqlock word (seqlock.py); a reader copies the
row in one struct call, and decodes it only when its seqlock word changed, so the common case
is one atomic load per candidate.

The row's generation is the slot generation the entries describe: a freed or reused slot's
old entries are invisible to a reader that holds the new generation, whatever the sidecar has
or has not cleared yet.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

from . import layout, seqlock
from .bitfields import AffinityValue
from .records import (AFFINITY_ENTRIES, AFFINITY_ENTRY, AFFINITY_KNOWLEDGE, AFFINITY_PREFIX,
                      AFFINITY_ROW_HEADER)
from .segment import Segment

__all__ = ["AFFINITY_ENTRIES", "AFFINITY_KNOWLEDGE", "AFFINITY_PREFIX", "AffinityReader",
           "AffinityRow", "AffinityWriter", "Resident"]

_ENTRIES = AFFINITY_ENTRY.array(AFFINITY_ENTRIES)
_HEADER = AFFINITY_ROW_HEADER


class Resident(NamedTuple):
    """One entry, decoded."""
    key: int
    kind: int
    tokens: int


class AffinityRow(NamedTuple):
    """A row as a reader sees it: the keys of each kind, and the capacity the sidecar models."""
    generation: int
    seq: int
    knowledge: frozenset[int]
    prefix: frozenset[int]
    tokens: int
    capacity_tokens: int
    published_us: int
    engine_fed: bool  # the prefix keys are the engine's own account, not the workers' guesses


_EMPTY = AffinityRow(0, 0, frozenset(), frozenset(), 0, 0, 0, False)


class AffinityWriter:
    """The sidecar's side: whole rows, least recently used entry first."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def publish(self, slot: int, generation: int, entries: Sequence[Resident],
                capacity_tokens: int, engine_fed: bool = False) -> None:
        """Replace the row of `slot` with `entries` (at most AFFINITY_ENTRIES: the oldest beyond
        that are left out) for the instance of `generation`; `engine_fed`: its prefix entries
        are its engine's own KV events."""
        seg = self._seg
        geometry = seg.geometry
        base = geometry.affinity_row_offset(slot)
        kept = list(entries)[-AFFINITY_ENTRIES:]
        words: list[int] = []
        for entry in kept:
            words += (entry.key, AffinityValue.pack(entry.kind, entry.tokens))
        words += (0,) * (2 * AFFINITY_ENTRIES - len(words))

        def rewrite(odd: int) -> None:
            _ENTRIES.pack_into(seg.buf, geometry.affinity_entries_offset(slot), *words)
            _HEADER.pack_into(seg.buf, base, _HEADER.make((
                generation, odd, len(kept), sum(e.tokens for e in kept), capacity_tokens,
                time.time_ns() // 1000, int(engine_fed))))
        seqlock.write(seg, base + layout.A_SEQ, rewrite)

    def clear(self, slot: int) -> None:
        """Nothing is resident in `slot` (its instance left)."""
        self.publish(slot, 0, (), 0)

    def read(self, slot: int) -> tuple[int, list[Resident], int, bool]:
        """What the row holds now, for a restarted sidecar: (generation, entries oldest first,
        capacity_tokens, engine_fed). The sidecar is the only writer, so no seqlock check is
        needed."""
        seg = self._seg
        geometry = seg.geometry
        header = _HEADER.unpack_from(seg.buf, geometry.affinity_row_offset(slot))
        words = _ENTRIES.unpack_from(seg.buf, geometry.affinity_entries_offset(slot))
        count = min(header.count, AFFINITY_ENTRIES)
        entries = [Resident(words[2 * i], AffinityValue.kind(words[2 * i + 1]),
                            AffinityValue.tokens(words[2 * i + 1])) for i in range(count)]
        return header.generation, entries, header.capacity_tokens, bool(header.engine_fed)


class AffinityReader:
    """A worker's cached view of every row: decoded again only when a row's seqlock moved."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._rows: dict[int, AffinityRow] = {}
        self.torn_reads = 0  # reads that overlapped a write too often and kept the old copy

    def row(self, slot: int, generation: int) -> AffinityRow:
        """The keys resident on the instance of (`slot`, `generation`); empty if the row
        describes another generation (or nothing)."""
        seg = self._seg
        base = seg.geometry.affinity_row_offset(slot)
        cached = self._rows.get(slot)
        seq = seg.load(base + layout.A_SEQ)
        if cached is None or cached.seq != seq:
            cached = self._decode(slot, base, seq, cached)
        return cached if cached.generation == generation else _EMPTY

    def _decode(self, slot: int, base: int, seq: int, cached: AffinityRow | None) -> AffinityRow:
        seg = self._seg
        entries_at = seg.geometry.affinity_entries_offset(slot)

        def copy(stable: int) -> AffinityRow:
            # Only the entries the header counts: an engine's row changes at every step it
            # reports, and most choices copy it anew (all AFFINITY_ENTRIES slots: ~20 % more).
            header = _HEADER.unpack_from(seg.buf, base)
            count = min(header[_HEADER.index.count], AFFINITY_ENTRIES)
            return _decoded(header, AFFINITY_ENTRY.array(count).unpack_from(seg.buf, entries_at), count, stable)
        row = seqlock.read(seg, base + layout.A_SEQ, seq, copy)
        if row is None:
            self.torn_reads += 1
            return cached if cached is not None else _EMPTY
        self._rows[slot] = row
        return row


def _decoded(header: tuple, words: tuple[int, ...], count: int, seq: int) -> AffinityRow:
    knowledge, prefix = [], []
    shift = AffinityValue.KIND_SHIFT
    for i in range(count):
        kind = words[2 * i + 1] >> shift
        (knowledge if kind == AFFINITY_KNOWLEDGE else prefix).append(words[2 * i])
    return AffinityRow(header[_HEADER.index.generation], seq, frozenset(knowledge),
                       frozenset(prefix), header[_HEADER.index.tokens],
                       header[_HEADER.index.capacity_tokens], header[_HEADER.index.published_us],
                       bool(header[_HEADER.index.engine_fed]))
