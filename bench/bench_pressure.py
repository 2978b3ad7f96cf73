"""Predicted pressure against reality: TTFT prediction error and snapshot age under load.

Run:  python -m bench.bench_pressure --out bench/results/pressure.json [--duration 40]

Starts the real thing (`python -m cacheroute_sim.demo`: sidecar, 2 workers with least_load, 2
simulated instances at time scale 1, whose timing follows the same fitted curves as the
default predictor profile) on free 127.0.0.1 ports and a private segment, then drives
streaming requests with Poisson arrivals and mixed prompt lengths for a bounded time. Every
request's `cacheroute_meta.trace` carries `predict_error_ms` (actual first token minus the
first token predicted at release to ready) and `snapshot_age_ms` (age of the sidecar snapshot
the selection read). The supervisor is stopped with SIGINT at the end; nothing is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp

from cacheroute_sim.processes import ChildProcess, free_port, free_port_range
from bench.stats import percentile

PROMPT_TOKENS = (50, 200, 500, 1000, 2000)


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                loads = json.loads(response.read())
                if len([i for i in loads["instances"] if i["is_alive"]]) >= 2:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"proxy not ready at {url}")


async def _one(session: aiohttp.ClientSession, url: str, tokens: int, max_tokens: int) -> dict:
    body = {"model": "sim", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * tokens)}]}
    async with session.post(url, json=body) as response:
        text = await response.text()
    marker = "event: cacheroute_meta\ndata: "
    start = text.rindex(marker) + len(marker)
    return json.loads(text[start:text.index("\n", start)])


async def _drive(url: str, duration: float, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(
                _one(session, url, rng.choice(PROMPT_TOKENS), rng.randint(10, 80))))
            await asyncio.sleep(rng.expovariate(rate))
        return [m for m in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(m, dict)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pressure")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    dp, cp, private = free_port(), free_port(), free_port_range(2)
    env = {"PROXY_DP_PORT": str(dp), "PROXY_CP_PORT": str(cp),
           "PROXY_WORKER_PRIVATE_PORT_BASE": str(private), "PROXY_WORKERS": "2",
           "PROXY_SIM_INSTANCES": "2", "PROXY_SIM_INSTANCE_PORT_BASE": str(free_port_range(12)),  # base+10i, +1
           "PROXY_SIM_KDN_PORT": str(free_port()),
           "PROXY_INSTANCE_STRATEGY": "least_load",
           "PROXY_SHM_NAME": f"/cacheroute_bench_{uuid.uuid4().hex[:8]}"}
    # The demo launcher: the proxy plus its two simulated instances.
    supervisor = ChildProcess(["-m", "cacheroute_sim.demo"], env, Path("/tmp/bench_pressure_supervisor.log"))
    try:
        _wait_ready(f"http://127.0.0.1:{cp}/debug/instance_loads", 30)
        metas = asyncio.run(_drive(f"http://127.0.0.1:{dp}/v1/chat/completions",
                                   args.duration, args.rate, args.seed))
    finally:
        supervisor.stop(signal.SIGINT, 60)
    traces = [m["trace"] for m in metas if m.get("error") is None]
    errors = [t["predict_error_ms"] for t in traces if "predict_error_ms" in t]
    ages = [t["snapshot_age_ms"] for t in traces if "snapshot_age_ms" in t]
    ttfts = [t["actual_ttft_ms"] for t in traces if "actual_ttft_ms" in t]
    absolute = [abs(e) for e in errors]
    report = {
        "command": "python -m bench.bench_pressure " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": {"duration_s": args.duration, "rate_per_s": args.rate, "prompt_tokens": PROMPT_TOKENS,
                     "max_tokens": "uniform 10..80", "workers": 2, "instances": 2,
                     "strategy": "least_load", "sim_time_scale": 1.0},
        "requests_ok": len(traces), "requests_failed": len(metas) - len(traces),
        "ttft_prediction_error_ms": {
            "median_abs": statistics.median(absolute), "p90_abs": percentile(absolute, 0.9, method="floor_index"),
            "median_signed": statistics.median(errors), "samples": len(errors)},
        "actual_ttft_ms": {"p50": statistics.median(ttfts), "p90": percentile(ttfts, 0.9, method="floor_index")},
        "snapshot_age_ms": {"p50": statistics.median(ages), "p99": percentile(ages, 0.99, method="floor_index"),
                            "max": max(ages), "samples": len(ages)},
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
