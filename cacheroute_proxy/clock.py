"""Wall-clock integers as the trace, the events and the snapshot carry them.

Wall clock, not monotonic: these times cross processes (worker -> sidecar -> every worker) and
are compared by readers against their own clock."""

from __future__ import annotations

import time


def now_ms() -> int:
    return int(time.time() * 1000)


def now_us() -> int:
    return time.time_ns() // 1000  # (cheaper than int(time.time() * 1e6), and exact)
