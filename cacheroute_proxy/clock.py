"""Wall-clock integers as the trace, the events and the snapshot carry them.

Wall clock, not monotonic: these times cross processes (worker -> sidecar -> every worker) and
are compared by readers against their own clock."""

from __future__ import annotations

from time import time_ns


def now_ms() -> int:
    return time_ns() // 1_000_000  # (cheaper than int(time.time() * 1000), and exact)


def now_us() -> int:
    return time_ns() // 1000
