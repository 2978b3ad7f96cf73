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


def test_a_bell_rings_every_other_claimed_row_and_says_when_others_wait() -> None:
    """Row 0 frees a place of slot s: rows 1 and 2 (claimed) hear s, row 0 does not ring
    itself; `others_wait` is true only while the host-wide queue holds more than one's own."""
    from proxy_workers.admission_bell import AdmissionBells
    from shm_schema import DirectoryWriter, WorkerRow, layout, read_all
    from tests.shm_helpers import fresh_segment

    async def scenario(seg) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
        rows = [WorkerRow.claim(seg, i, identity=1000 + i) for i in range(3)]
        bells = [AdmissionBells(seg, row.row) for row in rows]
        heard: dict[int, list[int]] = {row.row: [] for row in rows}
        for row, bell in zip(rows, bells):
            bell.listen(heard[row.row].append)
        instance = read_all(seg)[0]
        assert not bells[0].others_wait(instance, 0)
        rows[1].add(layout.LANE_READY_WAITING, instance.slot, instance.generation)
        assert bells[0].others_wait(instance, 0) and not bells[1].others_wait(instance, 1)
        bells[0].ring_others(instance.slot)
        for _ in range(100):
            await asyncio.sleep(0.001)
            if heard[1] and heard[2]:
                break
        for bell in bells:
            bell.close()
        return heard

    with fresh_segment(instance_capacity=4, worker_capacity=4) as seg:
        DirectoryWriter(seg).allocate("a", "127.0.0.1", 9001)
        slot = read_all(seg)[0].slot
        assert uvloop.run(scenario(seg)) == {0: [], 1: [slot], 2: [slot]}
