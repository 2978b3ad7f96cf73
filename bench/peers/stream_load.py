"""The streaming load generator: `concurrency` clients, each POSTing `"stream": true` chat
requests back to back over its keep-alive connection for `seconds`, reading the SSE to the end.

A stream counts as ok only if it ends with `data: [DONE]`; a non-2xx answer, a socket error or
a stream cut before [DONE] is an error of its kind. TTFT = request sent -> first `data:` line.

Runs as its own process (`python -m bench.peers.stream_load --url ... `), printing one JSON
object, so its CPU is not charged to the orchestrator and a stuck client is killed by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

PATH = "/v1/chat/completions"
DONE_LINE = b"data: [DONE]"
SAMPLES_KEPT = 200  # TTFT samples returned (evenly spaced ranks of the sorted list)


@dataclass
class Tally:
    ok: int = 0
    status: int = 0      # non-2xx answers
    socket: int = 0      # connect / read errors, timeouts
    truncated: int = 0   # 200, but the stream ended without [DONE]
    ttft_s: list[float] = field(default_factory=list)


def chat_body(max_tokens: int) -> bytes:
    return json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": max_tokens, "stream": True}, separators=(",", ":")).encode()


async def one_stream(session: Any, url: str, body: bytes, tally: Tally) -> None:
    import aiohttp

    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if not 200 <= resp.status < 300:
                await resp.read()
                tally.status += 1
                return
            first, done = None, False
            async for line in resp.content:  # one SSE line at a time
                if first is None and line.startswith(b"data:") and not line.startswith(DONE_LINE):
                    first = time.perf_counter() - started
                if line.startswith(DONE_LINE):
                    done = True
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        tally.socket += 1
        return
    if not done:
        tally.truncated += 1
        return
    tally.ok += 1
    if first is not None:
        tally.ttft_s.append(first)


async def run(url: str, concurrency: int, seconds: float, max_tokens: int,
              timeout_s: float) -> dict[str, Any]:
    import aiohttp

    body, target, tally = chat_body(max_tokens), url.rstrip("/") + PATH, Tally()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        deadline = started + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                await one_stream(session, target, body, tally)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return summarize(tally, elapsed)


def summarize(tally: Tally, elapsed: float) -> dict[str, Any]:
    ttft = sorted(tally.ttft_s)
    errors = tally.status + tally.socket + tally.truncated
    result: dict[str, Any] = {
        "streams_ok": tally.ok, "seconds": round(elapsed, 3),
        "streams_per_s": round(tally.ok / elapsed, 1) if elapsed else 0.0,
        "errors": errors, "error_kinds": {"status": tally.status, "socket": tally.socket,
                                          "truncated": tally.truncated}}
    if ttft:
        result["ttft_p50_ms"] = round(_rank(ttft, 0.50) * 1000, 4)
        result["ttft_p99_ms"] = round(_rank(ttft, 0.99) * 1000, 4)
        step = max(1, len(ttft) // SAMPLES_KEPT)
        result["ttft_samples_ms"] = [round(x * 1000, 3) for x in ttft[::step]]
    return result


def _rank(ordered: list[float], q: float) -> float:
    from bench.harness.stats import percentile

    return percentile(ordered, q)


def run_process(url: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """Run the client as a child process (bounded: killed at seconds + 30) and return its JSON."""
    cmd = [sys.executable, "-m", "bench.peers.stream_load", "--url", url, "--concurrency",
           str(concurrency), "--seconds", str(seconds), "--max-tokens", str(max_tokens)]
    from cacheroute_sim.processes import ROOT

    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30,
                              cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return {"streams_ok": 0, "streams_per_s": 0.0, "errors": 1, "client_failed": "timed out"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"streams_ok": 0, "streams_per_s": 0.0, "errors": 1,
                "client_failed": (done.stdout + done.stderr)[-800:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.stream_load", description=__doc__)
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=4, help="content chunks per stream")
    p.add_argument("--timeout", type=float, default=10.0, help="per stream, seconds")
    a = p.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    result = runner(run(a.url, a.concurrency, a.seconds, a.max_tokens, a.timeout))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
