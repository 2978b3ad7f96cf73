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
from cacheroute_sim.instance.request_model import GenerationRequest
from cacheroute_sim.instance.residency import Residency, block_hashes
from cacheroute_sim.instance.stats import Stats


class Engine:
    def __init__(self, *, time_scale: float, max_concurrency: int,
                 knobs: KnobStore[Knobs], kv_mem_gb: float = 128.0) -> None:
        self.time_scale = time_scale
        self.knobs = knobs
        self.stats = Stats()
        self.residency = Residency(kv_mem_gb, self.stats)
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

    async def prefill(self, request: GenerationRequest) -> None:
        # One prefill at a time: long prompts delay the first token of everyone behind them.
        # What is cached is looked up when the prefill starts, under the same lock, as a
        # scheduler does: an eviction while the request queued is a miss.
        async with self._prefill_lock:
            knobs = self.knobs.current
            hashes = block_hashes(request.prompt_text) if request.prompt_text else []
            ms = self._prefill_ms(request, hashes, knobs)
            await self.sleep_ms(ms)
            self.residency.remember_prompt(hashes, knobs)

    def _prefill_ms(self, request: GenerationRequest, hashes: list[bytes], knobs: Knobs) -> float:
        """The simulated prefill (GPU ms), counted in the stats.

        With the knowledge-ids hint, or prefix caching on: the cached prefix (residency.py) at
        cached_prefill_factor. With only the prefix-tokens hint: that many tokens pulled from
        Redis, the rest computed (timing.kv_hit_prefill_ms)."""
        stats = self.stats
        tokens, prefix = request.prompt_tokens, request.kv_prefix_tokens
        if prefix is not None:
            stats.kv_prefix_hits += 1
            stats.kv_prefix_tokens_total += min(prefix, tokens)
        resident = prefix_hit = 0
        if request.knowledge_ids or hashes:
            hit = self.residency.lookup(request.knowledge_ids, hashes, tokens, knobs)
            resident, prefix_hit = hit.resident_tokens, hit.prefix_hit_tokens
        if prefix is not None and not request.knowledge_ids:
            cached = min(prefix, tokens)
            ms = timing.kv_hit_prefill_ms(tokens, prefix)
        else:
            cached = max(resident, prefix_hit)
            ms = timing.cached_prefill_ms(tokens, cached, knobs.cached_prefill_factor)
        stats.prefills += 1
        stats.prefill_ms_total += ms
        stats.last_prefill = {"prompt_tokens": tokens, "cached_tokens": cached,
                              "resident_tokens": resident, "prefix_hit_tokens": prefix_hit,
                              "ms": round(ms, 3)}
        return ms

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
