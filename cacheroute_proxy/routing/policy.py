"""What an instance selection policy is: one class a policy, one module a class (round_robin,
least_load, kv_aware), each found by its name through the registry, each behind `choose`.

A worker's router hands `choose` the load view, the directory snapshot and the candidates
(the snapshot's alive instances, or fewer: those this worker ejected, or a request already
failed on, left out) and, for kv_aware, the request; the policy reads what it needs and
returns a `Choice`. Rotation cursors are injected: in a worker they are fetch-adds on the
shared header, so N workers rotate like one process.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

from shm_schema import DirectorySnapshot, InstanceSlot

from .load_view import LoadView

Cursor = Callable[[], int]
# Load components of a candidate list, aligned with it: {"inflight": [3, 0, None], ...};
# None is unknown, never zero.
Components = Mapping[str, Sequence[float | None]]


class Choice(NamedTuple):
    """What a selection found about the instance it chose."""
    instance: InstanceSlot
    # What the instance holds of the request, and what the request would cost there (the
    # worker's pricing: kv_aware's, or the prepare stage's look at the wanted knowledge).
    affinity: Any = None
    prediction: Any = None  # kv_aware: its kv_aware.Prediction there
    guard: Any = None       # kv_aware: the balance guard's kv_aware.Guard


class Policy(Protocol):
    name: str

    def choose(self, view: LoadView, snapshot: DirectorySnapshot,
               candidates: tuple[InstanceSlot, ...], request: Any = None) -> Choice:
        """One of `candidates` (never empty): `snapshot.alive` itself, or a part of it."""
        ...


def local_cursor() -> Cursor:
    """A rotation of this process alone (a unit test, the per_worker ablation)."""
    return itertools.count().__next__
