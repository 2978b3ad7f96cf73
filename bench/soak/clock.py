"""Soak time: seconds since the load started, the moment the load ends, and a sleep that
wakes early when it does."""

from __future__ import annotations

import asyncio
import contextlib
import time


class SoakClock:
    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self.t0 = 0.0                  # monotonic start of the load
        self.t0_wall = time.time()     # the same moment by the wall clock (psutil's create_time is)
        self.load_end = 0.0            # monotonic end of the load
        self.stopping = asyncio.Event()  # set once every client has finished

    def start(self) -> None:
        """The load starts now (inside the event loop)."""
        self.stopping = asyncio.Event()
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.load_end = self.t0 + self.duration_s

    def now(self) -> float:
        return time.monotonic() - self.t0

    def load_running(self) -> bool:
        return time.monotonic() < self.load_end

    async def sleep_until(self, t: float) -> bool:
        """Sleep until soak time t; False if the load ended first."""
        delay = t - self.now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
        return not self.stopping.is_set()
