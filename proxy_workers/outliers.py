"""Passive outlier ejection, per worker: an instance that fails N requests in a row is left
out of this worker's candidate set for a while, then tried again (a success clears it).

Failures are what the client did not cause: connection refused or reset before a response,
no response head in time, a 5xx from the instance. If every candidate is ejected, none is:
trying a suspect instance beats answering 503 to everyone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

Key = tuple[int, int]  # (slot, generation)
_NONE: frozenset[Key] = frozenset()


@dataclass
class _Health:
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0


class OutlierTracker:
    def __init__(self, failures_to_eject: int, eject_s: float) -> None:
        self.threshold = failures_to_eject
        self.eject_s = eject_s
        self._health: dict[Key, _Health] = {}
        self._latest_ejection_end = 0.0  # past it, nothing is ejected: the hot path's early out

    def failed(self, key: Key, now: float | None = None) -> bool:
        """Count a failure; True if it ejected the instance."""
        if self.threshold <= 0:
            return False
        health = self._health.setdefault(key, _Health())
        health.consecutive_failures += 1
        if health.consecutive_failures >= self.threshold:
            health.consecutive_failures = 0
            health.ejected_until = (time.monotonic() if now is None else now) + self.eject_s
            health.ejections += 1
            self._latest_ejection_end = max(self._latest_ejection_end, health.ejected_until)
            return True
        return False

    def succeeded(self, key: Key) -> None:
        health = self._health.get(key)
        if health is not None:
            health.consecutive_failures = 0
            health.ejected_until = 0.0

    def ejected(self, now: float | None = None) -> frozenset[Key]:
        """Runs on every selection: one comparison when nothing was ever ejected, a clock read
        when no ejection is in force any more."""
        if not self._latest_ejection_end:
            return _NONE
        now = time.monotonic() if now is None else now
        if now >= self._latest_ejection_end:
            return _NONE
        return frozenset(k for k, h in self._health.items() if h.ejected_until > now)

    def describe(self) -> dict[str, dict[str, float | int]]:
        now = time.monotonic()
        return {f"{slot}:{gen}": {"consecutive_failures": h.consecutive_failures,
                                  "ejected_for_s": round(max(0.0, h.ejected_until - now), 1),
                                  "ejections": h.ejections}
                for (slot, gen), h in self._health.items()}
