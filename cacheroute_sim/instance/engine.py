"""The simulated GPU: what a request waits for, and for how long.

A vLLM instance admits a bounded number of sequences, runs one prefill at a time and decodes
all admitted sequences together, each step getting slower as the batch grows. The engine
reproduces exactly those three contention points with an asyncio.Semaphore (slots, FIFO),
an asyncio.Lock (prefill, FIFO) and a counter (decode batch size feeding the ITL model).
Every wait is cancellable, and every resource is released in a ``finally``, so a request
cancelled because its client disconnected gives back its slot at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from cacheroute_sim.common.gate import ReleaseGate
from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.instance import timing
from cacheroute_sim.instance.config import Knobs
from cacheroute_sim.instance.stats import Stats


class Engine:
    def __init__(self, *, time_scale: float, max_concurrency: int,
                 knobs: KnobStore[Knobs]) -> None:
        self.time_scale = time_scale
        self.knobs = knobs
        self.stats = Stats()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._prefill_lock = asyncio.Lock()
        self._gate = ReleaseGate(self.stats)  # counts waiters in stats.held

    async def sleep_ms(self, real_ms: float) -> None:
        # slow_factor is read live so a slowdown set mid-stream applies to the next token.
        scale = self.time_scale * self.knobs.current.slow_factor
        await asyncio.sleep(max(0.0, real_ms * scale) / 1000.0)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of max_concurrency admissions; waiters queue FIFO (TTFT inflation)."""
        stats = self.stats
        stats.queued += 1
        try:
            await self._slots.acquire()
        finally:
            stats.queued -= 1
        stats.active += 1
        stats.max_active = max(stats.max_active, stats.active)
        try:
            yield
        finally:
            stats.active -= 1
            self._slots.release()

    async def prefill(self, tokens: int, kv_prefix_tokens: int | None = None) -> None:
        # One prefill at a time: long prompts delay the first token of everyone behind them.
        # A KV prefix hit (pulled from Redis by the model runner) runs under the same lock.
        async with self._prefill_lock:
            if kv_prefix_tokens is None:
                await self.sleep_ms(timing.prefill_ms(tokens))
                return
            self.stats.kv_prefix_hits += 1
            self.stats.kv_prefix_tokens_total += min(kv_prefix_tokens, tokens)
            await self.sleep_ms(timing.kv_hit_prefill_ms(tokens, kv_prefix_tokens))

    @asynccontextmanager
    async def decoding(self) -> AsyncIterator[None]:
        self.stats.decoding += 1
        try:
            yield
        finally:
            self.stats.decoding -= 1

    async def decode_step(self) -> None:
        await self.sleep_ms(timing.itl_ms(self.stats.decoding))

    async def hold(self) -> None:
        """Wait for ``release_held()``; cancelled (client gone) frees the hold at once."""
        await self._gate.hold()

    def release_held(self) -> int:
        return self._gate.release()
