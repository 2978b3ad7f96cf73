"""The claims ring: routing decisions that keys will be resident on an instance, seen by every
worker at once.

The affinity index (affinity.py) has one writer, the sidecar, which learns of residency from
events a tick after it happens. A routing decision is known the moment it is made, and a second
request for the same knowledge or prompt that another worker routes in between must see it:
so the deciding worker appends a CLAIM to this ring, every worker reads the ring before it
scores, and the claim stands until the index confirms the keys, the worker withdraws it with a
DROP (the request failed, the inject was refused, or what it made resident is left to the index
a moment later) or it lapses (the readers' TTL).

One ring for the host, written by every worker without a lock: a writer reserves its records
with one fetch_add on the header's claims cursor and publishes each by storing its `seq` (ring
position + 1) last, after clearing it first, so a reader that copied a record between two equal
`seq` loads holds a whole one (the affinity row's seqlock, one record at a time). Readers follow
the cursor; the byte map is layout.py's.

The ring also carries LEADs: the block keys of a chat's leading messages (a system prompt), by a
hash of their text, from the worker that tokenized them to every other, which then routes such
a chat without tokenizing it (`LeadParts` puts a LEAD's records back together).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

from . import layout
from .bitfields import ClaimValue, SlotGeneration
from .records import AFFINITY_PREFIX, CLAIM, CLAIM_KEYS, CLAIM_OP_CLAIM, CLAIM_OP_DROP, CLAIM_OP_LEAD
from .segment import Segment

__all__ = ["CLAIM_OP_CLAIM", "CLAIM_OP_DROP", "CLAIM_OP_LEAD", "ClaimReader", "ClaimWriter", "Claimed",
           "KeyGroup", "Lead", "LeadParts"]

# How long a reserved record may stay unpublished before readers pass over it: a writer is
# between its fetch_add and its last store for microseconds, unless it was descheduled or killed.
HOLE_WAIT_US = 1_000_000


class KeyGroup(NamedTuple):
    """Keys of one kind (records.AFFINITY_KNOWLEDGE or AFFINITY_PREFIX), each standing for
    `tokens_each` tokens of KV."""
    kind: int
    tokens_each: int
    keys: tuple[int, ...]


class Claimed(NamedTuple):
    """One record, decoded."""
    op: int
    claim: int
    slot: int
    generation: int
    kind: int
    tokens_each: int
    t_us: int
    keys: tuple[int, ...]


def _records_for(groups: Sequence[KeyGroup]) -> int:
    return sum(-(-len(group.keys) // CLAIM_KEYS) for group in groups)


class ClaimWriter:
    """A worker's side: appends CLAIMs and DROPs."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def claim(self, slot: int, generation: int, groups: Sequence[KeyGroup],
              t_us: int | None = None) -> int:
        """The keys of `groups` will be resident on (slot, generation); returns the claim's id
        (-1 if there was no key)."""
        return self._append(CLAIM_OP_CLAIM, None, slot, generation, groups, t_us)

    def drop(self, claim: int, slot: int, generation: int, groups: Sequence[KeyGroup],
             t_us: int | None = None) -> None:
        """Withdraw `claim` for the keys of `groups` (all of the claim's, or some)."""
        self._append(CLAIM_OP_DROP, claim, slot, generation, groups, t_us)

    def lead(self, lead: int, blocks: int, keys: Sequence[int], t_us: int | None = None) -> None:
        """The block keys of the leading messages hashed `lead`, which fill `blocks` full blocks."""
        parts = -(-len(keys) // CLAIM_KEYS)
        if not parts:
            return
        first = self._seg.fetch_add(layout.H_CLAIMS_CURSOR, parts)
        value = ClaimValue.pack(CLAIM_OP_LEAD, AFFINITY_PREFIX, blocks)
        when = time.time_ns() // 1000 if t_us is None else t_us
        for part in range(parts):
            self._write(first + part, lead, SlotGeneration.pack(part, parts), value, when,
                        keys[part * CLAIM_KEYS:(part + 1) * CLAIM_KEYS])

    def _append(self, op: int, claim: int | None, slot: int, generation: int,
                groups: Sequence[KeyGroup], t_us: int | None) -> int:
        count = _records_for(groups)
        if not count:
            return -1
        first = self._seg.fetch_add(layout.H_CLAIMS_CURSOR, count)
        claim_id = first if claim is None else claim
        where = SlotGeneration.pack(slot, generation)
        when = time.time_ns() // 1000 if t_us is None else t_us
        position = first
        for group in groups:
            value = ClaimValue.pack(op, group.kind, group.tokens_each)
            keys = group.keys
            for start in range(0, len(keys), CLAIM_KEYS):
                self._write(position, claim_id, where, value, when, keys[start:start + CLAIM_KEYS])
                position += 1
        return claim_id

    def _write(self, position: int, claim: int, where: int, value: int, when: int,
               keys: Sequence[int]) -> None:
        seg = self._seg
        base = seg.geometry.claim_offset(position)
        seg.store(base + layout.C_SEQ, 0)  # not whole: readers of the last lap let go
        CLAIM.struct.pack_into(seg.buf, base, 0, claim, where, value, when,
                               *keys, *(0,) * (CLAIM_KEYS - len(keys)))
        seg.store(base + layout.C_SEQ, position + 1)


class ClaimReader:
    """A worker's side: every record published since the last `poll`, in ring order.

    A new reader starts a lap back, so a restarted worker learns of the claims still standing.
    `lapped` counts records the writers overwrote before this reader got to them, `holes`
    the reserved positions passed over unpublished."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        cursor = seg.load(layout.H_CLAIMS_CURSOR)
        self._next = max(0, cursor - layout.CLAIM_RING_CAPACITY)
        self._waiting: dict[int, int] = {}  # reserved but not yet published: position -> first seen (us)
        self.lapped = 0
        self.holes = 0

    def poll(self, now_us: int | None = None) -> list[Claimed]:
        seg = self._seg
        cursor = seg.load(layout.H_CLAIMS_CURSOR)
        start = self._next
        if cursor == start and not self._waiting:
            return []
        oldest = cursor - layout.CLAIM_RING_CAPACITY
        if start < oldest:
            self.lapped += oldest - start
            start = oldest
        now = time.time_ns() // 1000 if now_us is None else now_us
        found: list[Claimed] = []
        for position in [*self._waiting, *range(start, cursor)]:
            record = self._read(position) if position >= oldest else _GONE
            if record is None:  # reserved, not published yet: look again next time
                self._waiting.setdefault(position, now)
                if now - self._waiting[position] > HOLE_WAIT_US:
                    del self._waiting[position]
                    self.holes += 1
                continue
            self._waiting.pop(position, None)
            if record is _GONE:
                self.lapped += 1
            else:
                found.append(record)
        self._next = cursor
        return found

    def _read(self, position: int) -> Claimed | None:
        """The record at `position`; None if it is not published yet, _GONE if a later lap
        has taken its place (or was taking it while this copied it)."""
        seg = self._seg
        base = seg.geometry.claim_offset(position)
        expected = position + 1
        seq = seg.load(base + layout.C_SEQ)
        if seq != expected:
            return _GONE if seq > expected else None
        fields = CLAIM.struct.unpack_from(seg.buf, base)
        if seg.load(base + layout.C_SEQ) != expected:
            return _GONE
        _, claim, where, value, t_us, *keys = fields
        return Claimed(ClaimValue.op(value), claim, SlotGeneration.slot(where),
                       SlotGeneration.generation(where), ClaimValue.kind(value),
                       ClaimValue.tokens(value), t_us, tuple(k for k in keys if k))


_GONE = Claimed(0, 0, 0, 0, 0, 0, 0, ())


class Lead(NamedTuple):
    """A LEAD put back together: the leading messages' hash, the full blocks they fill, and the
    keys of those blocks a worker routes on."""
    lead: int
    blocks: int
    keys: tuple[int, ...]


class LeadParts:
    """Puts the records of LEADs (ClaimReader's, in ring order) back together. A LEAD with a
    record missing (lapped, or a hole left by a writer that died) is never given: its parts
    are consecutive in the ring, so a part out of turn drops what was gathered."""

    def __init__(self) -> None:
        self._lead = 0
        self._keys: list[int] = []

    def take(self, record: Claimed) -> Lead | None:
        """The LEAD `record` completes, if it does."""
        part, parts = record.slot, record.generation  # what a LEAD packs in slot_generation
        if part == 0:
            self._lead, self._keys = record.claim, []
        elif record.claim != self._lead or len(self._keys) != part * CLAIM_KEYS:
            self._lead, self._keys = 0, []
            return None
        self._keys += record.keys
        if part + 1 < parts:
            return None
        lead, keys = self._lead, tuple(self._keys)
        self._lead, self._keys = 0, []
        return Lead(lead, record.tokens_each, keys)
