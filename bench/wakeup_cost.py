"""What waking up costs a process that sleeps between polls, as the sidecar does every
PROXY_EVENT_POLL_MS (`python -m bench.wakeup_cost`).

An empty loop `while True: await asyncio.sleep(interval)` on uvloop, nothing else in the
process, for `--seconds` per interval; the CPU time the kernel charges the process per wake-up
(user + system, time.process_time). What it measures is the floor of any poller on this
machine, not the product's code: the sidecar's tick adds its own work to it. Then the same
for the processes of an idle proxy (2 workers over 2 simulated instances, nothing sent): the
CPU its sidecar and each worker are charged per second while they only poll.

Read it with the kernel's accounting in mind: with CONFIG_TICK_CPU_ACCOUNTING (this
machine's; `zcat /proc/config.gz`), a process is charged the whole scheduler tick it is found
running at, and a process woken by its own timer is found running more often than its time
on the CPU alone would make it. Every contender of `make bench-peers` is charged the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import uvloop

from bench.backends import InstanceSpec, SimInstances
from bench.contenders import ProxyContender, proxy_role
from bench.machine import process_tree

INTERVALS_MS = (1.0, 5.0, 20.0, 50.0)


async def _one(interval_s: float, seconds: float) -> tuple[int, float]:
    wakeups = 0

    async def poll() -> None:
        nonlocal wakeups
        while True:
            wakeups += 1
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(poll())
    started = time.process_time()
    await asyncio.sleep(seconds)
    cpu = time.process_time() - started
    task.cancel()
    return wakeups, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per interval")
    args = parser.parse_args(argv)
    print(f"{'interval':>9} {'wake-ups/s':>11} {'CPU ms/s':>9} {'µs/wake-up':>11}")
    for interval_ms in INTERVALS_MS:
        wakeups, cpu = uvloop.run(_one(interval_ms / 1000, args.seconds))
        print(f"{interval_ms:>7g}ms {wakeups / args.seconds:>11.0f} {cpu / args.seconds * 1000:>9.1f} "
              f"{cpu / max(1, wakeups) * 1e6:>11.0f}")
    idle_proxy(args.seconds)
    return 0


def idle_proxy(seconds: float) -> None:
    with SimInstances([InstanceSpec(), InstanceSpec()]) as instances, \
            ProxyContender("idle", instances, 2, "least_load") as proxy:
        time.sleep(2.0)  # past the start-up
        roots = set(proxy.pids())
        processes = [p for p in process_tree(proxy.pids()) if proxy_role(p, roots) != "launcher"]
        before = {p.pid: sum(p.cpu_times()[:2]) for p in processes}
        time.sleep(seconds)
        print(f"an idle proxy, over {seconds:g} s:")
        for p in processes:
            used = sum(p.cpu_times()[:2]) - before[p.pid]
            print(f"  {proxy_role(p, roots):<8} pid {p.pid}: {used / seconds * 1000:5.1f} ms CPU/s")


if __name__ == "__main__":
    sys.exit(main())
