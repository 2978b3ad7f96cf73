"""The bit-packed words: which bits of one 64-bit word of the segment hold what.

Each format is one small class of static methods (pack, and one reader per field) and the
shift and mask constants they use. The hot paths (WorkerRow._update, EventWriter) inline the
constants instead of calling the methods, but take them from here, so every spelling of a
format is this module's. Nothing here touches memory: a word in, fields out, or back.
"""

from __future__ import annotations

import math
import struct
import sys


def _low_bits(count: int) -> int:
    return (1 << count) - 1


class CounterWord:
    """A counter lane of a slot, or a worker's share of one: generation << 32 | count.

    The generation is the slot's (see the directory); an update carrying another generation
    is refused, so a stale lease cannot change the count of the instance that reused the slot.
    """

    GENERATION_SHIFT = 32
    COUNT_MASK = _low_bits(GENERATION_SHIFT)
    MAX_GENERATION = _low_bits(64 - GENERATION_SHIFT)
    # The word's two native 32-bit halves in memory order (the shift is exactly 32): a reader
    # that loads one half gets the field without masking (the C selector of least_load, through
    # CountersReader.count_offset / generation_offset).
    HALVES = ("count", "generation") if sys.byteorder == "little" else ("generation", "count")

    @staticmethod
    def pack(generation: int, count: int) -> int:
        return ((generation & CounterWord.MAX_GENERATION) << CounterWord.GENERATION_SHIFT) | (
            count & CounterWord.COUNT_MASK)

    @staticmethod
    def generation(word: int) -> int:
        return word >> CounterWord.GENERATION_SHIFT

    @staticmethod
    def count(word: int) -> int:
        return word & CounterWord.COUNT_MASK

    @staticmethod
    def count_under(word: int, generation: int) -> int | None:
        """The count if the word carries `generation`, else None (the slot was reused)."""
        if word >> CounterWord.GENERATION_SHIFT != generation:
            return None
        return word & CounterWord.COUNT_MASK


class JournalWord:
    """A worker row's journal: op sequence << 24 | lane << 17 | END_BIT | (slot + 1) while an
    update is half done, op sequence << 24 between operations (slot part 0)."""

    SEQUENCE_SHIFT = 24
    LANE_SHIFT = 17
    LANE_MASK = _low_bits(SEQUENCE_SHIFT - LANE_SHIFT)
    END_BIT = 1 << 16
    SLOT_MASK = _low_bits(16)  # slot + 1: the instance capacity is at most 4096

    @staticmethod
    def idle(op_sequence: int) -> int:
        """Between operations: only the sequence."""
        return op_sequence << JournalWord.SEQUENCE_SHIFT

    @staticmethod
    def pending(op_sequence: int, slot: int, lane: int, is_end: bool) -> int:
        """An update of (slot, lane) is under way; `is_end` for a decrement."""
        return ((op_sequence << JournalWord.SEQUENCE_SHIFT) | (lane << JournalWord.LANE_SHIFT)
                | (JournalWord.END_BIT if is_end else 0) | (slot + 1))

    @staticmethod
    def pending_slot(journal: int) -> int | None:
        """The slot of a half-done update, or None when the row is between operations."""
        slot_plus_one = journal & JournalWord.SLOT_MASK
        return None if slot_plus_one == 0 else slot_plus_one - 1

    @staticmethod
    def pending_lane(journal: int) -> int:
        return (journal >> JournalWord.LANE_SHIFT) & JournalWord.LANE_MASK

    @staticmethod
    def pending_is_end(journal: int) -> bool:
        return bool(journal & JournalWord.END_BIT) and JournalWord.pending_slot(journal) is not None


class RequestKey:
    """A request's key in the event channel: row << 48 | sequence, unique on the host while
    the worker holds its row (the sidecar drops a departed row's requests by row)."""

    ROW_SHIFT = 48
    SEQUENCE_MASK = _low_bits(ROW_SHIFT)

    @staticmethod
    def pack(row: int, sequence: int) -> int:
        return (row << RequestKey.ROW_SHIFT) | (sequence & RequestKey.SEQUENCE_MASK)

    @staticmethod
    def row(key: int) -> int:
        return key >> RequestKey.ROW_SHIFT

    @staticmethod
    def sequence(key: int) -> int:
        return key & RequestKey.SEQUENCE_MASK


