"""Measure HTTP/1.1's idle-close race against a real worker; prints one JSON result.

    .venv/bin/python -m tests.idle_close_race [--trials 1000] [--spread-ms 6]

A client keeps one keep-alive connection (aiohttp, limit 1, its own idle timeout far longer than
the worker's), and before each POST pauses for the worker's keep-alive timeout plus a random
offset in ±spread. When the worker's timer closes the connection just as the client sends on it,
the POST fails (server disconnected / reset): the client cannot know, and must not retry a POST
blindly. The result counts failures per 1 ms of offset, which shows the width of the window. Not a
test: the rule it supports (docs/operations.md, "Clients' idle timeout"): clients use an idle
timeout shorter than PROXY_KEEPALIVE_TIMEOUT_S, and the worker closes idle connections only by
that timer, during a drain too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness import Cluster

SERVER_KEEPALIVE_S = 0.05  # short, so a thousand trials take about a minute


async def trials(base: str, count: int, spread_s: float) -> list[tuple[float, str | None]]:
    """(pause offset, error or None) per trial."""
    results = []
    connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(count):
            async with session.get(f"{base}/healthz") as response:
                await response.read()
            offset = random.uniform(-spread_s, spread_s)
            await asyncio.sleep(SERVER_KEEPALIVE_S + offset)
            try:  # a POST (aiohttp retries only idempotent methods); "{" gets a quick 4xx
                async with session.post(f"{base}/v1/chat/completions", data=b"{") as response:
                    await response.read()
                error = None
            except (aiohttp.ClientError, OSError) as exc:
                error = type(exc).__name__
            results.append((offset, error))
    return results


def by_millisecond(results: list[tuple[float, str | None]]) -> dict[str, str]:
    bins: dict[int, list[int]] = {}
    for offset, error in results:
        counts = bins.setdefault(int(offset * 1000 // 1), [0, 0])
        counts[0] += error is not None
        counts[1] += 1
    return {f"{k:+d}..{k + 1:+d} ms": f"{f}/{n} failed" for k, (f, n) in sorted(bins.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--spread-ms", type=float, default=6.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(Path(logs), workers=1, env={"PROXY_KEEPALIVE_TIMEOUT_S": str(SERVER_KEEPALIVE_S),
                                                      "PROXY_LOG_LEVEL": "warning"})
        cluster.start()
        try:
            results = asyncio.run(trials(cluster.worker_url(0), args.trials, args.spread_ms / 1000))
        finally:
            cluster.stop()
    errors: dict[str, Any] = {}
    for _, error in results:
        if error:
            errors[error] = errors.get(error, 0) + 1
    print(json.dumps({"server_keepalive_s": SERVER_KEEPALIVE_S, "trials": len(results),
                      "failed": sum(errors.values()), "errors": errors,
                      "by_pause_offset": by_millisecond(results)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
