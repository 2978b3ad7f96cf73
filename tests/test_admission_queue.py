"""The per-instance admission queue of a worker (proxy_workers/admission.py): waiters are admitted
in arrival order, a release wakes one waiter (not all of them), a waiter that leaves hands the
turn on, and only the head polls for releases made by other workers."""

from __future__ import annotations

import asyncio

import uvloop

from proxy_workers.admission import AdmissionQueue
from shm_schema import Admission


class Gate:
    """A host-wide counter stand-in: `free` slots, and how often each waiter asked."""

    def __init__(self) -> None:
        self.free = 0
        self.asks: dict[str, int] = {}

    def try_admit(self, who: str):  # type: ignore[no-untyped-def]
        def attempt() -> Admission:
            self.asks[who] = self.asks.get(who, 0) + 1
            if self.free > 0:
                self.free -= 1
                return Admission.ADMITTED
            return Admission.FULL
        return attempt


def run(coro):  # type: ignore[no-untyped-def]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(asyncio.wait_for(coro, 20))


def test_fifo_one_wake_per_release_and_only_the_head_polls():
    async def main():
        queue, gate, order = AdmissionQueue(), Gate(), []

        async def waiter(name: str) -> None:
            assert await queue.wait(gate.try_admit(name)) is Admission.ADMITTED
            order.append(name)

        tasks = [asyncio.create_task(waiter(n)) for n in "abcd"]
        await asyncio.sleep(0.1)  # nothing free: the head polls, the others sleep
        assert gate.asks.get("a", 0) >= 3 and all(gate.asks.get(n, 0) == 0 for n in "bcd"), gate.asks
        for expected in ("a", "b", "c", "d"):
            gate.free += 1
            queue.wake()  # a local release
            await asyncio.sleep(0.02)
            assert order[-1] == expected, order
        await asyncio.gather(*tasks)

    run(main())


def test_a_cancelled_head_hands_over_and_a_stale_result_ends_the_wait():
    async def main():
        queue, gate = AdmissionQueue(), Gate()
        first = asyncio.create_task(queue.wait(gate.try_admit("a")))
        second = asyncio.create_task(queue.wait(gate.try_admit("b")))
        await asyncio.sleep(0.02)
        first.cancel()
        await asyncio.sleep(0.02)
        gate.free += 1  # released by another worker: only polling sees it
        assert await asyncio.wait_for(second, 1) is Admission.ADMITTED
        stale = asyncio.create_task(queue.wait(lambda: Admission.STALE))
        assert await asyncio.wait_for(stale, 1) is Admission.STALE
        assert not queue._waiters

    run(main())
