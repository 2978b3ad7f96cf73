"""Predicted pressure against reality: TTFT prediction error and snapshot age under load.

Run:  python -m bench.bench_pressure --out bench/results/pressure.json [--duration 40]
      python -m bench.bench_pressure --vllm --out bench/results/pressure_vllm.json

Simulated (the default): starts the demo (`python -m cacheroute_sim.demo`: sidecar, 2 workers
with least_load, 2 simulated instances at time scale 1, whose timing follows the same fitted
curves as the default predictor profile).

--vllm: starts real vLLM engines instead (tests/real_engine/engines.py: the CPU build in
.venv-vllm serving the tiny model, each pinned to its own core; `make install-vllm` makes both)
and `python -m cacheroute_proxy run` with the `vllm-cpu-tiny` predictor profile, measured on the
same engine (docs/predictors.md §2); each engine is registered by an instance agent beside it
(tests/real_engine/registration.py). Prompts and outputs fit the engine's 1,024-token
context, and arrivals are sized for it.

Both drive streaming requests with Poisson arrivals and mixed prompt lengths for a bounded
time, on free 127.0.0.1 ports and a private segment. Every request's `cacheroute_meta.trace`
carries `predict_error_ms` (actual first token minus the first token predicted at release to
ready) and `snapshot_age_ms` (age of the sidecar snapshot the selection read). Everything
started is stopped at the end; nothing is left behind.
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
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.results import write_report
from bench.harness.stats import percentile
from cacheroute_sim.processes import ChildProcess, SupervisorPorts, free_port, free_port_range


@dataclass(frozen=True)
class Workload:
    """What is sent: the model name, prompt lengths (tokens as the proxy estimates them,
    characters / 4) and the output length range."""
    model: str
    prompt_tokens: tuple[int, ...]
    max_tokens: tuple[int, int]
    duration_s: float
    rate_per_s: float
    extra_body: dict[str, Any]


SIM_PROMPT_TOKENS = (50, 200, 500, 1000, 2000)
# The tiny model's tokenizer makes ~2 tokens of 4 'x' characters: 50..400 here are ~100..800
# real tokens, and with up to 80 output tokens every request fits max_model_len 1024.
VLLM_PROMPT_TOKENS = (50, 100, 200, 300, 400)


class RequestFailed(RuntimeError):
    pass


def _wait_ready(url: str, instances: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                loads = json.loads(response.read())
                if len([i for i in loads["instances"] if i["is_alive"]]) >= instances:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"proxy not ready at {url}")


async def _one(session: aiohttp.ClientSession, url: str, workload: Workload, tokens: int,
               max_tokens: int) -> dict:
    body = {"model": workload.model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * tokens)}], **workload.extra_body}
    async with session.post(url, json=body) as response:
        text = await response.text()
    if response.status != 200:
        raise RequestFailed(f"{response.status} {text[:160]}")
    marker = "event: cacheroute_meta\ndata: "
    start = text.rindex(marker) + len(marker)
    return json.loads(text[start:text.index("\n", start)])


async def _drive(url: str, workload: Workload, seed: int) -> tuple[list[dict], list[str]]:
    """The cacheroute_meta of every whole answer, and why each other request failed."""
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        end = time.monotonic() + workload.duration_s
        while time.monotonic() < end:
            tokens, max_tokens = rng.choice(workload.prompt_tokens), rng.randint(*workload.max_tokens)
            tasks.append(asyncio.ensure_future(_one(session, url, workload, tokens, max_tokens)))
            await asyncio.sleep(rng.expovariate(workload.rate_per_s))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [f"{type(r).__name__}: {r}" for r in results if not isinstance(r, dict)]
    return [m for m in results if isinstance(m, dict)], failures


# --- what the load runs against ----------------------------------------------------------------
@contextmanager
def simulated_proxy() -> Iterator[str]:
    """The demo launcher: the proxy (2 workers) and its two simulated instances. Yields the
    data plane's URL."""
    ports = SupervisorPorts(2, "cacheroute_bench")
    cp = ports.cp_port
    env = {"PROXY_DP_PORT": str(ports.dp_port), "PROXY_CP_PORT": str(cp),
           "PROXY_WORKER_PRIVATE_PORT_BASE": str(ports.private_base), "PROXY_WORKERS": "2",
           "PROXY_SIM_INSTANCES": "2", "PROXY_SIM_INSTANCE_PORT_BASE": str(free_port_range(12)),  # base+10i, +1
           "PROXY_SIM_KDN_PORT": str(free_port()),
           "PROXY_INSTANCE_STRATEGY": "least_load",
           "PROXY_SHM_NAME": ports.shm_name}
    supervisor = ChildProcess(["-m", "cacheroute_sim.demo"], env, Path("/tmp/bench_pressure_supervisor.log"))
    try:
        _wait_ready(f"http://127.0.0.1:{cp}/debug/instance_loads", 2, 30)
        yield ports.dp_url
    finally:
        supervisor.stop(signal.SIGINT, 60)


