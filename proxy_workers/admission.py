"""Ready admission within one worker: its requests waiting for one instance, in arrival order.

The limit itself is host-wide (a counter in the instance's slot, shm_schema.Admission); this
queue only decides which of this worker's waiters asks next, and when.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from shm_schema import Admission

# How often the head waiter looks at the host-wide count, in turn, the last one from then on. A
# local release wakes it at once; another worker's, only where that worker can ring its bell
# (admission_bell.py): then the polls are a guard and back off; else they are how it is seen.
POLL_S = (0.001, 0.002, 0.005)
POLL_S_WITH_BELLS = (0.001, 0.005, 0.025, 0.1)


class _Waiter:
    __slots__ = ("wake",)

    def __init__(self, wake: asyncio.Future[None]) -> None:
        self.wake = wake


class AdmissionQueue:
    """This worker's requests waiting for ready admission to one instance, in arrival order.

    Only the head polls the host-wide counter (another worker's release is seen only by
    polling); a local release wakes the head, and a waiter that is admitted (or gives up) wakes
    the next, so each release costs one wake-up however many wait -- not one per waiter.
    The others also re-check every SAFETY_POLL_S, a guard only: no wake-up is lost, since
    one that leaves (admitted, refused, cancelled) always wakes the next."""

    SAFETY_POLL_S = 0.5

    def __init__(self, poll_s: tuple[float, ...] = POLL_S) -> None:
        self._waiters: deque[_Waiter] = deque()
        self._poll_s = poll_s
        self.tries = 0  # try_admit calls while waiting: what the waiting cost

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        """Someone waits: a new arrival queues behind them instead of taking a freed slot."""
        return bool(self._waiters)

    def wake(self) -> None:
        if self._waiters:
            resolve(self._waiters[0].wake)

    async def wait(self, try_admit: Callable[[], Admission]) -> Admission:
        """Wait until `try_admit()` is not FULL; its last result."""
        loop = asyncio.get_running_loop()
        me = _Waiter(loop.create_future())
        waiters = self._waiters
        waiters.append(me)
        attempt = 0
        try:
            while True:
                if waiters[0] is me:
                    delay = self._poll_s[min(attempt, len(self._poll_s) - 1)]
                    attempt += 1
                else:
                    delay = self.SAFETY_POLL_S
                timer = loop.call_later(delay, resolve, me.wake)
                try:
                    await me.wake
                finally:
                    timer.cancel()
                self.tries += 1
                result = try_admit()
                if result is not Admission.FULL:
                    return result
                me.wake = loop.create_future()
        finally:
            if waiters[0] is me:
                waiters.popleft()
            else:
                waiters.remove(me)
            self.wake()  # the next may be admitted too, or must take over polling


def resolve(future: asyncio.Future[None]) -> None:
    """Wake whoever awaits `future`, once (a timer and a release may both try)."""
    if not future.done():
        future.set_result(None)
