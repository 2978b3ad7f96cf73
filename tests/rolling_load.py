"""The load a rolling restart must not fail: three kinds of clients, every outcome recorded.

- `fresh`: a new TCP connection for every request (aiohttp with force_close), so connections
  keep arriving at the shared port while listeners close and open;
- `keepalive`: one pooled aiohttp session reusing its connections; its idle timeout (2 s by
  default) is shorter than the worker's PROXY_KEEPALIVE_TIMEOUT_S (5 s), as any client of a
  keep-alive server should have it;
- `sse`: streams of a few seconds, so some are in flight when their worker gets SIGTERM.

No retries anywhere: aiohttp retries a failed persistent connection only for idempotent
methods, and every request here is a POST. A failure is any status other than 200, any
exception (reset, disconnect, timeout), a JSON answer without `_cacheroute_meta`, and a stream
that does not end with `data: [DONE]` or whose `cacheroute_meta` carries an error.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CLIENT_KEEPALIVE_S = 2.0
REQUEST_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    kind: str
    stream: bool
    started: float
    ended: float
    ok: bool
    error: str | None = None
    worker: str | None = None


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def ended_within(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.ended <= end]

    def summary(self, window: tuple[float, float]) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            counts = by_kind.setdefault(o.kind, {"requests": 0, "failed": 0})
            counts["requests"] += 1
            counts["failed"] += not o.ok
        return {
            "requests": len(self.outcomes),
            "failed": len(self.failures()),
            "by_kind": by_kind,
            "completed_in_restart_window": len(self.ended_within(*window)),
            "streams_overlapping_restart_window": sum(
                1 for o in self.outcomes if o.stream and o.started < window[1] and o.ended > window[0]),
            "workers_seen": sorted({o.worker for o in self.outcomes if o.worker}),
            "failure_samples": [{**o.__dict__, "started": round(o.started - window[0], 3),
                                 "ended": round(o.ended - window[0], 3)} for o in self.failures()[:20]],
            "failure_times_after_sighup": _histogram([o.ended - window[0] for o in self.failures()]),
            "failure_reasons": _reasons(self.failures()),
        }


def _histogram(offsets: list[float]) -> dict[str, int]:
    """Failures per second relative to SIGHUP (negative: before it)."""
    counts: dict[str, int] = {}
    for offset in sorted(offsets):
        key = f"{int(offset // 1)}s"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _reasons(failures: list[Outcome]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for o in failures:
        key = (o.error or "?").split(":")[0][:80]
        reasons[key] = reasons.get(key, 0) + 1
    return reasons


def body(stream: bool, max_tokens: int, n: int) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": f"rolling restart {n}"}],
            "stream": stream, "max_tokens": max_tokens}


class LoadGenerator:
    def __init__(self, url: str, *, fresh: int, keepalive: int, sse: int,
                 short_tokens: int, stream_tokens: int, client_keepalive_s: float = CLIENT_KEEPALIVE_S,
                 keepalive_think_s: float = 0.0) -> None:
        self.url = url + "/v1/chat/completions"
        self.mix = {"fresh": fresh, "keepalive": keepalive, "sse": sse}
        self.short_tokens = short_tokens
        self.stream_tokens = stream_tokens
        self.client_keepalive_s = client_keepalive_s
        # keepalive clients pause 0..this between requests (to put reuses near an idle timeout)
        self.keepalive_think_s = keepalive_think_s
        self.result = LoadResult()
        self._stop = asyncio.Event()
        self._n = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> LoadResult:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout)
        pooled = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.client_keepalive_s), timeout=timeout)
        try:
            loops = [self._loop("fresh", fresh, i) for i in range(self.mix["fresh"])]
            loops += [self._loop("keepalive", pooled, i) for i in range(self.mix["keepalive"])]
            loops += [self._loop("sse", pooled, i) for i in range(self.mix["sse"])]
            await asyncio.gather(*loops)
        finally:
            await fresh.close()
            await pooled.close()
        return self.result

    async def _loop(self, kind: str, session: aiohttp.ClientSession, i: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            # fresh and keepalive clients send a short stream every third request
            stream = kind == "sse" or turn % 3 == 0
            tokens = self.stream_tokens if kind == "sse" else self.short_tokens
            self._n += 1
            self.result.outcomes.append(await self._one(kind, session, stream, tokens, self._n))
            if kind == "keepalive" and self.keepalive_think_s:
                await asyncio.sleep(random.uniform(0, self.keepalive_think_s))

    async def _one(self, kind: str, session: aiohttp.ClientSession, stream: bool, tokens: int,
                   n: int) -> Outcome:
        started = time.monotonic()
        outcome = Outcome(kind, stream, started, 0.0, False)
        try:
            async with session.post(self.url, json=body(stream, tokens, n)) as response:
                outcome.worker = response.headers.get("x-cacheroute-worker")
                payload = await response.read()
                outcome.error = check(response.status, payload, stream)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ok = outcome.error is None
        outcome.ended = time.monotonic()
        return outcome


def check(status: int, payload: bytes, stream: bool) -> str | None:
    """None if the answer is whole and successful, else why not."""
    if status != 200:
        return f"status {status}: {payload[:200]!r}"
    if not stream:
        try:
            parsed = json.loads(payload)
        except ValueError:
            return f"not JSON: {payload[:200]!r}"
        return None if isinstance(parsed, dict) and "_cacheroute_meta" in parsed else "no _cacheroute_meta"
    if not payload.rstrip().endswith(b"data: [DONE]"):
        return f"stream truncated (no [DONE]): ...{payload[-200:]!r}"
    meta = _meta_error(payload)
    return None if meta is None else f"stream meta error: {meta}"


def _meta_error(payload: bytes) -> str | None:
    marker = b"event: cacheroute_meta\ndata: "
    at = payload.rfind(marker)
    if at < 0:
        return "no cacheroute_meta event"
    line = payload[at + len(marker):].split(b"\n", 1)[0]
    try:
        return json.loads(line).get("error")
    except ValueError:
        return "cacheroute_meta not JSON"
