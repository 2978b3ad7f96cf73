"""Predicted pressure against reality: TTFT prediction error and snapshot age under load.

Run:  python -m bench.bench_pressure --out bench/results/pressure.json [--duration 40]
      python -m bench.bench_pressure --vllm --out bench/results/pressure_vllm.json

Simulated (the default): starts the demo (`python -m cacheroute_sim.demo`: sidecar, 2 workers
with least_load, 2 simulated instances at time scale 1, whose timing follows the same fitted
curves as the default predictor profile).

--vllm: starts real vLLM engines instead (tests/real_engine/engines.py: the CPU build in
.venv-vllm serving the tiny model, each pinned to its own core; `make install-vllm` makes both)
and `python -m cacheroute_proxy run` with the `vllm-cpu-tiny` predictor profile, measured on the
same engine (docs/predictors.md); each engine is registered by an instance agent beside it
(tests/real_engine/registration.py). Prompts and outputs fit the engine's 1,024-token
context, and arrivals are sized for it.

Both drive streaming requests with Poisson arrivals (open loop: bench/harness/arrivals.py) and
mixed prompt lengths for a bounded time, on free 127.0.0.1 ports and a private segment
(bench/harness/processes.py, Supervisor). Every request's `cacheroute_meta.trace` carries
`predict_error_ms` (actual first token minus the first token predicted at release to ready)
and `snapshot_age_ms` (age of the sidecar snapshot the selection read). Everything started is
stopped at the end; nothing is left behind but the logs' directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.arrivals import open_loop
from bench.harness.cli import stop_on_sigterm
from bench.harness.processes import Supervisor, http_json, scratch_dir
from bench.harness.results import Run, write_report
from bench.harness.stats import percentile
from bench.harness.streamed import stream_chat
from cacheroute_sim.processes import free_port, free_port_range

WORKERS = 2
STRATEGY = "least_load"
SIM_INSTANCES = 2


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


def plan(workload: Workload, seed: int) -> list[tuple[float, tuple[int, int]]]:
    """(seconds after the start, (prompt tokens, max tokens)) of every request: Poisson arrivals
    at the workload's rate for its duration, seeded."""
    rng = random.Random(seed)
    planned, at = [], 0.0
    while at < workload.duration_s:
        planned.append((at, (rng.choice(workload.prompt_tokens), rng.randint(*workload.max_tokens))))
        at += rng.expovariate(workload.rate_per_s)
    return planned


def body(workload: Workload, tokens: int, max_tokens: int) -> dict[str, Any]:
    return {"model": workload.model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * tokens)}], **workload.extra_body}


async def _drive(url: str, workload: Workload, seed: int) -> tuple[list[dict], list[str]]:
    """The cacheroute_meta of every whole answer, and why each other request failed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        streamed = await open_loop(plan(workload, seed),
                                   lambda sizes: stream_chat(session, url, body(workload, *sizes)))
    answered = [s.meta for s in streamed if s.error is None and s.meta is not None]
    failures = [s.error or "the stream carried no cacheroute_meta" for s in streamed if s.error or s.meta is None]
    return answered, failures


# --- what the load runs against ----------------------------------------------------------------
@contextmanager
def simulated_proxy(log_dir: Path) -> Iterator[Supervisor]:
    """The demo launcher: the proxy (2 workers) and its two simulated instances, up."""
    env = {"PROXY_SIM_INSTANCES": str(SIM_INSTANCES),
           "PROXY_SIM_INSTANCE_PORT_BASE": str(free_port_range(12)),  # instance i: base+10i, +1
           "PROXY_SIM_KDN_PORT": str(free_port())}
    with Supervisor(WORKERS, STRATEGY, log_dir / "demo.log", env, command=("-m", "cacheroute_sim.demo"),
                    stop_timeout_s=60.0) as proxy:
        proxy.wait_seen(SIM_INSTANCES)
        yield proxy


@contextmanager
def vllm_proxy(engines: int, profile: str, log_dir: Path, info: dict[str, Any]) -> Iterator[Supervisor]:
    """`engines` real vLLM engines behind `cacheroute-proxy run` (2 workers, least_load, the
    given predictor profile), each registered by an instance agent, up. Fills `info` with the
    engines' facts."""
    # tests/ holds the engine launcher and the agent registration the real-engine suite uses.
    from tests.real_engine.engines import MAX_MODEL_LEN, MAX_NUM_SEQS, start_engines, stop_engines
    from tests.real_engine.registration import AgentRegistration

    started = start_engines(engines, log_dir)
    proxy = Supervisor(WORKERS, STRATEGY, log_dir / "supervisor.log", {"PROXY_PREDICTOR_PROFILE": profile},
                       stop_timeout_s=60.0)
    registrations: list[AgentRegistration] = []
    try:
        proxy.start()
        registrations = [AgentRegistration(proxy.cp_url, engine, f"vllm-{i}", log_dir / f"agent-{i}.log")
                         for i, engine in enumerate(started)]
        proxy.wait_seen(engines)
        info.update(vllm_version=http_json("GET", f"{started[0].url}/version")[1]["version"], engines=engines,
                    max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                    engine_cores=[e.cpu for e in started])
        yield proxy
    finally:
        for registration in registrations:
            registration.stop()
        proxy.stop()
        stop_engines(started)


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
    stop_on_sigterm()  # a timeout or kill unwinds through every `with`: what it started stops
    provenance = Run("bench.bench_pressure", argv)
    engine_info: dict[str, Any] = {}
    log_dir = scratch_dir("pressure")
    target: Callable[[Path, dict[str, Any]], AbstractContextManager[Supervisor]]
    if args.vllm:
        if args.engines not in (1, 2):
            raise SystemExit("--engines: 1 or 2 (one core each on this machine)")
        workload = Workload("tiny", VLLM_PROMPT_TOKENS, (10, 80), args.duration or 60.0, args.rate or 4.0,
                            {"ignore_eos": True})  # outputs as long as asked: decode time is predictable
        target = lambda logs, info: vllm_proxy(args.engines, args.profile, logs, info)  # noqa: E731
    else:
        workload = Workload("sim", SIM_PROMPT_TOKENS, (10, 80), args.duration or 45.0, args.rate or 1.0, {})
        target = lambda logs, info: simulated_proxy(logs)  # noqa: E731
    with target(log_dir, engine_info) as proxy:
        metas, failures = asyncio.run(_drive(proxy.dp_url, workload, args.seed))
    report: dict[str, Any] = {
        **provenance.record(),
        "workload": {"duration_s": workload.duration_s, "rate_per_s": workload.rate_per_s,
                     "prompt_tokens": workload.prompt_tokens, "max_tokens": "uniform 10..80",
                     "workers": WORKERS, "instances": args.engines if args.vllm else SIM_INSTANCES,
                     "strategy": STRATEGY,
                     **({"engine": "vLLM CPU, tiny model", "profile": args.profile} if args.vllm
                        else {"sim_time_scale": 1.0})},
        **({"engine": engine_info} if args.vllm else {}),
        **summarize(metas, failures),
        "logs": str(log_dir),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
