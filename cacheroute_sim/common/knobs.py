"""Run-time knobs: a frozen Struct per simulator, replaced whole through ``POST /sim/config``.

Generic over the Knobs type: each simulator declares its own fields and checks by subclassing
:class:`KnobsBase`; validation, partial updates and the store are the same code for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Self, TypeVar

import msgspec

from cacheroute_sim.common.validation import struct_from_mapping


class KnobsBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of a simulator's Knobs, declared ``class Knobs(KnobsBase, frozen=True)`` (msgspec
    inherits the options; type checkers want frozen spelt again). forbid_unknown_fields: a
    misspelt knob in a test is an error, not a silently ignored key."""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def updated(self, patch: Mapping[str, Any]) -> Self:
        """A copy with ``patch`` applied (JSON partial update); explicit nulls clear a knob."""
        return knobs_from_mapping(type(self), {**self.to_dict(), **patch})


K = TypeVar("K", bound=KnobsBase)


def knobs_from_mapping(cls: type[K], raw: Mapping[str, Any]) -> K:
    # strict=True: JSON "true" strings or 1 for a bool are typos here, not intent (ints still
    # fill float knobs).
    return struct_from_mapping(cls, raw, strict=True)


class KnobStore(Generic[K]):
    """The current knobs; replaced as a whole so a request sees one consistent snapshot."""

    def __init__(self, initial: K) -> None:
        self._initial = initial
        self.current = initial

    def update(self, patch: Mapping[str, Any]) -> K:
        self.current = self.current.updated(patch)
        return self.current

    def reset(self) -> K:
        """Back to the knobs given at start (so tests sharing one simulator start clean)."""
        self.current = self._initial
        return self.current
