"""What a selection sees: the alive candidates and their load components, read from the
shared table with plain loads (no lock, no syscall, no IPC).

`shared` reads the host-wide inflight words. `per_worker` reads only this worker's own
contributions, which is what N independent copies of the original Proxy would see; it exists
to measure what sharing buys.
"""

from __future__ import annotations

from operator import itemgetter, sub
from typing import Callable, NamedTuple, Protocol, Sequence

from shm_schema import DirectoryReader, DirectorySnapshot, InflightReader, InstanceSlot, Segment, WorkerRow

GEN_SHIFT = 32
COUNT_MASK = (1 << 32) - 1

SOURCES = {
    "shared": {"inflight": "shared_table_inflight", "qps_1m": "instance_heartbeat"},
    "per_worker": {"inflight": "worker_local_counter", "qps_1m": "instance_heartbeat"},
}


class SlotRef(Protocol):
    """Anything naming a slot under a generation (InstanceSlot, the sidecar's records)."""

    @property
    def slot(self) -> int: ...

    @property
    def generation(self) -> int: ...


class _CandidateKeys(NamedTuple):
    """What the hot path needs of a directory snapshot's candidates, computed once per snapshot."""

    snapshot: DirectorySnapshot
    pick: Callable[[Sequence[int]], tuple[int, ...]]  # the candidates' words, in one C call
    generations: tuple[int, ...]
    bases: tuple[int, ...]  # generation << 32: word - base is the count when the slot is current
    qps_1m: list[float | None]


def _picker(slots: list[int]) -> Callable[[Sequence[int]], tuple[int, ...]]:
    if len(slots) == 1:
        only = slots[0]
        return lambda words: (words[only],)
    return itemgetter(*slots)  # type: ignore[return-value]


class LoadView:
    def __init__(self, seg: Segment, mode: str = "shared", own_row: WorkerRow | None = None) -> None:
        if mode == "per_worker" and own_row is None:
            raise ValueError("the per_worker view needs the worker's own row")
        self.mode = mode
        self.directory = DirectoryReader(seg)
        self._inflight = InflightReader(seg)
        self._own_row = own_row
        self.sources = SOURCES[mode]
        self._keys: _CandidateKeys | None = None

    def candidates(self) -> tuple[InstanceSlot, ...]:
        return self.directory.snapshot().alive

    def words(self, span: int) -> Sequence[int]:
        if self.mode == "shared" or self._own_row is None:
            return self._inflight.words(span)
        return self._own_row.own_words(span)

    def inflight(self, instances: Sequence[SlotRef], span: int | None = None) -> list[int | None]:
        """Inflight per instance. In the shared view, None if the slot has been reused since
        the directory snapshot (unknown, not zero); in the per-worker view a share of another
        generation is this worker's 0."""
        if not instances:
            return []
        words = self.words(span or 1 + max(s.slot for s in instances))
        if self.mode == "per_worker":
            return [words[i.slot] & COUNT_MASK if words[i.slot] >> GEN_SHIFT == i.generation else 0
                    for i in instances]
        return [words[i.slot] & COUNT_MASK if words[i.slot] >> GEN_SHIFT == i.generation else None
                for i in instances]

    def candidate_components(self, snapshot: DirectorySnapshot,
                             names: frozenset[str]) -> dict[str, list[float | None]]:
        """The selection path: components of `snapshot.alive`, only those in `names`."""
        keys = self._keys
        if keys is None or keys.snapshot is not snapshot:
            alive = snapshot.alive
            keys = self._keys = _CandidateKeys(snapshot, _picker([i.slot for i in alive]),
                                               tuple(i.generation for i in alive),
                                               tuple(i.generation << GEN_SHIFT for i in alive),
                                               [i.qps_1m for i in alive])
        components: dict[str, list[float | None]] = {}
        if "inflight" in names:
            picked = keys.pick(self.words(snapshot.slot_span))
            counts: list[int | None] = list(map(sub, picked, keys.bases))
            # Common case in three C-level passes: every slot still carries its generation.
            if min(counts) < 0 or max(counts) > COUNT_MASK:  # type: ignore[type-var]
                unknown = 0 if self.mode == "per_worker" else None
                counts = [w & COUNT_MASK if w >> GEN_SHIFT == g else unknown
                          for w, g in zip(picked, keys.generations)]
            components["inflight"] = counts  # type: ignore[assignment]
        if "qps_1m" in names:
            components["qps_1m"] = keys.qps_1m
        return components

    def components(self, instances: Sequence[InstanceSlot],
                   span: int | None = None) -> dict[str, list[float | None]]:
        return {
            "inflight": self.inflight(instances, span),  # type: ignore[dict-item]
            "qps_1m": [inst.qps_1m for inst in instances],
        }
