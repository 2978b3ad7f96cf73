"""One streaming chat through the proxy, as the affinity and pressure benchmarks send it: which
instance answered, the time to the first chunk, and the stream's `cacheroute_meta` (meta_of,
which the soak reads too)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp

_META_MARKER = b"event: cacheroute_meta\ndata: "
_DONE = b"data: [DONE]"


@dataclass
class Streamed:
    instance: str | None = None
    ttft_ms: float | None = None
    meta: dict[str, Any] | None = None  # None: the stream carried none
    error: str | None = None  # a non-200 status or a client error; None otherwise
    finished: bool = False  # the stream ended with `data: [DONE]`
    ended_at: float | None = None  # time.monotonic() when it ended


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Streamed:
    out = Streamed()
    start = time.monotonic()
    received = b""
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            out.instance = response.headers.get("x-cacheroute-instance")
            if response.status != 200:
                out.error = f"status {response.status}: {(await response.text())[:120]}"
                return out
            async for chunk in response.content.iter_any():
                if out.ttft_ms is None:
                    out.ttft_ms = (time.monotonic() - start) * 1000
                received += chunk
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.ended_at = time.monotonic()
    out.finished = _DONE in received
    out.meta = meta_of(received)
    return out


def meta_of(stream: bytes) -> dict[str, Any] | None:
    """The `cacheroute_meta` event at the end of a proxied stream; None without one (or with one
    cut short)."""
    at = stream.rfind(_META_MARKER)
    if at < 0:
        return None
    begin = at + len(_META_MARKER)
    end = stream.find(b"\n", begin)
    try:
        meta = json.loads(stream[begin:end if end >= 0 else len(stream)])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


class ProxyAccount(NamedTuple):
    """What this proxy said of a request in `cacheroute_meta.trace` (all None for a peer):
    kv_aware's balance guard fired, what the chosen instance's holding saved of the predicted
    TTFT, and that prediction; the milliseconds from the request reaching the worker to its
    forward, and to the instance's first chunk, and those the choice of the instance took
    (whole milliseconds of the worker's clock)."""
    guard: bool | None = None
    saved_ms: float | None = None
    predicted_ttft_ms: float | None = None
    before_forward_ms: int | None = None
    proxy_ttft_ms: int | None = None
    select_ms: int | None = None


def proxy_account(meta: dict[str, Any] | None) -> ProxyAccount:
    trace = (meta or {}).get("trace") or {}
    return ProxyAccount(trace.get("affinity_guard"), trace.get("affinity_saved_ms"),
                         trace.get("route_predicted_ttft_ms"),
                         _between(trace, "proxy_recv_ms", "forward_start_ms"), trace.get("actual_ttft_ms"),
                         _between(trace, "route_select_start_ms", "route_select_end_ms"))


def _between(trace: dict[str, Any], start: str, end: str) -> int | None:
    """Milliseconds from the trace's `start` to its `end`, None unless both are there."""
    began, ended = trace.get(start), trace.get(end)
    return None if began is None or ended is None else ended - began
