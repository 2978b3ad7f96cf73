"""The client side: the seeded requests sent open-loop (each at its planned time, whether or not
the ones before have been answered), or closed-loop for the calibration (a fixed number in
flight, the next sent as one ends); each request's TTFT, end, and for this proxy what its
`cacheroute_meta` said of the choice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import aiohttp

from bench.harness import arrivals
from bench.harness.streamed import proxy_account, stream_chat

from .workload import Planned, body

REQUEST_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    ttft_ms: float | None = None
    ended_at: float | None = None  # seconds after the run's first send
    instance: str | None = None  # this proxy's x-cacheroute-instance
    # kv_aware's account of its choice (cacheroute_meta.trace): the balance guard fired, what
    # the chosen instance's holding of the prompt saved of its predicted TTFT, that prediction.
    guard: bool | None = None
    saved_ms: float | None = None
    predicted_ttft_ms: float | None = None
    error: str | None = None
    system: int | None = None  # the request's system prompt
    # This proxy's own account (cacheroute_meta.trace), in whole ms: from the request reaching a
    # worker to its forward; from the client's send to the worker's receipt plus from the
    # instance's first chunk at the worker to the client (the client's TTFT less the worker's).
    before_forward_ms: int | None = None
    outside_ms: float | None = None
    select_ms: int | None = None  # of before_forward_ms: choosing the instance


async def _one(session: aiohttp.ClientSession, url: str, request: Planned, request_body: dict[str, Any],
               begin: float) -> Outcome:
    streamed = await stream_chat(session, url, request_body)
    account = proxy_account(streamed.meta)
    outcome = Outcome(streamed.ttft_ms, None if streamed.ended_at is None else streamed.ended_at - begin,
                      streamed.instance, account.guard, account.saved_ms, account.predicted_ttft_ms,
                      streamed.error, request.system, account.before_forward_ms,
                      None if streamed.ttft_ms is None or account.proxy_ttft_ms is None
                      else streamed.ttft_ms - account.proxy_ttft_ms, account.select_ms)
    if outcome.error is None and not streamed.finished:
        outcome.error = "stream ended without [DONE]"
    if streamed.meta is not None:
        outcome.error = outcome.error or streamed.meta.get("error")
    return outcome


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                 connector=aiohttp.TCPConnector(limit=0))


async def _open_loop(send_to: Callable[[Planned], str], planned: Sequence[Planned], prompts: Sequence[str],
                     rate: float, max_tokens: int) -> tuple[list[Outcome], float]:
    async with _session() as session:
        begin = time.monotonic()
        outcomes = await arrivals.open_loop(((p.unit_at / rate, p) for p in planned), lambda request: _one(
            session, send_to(request), request, body(request, prompts, max_tokens), begin))
        return outcomes, time.monotonic() - begin


def open_loop(send_to: Callable[[Planned], str], planned: Sequence[Planned], prompts: Sequence[str],
              rate: float, max_tokens: int) -> tuple[list[Outcome], float]:
    """Every request at its planned time at `rate` requests/s, each to the URL `send_to` gives it;
    the outcomes in plan order and the seconds from the first send to the last end. Bounded:
    each request ends by REQUEST_TIMEOUT_S."""
    return asyncio.run(_open_loop(send_to, planned, prompts, rate, max_tokens))


async def _closed_loop(url: str, planned: Sequence[Planned], prompts: Sequence[str], concurrency: int,
                       max_tokens: int) -> list[Outcome]:
    async with _session() as session:
        begin = time.monotonic()
        return await arrivals.closed_loop(iter(planned), concurrency, lambda request: _one(
            session, url, request, body(request, prompts, max_tokens), begin))


def closed_loop(url: str, planned: Sequence[Planned], prompts: Sequence[str], concurrency: int,
                   max_tokens: int) -> list[Outcome]:
    """`concurrency` requests in flight until `planned` is used up; outcomes in the order they ended."""
    return asyncio.run(_closed_loop(url, planned, prompts, concurrency, max_tokens))


def write_outcomes(path: Path, planned: Sequence[Planned], outcomes: Sequence[Outcome], rate: float) -> None:
    """One JSON line a request, in plan order: its planned send (s after the first), system
    prompt, and outcome (TTFT, instance, kv_aware's account of its choice): what a run's tail
    is made of, e.g. which burst put which requests where."""
    with path.open("w") as out:
        for request, outcome in zip(planned, outcomes, strict=True):
            out.write(json.dumps({"at_s": round(request.unit_at / rate, 4), **dataclasses.asdict(outcome)}) + "\n")
