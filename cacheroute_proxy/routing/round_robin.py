"""round_robin (the default; aliases `rr`, `round-robin`): the candidates in turn, on one cursor
that every worker of the host advances, so N workers rotate like one process. Reads no load."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

from shm_schema import DirectorySnapshot, InstanceSlot

from .load_view import LoadView
from .policy import Choice, Components, Cursor, local_cursor

T = TypeVar("T")


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, cursor: Cursor | None = None) -> None:
        self._next = cursor or local_cursor()

    def select(self, candidates: Sequence[T], components: Components | None = None) -> T:
        if not candidates:
            raise RuntimeError("no instances")
        return candidates[self._next() % len(candidates)]

    def choose(self, view: LoadView, snapshot: DirectorySnapshot,
               candidates: tuple[InstanceSlot, ...], request: Any = None) -> Choice:
        return Choice(self.select(candidates))