@contextmanager
def vllm_proxy(engines: int, profile: str, log_dir: Path, info: dict[str, Any]) -> Iterator[str]:
    """`engines` real vLLM engines behind `cacheroute-proxy run` (2 workers, least_load, the
    given predictor profile). Fills `info` with the engines' facts; yields the data plane's URL."""
    # tests/ holds the engine launcher and the agent registration the real-engine suite uses.
    from tests.real_engine.engines import MAX_MODEL_LEN, MAX_NUM_SEQS, start_engines, stop_engines
    from tests.real_engine.registration import AgentRegistration

    started = start_engines(engines, log_dir)
    ports = SupervisorPorts(2, "cacheroute_bench")
    env = {**ports.supervisor_env("least_load"), "PROXY_PREDICTOR_PROFILE": profile}
    supervisor = ChildProcess(["-m", "cacheroute_proxy", "run"], env, log_dir / "supervisor.log")
    registrations: list[AgentRegistration] = []
    try:
        # The sidecar, then every worker and the shared data-plane port: a request sent before
        # a worker listens would be refused and counted as failed.
        for url in (ports.cp_url, *(ports.worker_url(i) for i in range(ports.workers)), ports.dp_url):
            _wait_until_up(f"{url}/healthz", 30)
        registrations = [AgentRegistration(ports.cp_url, engine, f"vllm-{i}", log_dir / f"agent-{i}.log")
                         for i, engine in enumerate(started)]
        _wait_ready(f"{ports.cp_url}/debug/instance_loads", engines, 30)
        with urllib.request.urlopen(f"{started[0].url}/version", timeout=5) as response:
            info.update(vllm_version=json.loads(response.read())["version"], engines=engines,
                        max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                        engine_cores=[e.cpu for e in started])
        yield ports.dp_url
    finally:
        for registration in registrations:
            registration.stop()
        supervisor.stop(signal.SIGINT, 60)
        stop_engines(started)


def _wait_until_up(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing answers at {url}")


# --- the report ---------------------------------------------------------------------------------
def summarize(metas: list[dict], failures: list[str]) -> dict[str, Any]:
    traces = [m["trace"] for m in metas if m.get("error") is None]
    failures = failures + [f"cut: {m['error']}" for m in metas if m.get("error") is not None]
    errors = [t["predict_error_ms"] for t in traces if "predict_error_ms" in t]
    ages = [t["snapshot_age_ms"] for t in traces if "snapshot_age_ms" in t]
    ttfts = [t["actual_ttft_ms"] for t in traces if "actual_ttft_ms" in t]
    absolute = [abs(e) for e in errors]
    return {
        "requests_ok": len(traces), "requests_failed": len(failures),
        "failures": dict(Counter(failures).most_common(5)),
        "ttft_prediction_error_ms": {
            "median_abs": statistics.median(absolute), "p90_abs": percentile(absolute, 0.9, method="floor_index"),
            "median_signed": statistics.median(errors), "samples": len(errors)},
        "actual_ttft_ms": {"p50": statistics.median(ttfts), "p90": percentile(ttfts, 0.9, method="floor_index")},
        "snapshot_age_ms": {"p50": statistics.median(ages), "p99": percentile(ages, 0.99, method="floor_index"),
                            "max": max(ages), "samples": len(ages)},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pressure")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--vllm", action="store_true",
                        help="real vLLM engines from .venv-vllm instead of simulated instances")
    parser.add_argument("--engines", type=int, default=2, help="with --vllm: how many (1 or 2)")
    parser.add_argument("--profile", default="vllm-cpu-tiny", help="with --vllm: the predictor profile")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of arrivals (default 45; --vllm: 60)")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests per second, Poisson (default 1; --vllm: 4)")
    parser.add_argument("--seed", type=int, default=7)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    loadavg_at_start = os.getloadavg()
    engine_info: dict[str, Any] = {}
    if args.vllm:
        if args.engines not in (1, 2):
            raise SystemExit("--engines: 1 or 2 (one core each on this machine)")
        workload = Workload("tiny", VLLM_PROMPT_TOKENS, (10, 80), args.duration or 60.0, args.rate or 4.0,
                            {"ignore_eos": True})  # outputs as long as asked: decode time is predictable
        log_dir = Path(tempfile.mkdtemp(prefix="bench_pressure_vllm_"))
        target: Callable[[], Any] = lambda: vllm_proxy(args.engines, args.profile, log_dir, engine_info)
    else:
        workload = Workload("sim", SIM_PROMPT_TOKENS, (10, 80), args.duration or 45.0, args.rate or 1.0, {})
        target = simulated_proxy
    with target() as dp_url:
        metas, failures = asyncio.run(_drive(f"{dp_url}/v1/chat/completions", workload, args.seed))
    report: dict[str, Any] = {
        "command": "python -m bench.bench_pressure " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": {"duration_s": workload.duration_s, "rate_per_s": workload.rate_per_s,
                     "prompt_tokens": workload.prompt_tokens, "max_tokens": "uniform 10..80",
                     "workers": 2, "instances": args.engines if args.vllm else 2, "strategy": "least_load",
                     **({"engine": "vLLM CPU, tiny model", "profile": args.profile} if args.vllm
                        else {"sim_time_scale": 1.0})},
        **({"engine": engine_info} if args.vllm else {}),
        **summarize(metas, failures),
        "loadavg_at_start": loadavg_at_start,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
