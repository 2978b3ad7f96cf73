"""KV transfers KDN -> Redis, one FIFO link per Redis target.

The original KDN copies a request's KV blocks into the Redis the Instance names; two copies to
the same Redis share that path, so the second waits for the first (the Proxy's IWS models the
same link as busy until ``link_free``). Each target (``host:port``) gets an ``asyncio.Lock``,
which wakes waiters in arrival order; different targets transfer in parallel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec

from cacheroute_sim.kdn.stats import Stats


class LinkStats(msgspec.Struct, kw_only=True):
    transfers: int = 0     # completed transfers on this link since the last stats reset
    bytes: int = 0
    active: int = 0        # 0 or 1: a transfer is on the wire now
    queued: int = 0        # transfers waiting behind it


class Links:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._locks: dict[str, asyncio.Lock] = {}
        self._link_stats: dict[str, LinkStats] = {}

    @staticmethod
    def key(redis_host: str, redis_port: int) -> str:
        return f"{redis_host}:{redis_port}"

    @asynccontextmanager
    async def transfer(self, target: str, nbytes: int) -> AsyncIterator[None]:
        """Hold ``target``'s link for the body of the ``async with`` (the transfer)."""
        lock = self._locks.setdefault(target, asyncio.Lock())
        link = self._link_stats.setdefault(target, LinkStats())
        stats = self.stats
        link.queued += 1
        stats.queued_transfers += 1
        try:
            await lock.acquire()
        finally:
            link.queued -= 1
            stats.queued_transfers -= 1
        link.active += 1
        stats.active_transfers += 1
        stats.max_active_transfers = max(stats.max_active_transfers, stats.active_transfers)
        try:
            yield
            link.transfers += 1
            link.bytes += nbytes
        finally:
            link.active -= 1
            stats.active_transfers -= 1
            lock.release()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {target: msgspec.structs.asdict(s) for target, s in self._link_stats.items()}

    def reset(self) -> None:
        """Forget idle links; a busy one keeps its gauges, its totals restart at 0."""
        for target, s in list(self._link_stats.items()):
            if s.active == s.queued == 0:
                del self._link_stats[target]
            else:
                s.transfers = s.bytes = 0