class ProcessIdentity:
    """A process named so that a reused pid is never mistaken for the dead one:
    start_ticks << 22 | pid (Linux pid_max is at most 2**22)."""

    PID_BITS = 22
    PID_MASK = _low_bits(PID_BITS)

    @staticmethod
    def pack(pid: int, start_ticks: int) -> int:
        return (start_ticks << ProcessIdentity.PID_BITS) | (pid & ProcessIdentity.PID_MASK)

    @staticmethod
    def pid(identity: int) -> int:
        return identity & ProcessIdentity.PID_MASK

    @staticmethod
    def unpack(identity: int) -> tuple[int, int]:
        """(pid, start_ticks)."""
        return identity & ProcessIdentity.PID_MASK, identity >> ProcessIdentity.PID_BITS


class EventTag:
    """An event's first word: kind | epoch << 8 (kind is an EventKind, epoch the sidecar
    epoch the event was written under)."""

    EPOCH_SHIFT = 8
    KIND_MASK = _low_bits(EPOCH_SHIFT)

    @staticmethod
    def pack(kind: int, epoch: int) -> int:
        return (kind & EventTag.KIND_MASK) | (epoch << EventTag.EPOCH_SHIFT)

    @staticmethod
    def kind(tag: int) -> int:
        return tag & EventTag.KIND_MASK

    @staticmethod
    def epoch(tag: int) -> int:
        return tag >> EventTag.EPOCH_SHIFT


class SlotGeneration:
    """Which instance an event is about: slot << 32 | generation."""

    SLOT_SHIFT = 32
    GENERATION_MASK = _low_bits(SLOT_SHIFT)

    @staticmethod
    def pack(slot: int, generation: int) -> int:
        return (slot << SlotGeneration.SLOT_SHIFT) | (generation & SlotGeneration.GENERATION_MASK)

    @staticmethod
    def slot(word: int) -> int:
        return word >> SlotGeneration.SLOT_SHIFT

    @staticmethod
    def generation(word: int) -> int:
        return word & SlotGeneration.GENERATION_MASK

    @staticmethod
    def unpack(word: int) -> tuple[int, int]:
        """(slot, generation)."""
        return word >> SlotGeneration.SLOT_SHIFT, word & SlotGeneration.GENERATION_MASK


class OptionalFloatWord:
    """A float stored as its IEEE-754 double bits; NaN means unknown (None)."""

    _DOUBLE = struct.Struct("@d")
    _WORD = struct.Struct("@Q")

    @staticmethod
    def pack(value: float | None) -> int:
        double = math.nan if value is None else float(value)
        return OptionalFloatWord._WORD.unpack(OptionalFloatWord._DOUBLE.pack(double))[0]

    @staticmethod
    def unpack(word: int) -> float | None:
        value = OptionalFloatWord._DOUBLE.unpack(OptionalFloatWord._WORD.pack(word))[0]
        return None if math.isnan(value) else value


class AffinityValue:
    """The second word of an affinity entry: kind << 32 | tokens. The kind says what the key
    hashes (AFFINITY_KNOWLEDGE: a knowledge id; AFFINITY_PREFIX: a block of a prompt prefix);
    the tokens are how much KV the entry stands for in the sidecar's capacity model."""

    KIND_SHIFT = 32
    TOKENS_MASK = _low_bits(KIND_SHIFT)

    @staticmethod
    def pack(kind: int, tokens: int) -> int:
        return (kind << AffinityValue.KIND_SHIFT) | min(max(0, tokens), AffinityValue.TOKENS_MASK)

    @staticmethod
    def kind(word: int) -> int:
        return word >> AffinityValue.KIND_SHIFT

    @staticmethod
    def tokens(word: int) -> int:
        return word & AffinityValue.TOKENS_MASK


class ClaimValue:
    """A claim record's value word: op << 48 | AffinityValue (kind << 32 | tokens each). The op
    is CLAIM_OP_CLAIM, CLAIM_OP_DROP or CLAIM_OP_LEAD (records)."""

    OP_SHIFT = 48
    AFFINITY_MASK = _low_bits(OP_SHIFT)

    @staticmethod
    def pack(op: int, kind: int, tokens: int) -> int:
        return (op << ClaimValue.OP_SHIFT) | AffinityValue.pack(kind, tokens)

    @staticmethod
    def op(word: int) -> int:
        return word >> ClaimValue.OP_SHIFT

    @staticmethod
    def kind(word: int) -> int:
        return AffinityValue.kind(word & ClaimValue.AFFINITY_MASK)

    @staticmethod
    def tokens(word: int) -> int:
        return AffinityValue.tokens(word)

