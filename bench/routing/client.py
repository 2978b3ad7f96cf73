"""The open-loop streaming client: fires every arrival of the schedule at its time, whatever
the contender is doing (a closed loop would slow down with a slow router and hide its queues),
and measures at the client what a user sees: TTFT and total latency of each stream.

One new connection per request (no keep-alive), for every contender alike: with SO_REUSEPORT
the kernel spreads connections over the workers, so the requests of one burst reach different
workers at the same moment -- the situation where per-worker load views herd.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.routing.schedule import Arrival

CONTENT_MARK = b'"content"'
DONE_MARK = b"data: [DONE]"
INSTANCE_HEADERS = ("x-sim-instance", "x-cacheroute-instance")


@dataclass
class RequestResult:
    index: int
    at_s: float
    max_tokens: int
    prompt_tokens: int
    late_ms: float               # how late the client fired it (event-loop lag)
    status: int | None = None
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    instance: str | None = None  # from the response headers, when the contender passes them

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def chat_body(arrival: Arrival) -> dict[str, Any]:
    # The simulated instance counts ceil(chars / 4) prompt tokens.
    return {"model": "sim", "stream": True, "max_tokens": arrival.max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * arrival.prompt_tokens)}]}


async def run_schedule(url: str, arrivals: list[Arrival], drain_timeout_s: float) -> list[RequestResult]:
    """Fire the schedule at `url` (a /v1/chat/completions URL); wait for every stream, at most
    `drain_timeout_s` after the last arrival (what is still open then counts as an error)."""
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = [RequestResult(i, a.at_s, a.max_tokens, a.prompt_tokens, 0.0)
                   for i, a in enumerate(arrivals)]
        tasks = await _dispatch(session, url, arrivals, results)
        done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if not result.ok and result.error is None:
                result.error = "unfinished at the drain deadline"
        return results


async def _dispatch(session: aiohttp.ClientSession, url: str, arrivals: list[Arrival],
                    results: list[RequestResult]) -> list[asyncio.Task[None]]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for arrival, result in zip(arrivals, results, strict=True):
        delay = start + arrival.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        result.late_ms = max(0.0, (loop.time() - start - arrival.at_s) * 1000)
        tasks.append(asyncio.create_task(_one(session, url, arrival, result)))
    return tasks


async def _one(session: aiohttp.ClientSession, url: str, arrival: Arrival,
               result: RequestResult) -> None:
    sent = time.perf_counter()
    try:
        async with session.post(url, json=chat_body(arrival)) as response:
            result.status = response.status
            result.instance = next((response.headers[h] for h in INSTANCE_HEADERS
                                    if h in response.headers), None)
            if response.status != 200:
                result.error = f"HTTP {response.status}"
                await response.read()
                return
            tail = b""
            async for chunk in response.content.iter_any():
                window = tail + chunk
                if result.ttft_ms is None and CONTENT_MARK in window:
                    result.ttft_ms = (time.perf_counter() - sent) * 1000
                tail = window[-64:]
        result.total_ms = (time.perf_counter() - sent) * 1000
        result.ok = DONE_MARK in tail and result.ttft_ms is not None
        if not result.ok:
            result.error = "stream ended without a token and [DONE] (truncated)"
    except asyncio.CancelledError:
        result.error = "unfinished at the drain deadline"
        raise
    except (aiohttp.ClientError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
