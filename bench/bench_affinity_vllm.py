"""kv_aware against least_load on two real vLLM engines: vLLM's own prefix-cache hit counters.

Run:  python -m bench.bench_affinity_vllm --out bench/results/affinity_vllm.json
      [--duration 45] [--rate 4] [--repeats 2] [--seed 1] [--kv-blocks 40]

Two CPU engines (tests/real_engine/engines.py: .venv-vllm serving the tiny model, each pinned to
its own core, automatic prefix caching on as vLLM's default, `VLLM_SERVER_DEV_MODE=1` for
POST /reset_prefix_cache, KV cache events published on a Unix socket each) are started once. Their KV is capped at `--kv-blocks` blocks of 128
tokens (`--num-gpu-blocks-override`): room for about half the system prompts' blocks beside the
running requests, so an engine that is sent every prompt evicts what an engine sent half of
them keeps. Each contender then gets a fresh `cacheroute-proxy run` (2 workers, its strategy,
predictor profile vllm-cpu-tiny, an empty affinity index) with an instance agent per engine,
and cold engines: both prefix caches are reset before its load. Contenders: kv_aware and
least_load with the defaults, kv_aware on the engines' own KV cache events
(PROXY_AFFINITY_TOKENIZER = the tiny model, 128-token blocks, PROXY_KV_EVENTS = both
publishers), and with --credit-per-ms kv_aware with that credit.

The same seeded workload goes to each contender: Poisson arrivals for `--duration` s of plain
streaming chats, each a system prompt drawn Zipf(1.1) from SYSTEM_PROMPTS shared ones (~600
tokens of this tokenizer, four full KV blocks and a part) and a distinct user turn, 8 tokens
out. Contenders run in ABBA order when repeated, so a drift of the machine's load hits both.

Per run: from each engine's /metrics before and after, `vllm:prefix_cache_hits_total` and
`vllm:prefix_cache_queries_total` (tokens) -> the hit rate; TTFT p50/p99 (time to the first
chunk of the answer), each engine's share of the requests, errors, and how often kv_aware's
balance guard fired (`affinity_guard` in each answer's `cacheroute_meta.trace`). Everything
started is stopped by pid at the end and the engines' /dev/shm files are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from bench.launch import wait_for
from bench.machine import machine_info, write_report
from bench.stats import percentile
from bench.streamed import stream_chat
from cacheroute_sim.processes import ChildProcess, SupervisorPorts
from tests.real_engine.engines import metric_sum  # the real-engine suite's /metrics reader

SYSTEM_PROMPTS = 24
ZIPF_S = 1.1
MAX_TOKENS = 8
PROFILE = "vllm-cpu-tiny"
WORKERS = 2
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
CONTENDERS = ("kv_aware", "least_load")


@dataclass(frozen=True)
class Contender:
    name: str
    strategy: str
    env: tuple[tuple[str, str], ...] = ()  # proxy settings of this contender alone


ENGINE_EVENTS = "kv_aware engine-events"


def contenders(credit_per_ms: float | None, engines: Sequence[Any] = ()) -> list[Contender]:
    """kv_aware and least_load with the proxy's defaults; kv_aware on the engines' own KV cache
    events (the model's tokenizer in the workers, each engine's publisher followed by the
    sidecar) when `engines` publish them; with `credit_per_ms`, also kv_aware with that
    PROXY_KV_AWARE_CREDIT_PER_MS (the credit's scale against the load score)."""
    from tests.real_engine.engines import TINY_MODEL

    found = [Contender(name, name) for name in CONTENDERS]
    publishing = [(f"vllm-{i}", e.kv_events_endpoint) for i, e in enumerate(engines) if e.kv_events_endpoint]
    if publishing:
        found.append(Contender(ENGINE_EVENTS, "kv_aware", (
            ("PROXY_AFFINITY_TOKENIZER", str(TINY_MODEL)), ("PROXY_AFFINITY_BLOCK_TOKENS", "128"),
            ("PROXY_KV_EVENTS", ",".join(f"{iid}={endpoint}" for iid, endpoint in publishing)))))
    if credit_per_ms is not None:
        found.append(Contender(f"kv_aware credit_per_ms={credit_per_ms:g}", "kv_aware",
                               (("PROXY_KV_AWARE_CREDIT_PER_MS", f"{credit_per_ms:g}"),)))
    return found


# --- the workload (pure) ------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    at_s: float
    system: int
    question: str


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / rank ** s for rank in range(1, count + 1)]


def plan(seed: int, duration_s: float, rate_per_s: float, prompts: int = SYSTEM_PROMPTS) -> list[Planned]:
    """The seeded request sequence: Poisson arrivals, a Zipf-popular system prompt each (popularity
    rank shuffled, so prompt 0 is not always the hot one) and a user turn no other request has."""
    rng = random.Random(seed)
    order = list(range(prompts))
    rng.shuffle(order)
    weights = zipf_weights(prompts, ZIPF_S)
    planned, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return planned
        system = rng.choices(order, weights)[0]
        question = f"Question {len(planned)}-{rng.randrange(10**6)}: what does section " \
                   f"{rng.randint(1, 40)} say about " + " and ".join(rng.sample(TOPICS, rng.randint(1, 4))) + "?"
        planned.append(Planned(t, system, question))


TOPICS = ["harbour tides", "the winter road", "grain prices", "the lighthouse", "bridge tolls",
          "the old mill", "river locks", "ferry times", "the guild hall", "salt works"]


def system_prompt(index: int) -> str:
    """~900 characters, ~600 tokens of the tiny model's tokenizer: 4 full KV blocks of 128 and a
    part. The index leads, so two prompts differ from their first block on."""
    base = (f"System prompt {index}. You are assistant {index} of the shared corpus, volume {index}; "
            f"answer briefly and cite the source. ")
    return (base * (900 // len(base) + 1))[:900]


def body_of(request: Planned) -> dict[str, Any]:
    return {"model": "tiny", "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "system", "content": system_prompt(request.system)},
                         {"role": "user", "content": request.question}]}


# --- vLLM's /metrics (pure) ----------------------------------------------------------------------
def prefix_counters(text: str) -> dict[str, float]:
    """An engine's prefix-cache counters (tokens) from its /metrics text."""
    found = {"hits": metric_sum(text, HITS), "queries": metric_sum(text, QUERIES)}
    missing = [name for name, key in ((HITS, "hits"), (QUERIES, "queries")) if found[key] is None]
    if missing:
        raise RuntimeError(f"/metrics has no {', '.join(missing)}")
    return found  # type: ignore[return-value]


def hit_rate(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Per engine and in all: the prefix-cache hits and queries (tokens) between two readings."""
    per = [{"hits": a["hits"] - b["hits"], "queries": a["queries"] - b["queries"]} for b, a in zip(before, after)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "per_engine": [{**p, "hit_rate": round(p["hits"] / p["queries"], 4) if p["queries"] else None}
                           for p in per]}


# --- one request --------------------------------------------------------------------------------
@dataclass
class Outcome:
    ttft_ms: float | None = None
    instance: str | None = None
    guard: bool | None = None
    credit: float | None = None
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Outcome:
    streamed = await stream_chat(session, url, body)
    outcome = Outcome(streamed.ttft_ms, streamed.instance, error=streamed.error)
    meta = streamed.meta
    if outcome.error is None and meta is None:
        outcome.error = "no cacheroute_meta"
    elif meta is not None:
        outcome.guard = meta["trace"].get("affinity_guard")
        outcome.credit = meta["trace"].get("affinity_credit")
        outcome.error = meta.get("error")
    return outcome


async def drive(url: str, planned: list[Planned]) -> list[Outcome]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=256)) as session:
        begin, tasks = time.monotonic(), []
        for request in planned:
            delay = request.at_s - (time.monotonic() - begin)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, body_of(request))))
        return list(await asyncio.gather(*tasks))


# --- the engines and the proxy ------------------------------------------------------------------
def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _post_json(url: str) -> Any:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())



def reset_prefix_cache(engine_url: str) -> None:
    """vLLM refuses (success false) while blocks are held by running requests: retry a while."""
    wait_for(lambda: _post_json(f"{engine_url}/reset_prefix_cache").get("success") is True, 60,
          f"{engine_url}/reset_prefix_cache")


@contextmanager
def proxy_for(strategy: str, engines: Sequence[Any], log_dir: Path,
              env: dict[str, str]) -> Iterator[SupervisorPorts]:
    """`cacheroute-proxy run` with `strategy` and an instance agent per engine; yields its
    addresses once every worker sees both engines alive. Stopped by pid on the way out."""
    from tests.real_engine.registration import AgentRegistration  # the real-engine suite's agent launcher

    ports = SupervisorPorts(WORKERS, "cacheroute_bench_affv")
    proxy_env = {**ports.supervisor_env(strategy), "PROXY_PREDICTOR_PROFILE": PROFILE, **env}
    supervisor = ChildProcess(["-m", "cacheroute_proxy", "run"], proxy_env, log_dir / f"proxy-{strategy}.log",
                              append_log=True)
    registrations: list[Any] = []
    try:
        for url in (ports.cp_url, *(ports.worker_url(i) for i in range(WORKERS)), ports.dp_url):
            wait_for(lambda url=url: _get_text(f"{url}/healthz") is not None, 30, url)
        registrations = [AgentRegistration(ports.cp_url, engine, f"vllm-{i}", log_dir / f"agent-{i}.log")
                         for i, engine in enumerate(engines)]

        def every_worker_sees_both() -> bool:
            for i in range(WORKERS):
                loads = json.loads(_get_text(f"{ports.worker_url(i)}/debug/instance_loads"))
                if sum(1 for row in loads["instances"] if row["is_alive"]) < len(engines):
                    return False
            return True

        wait_for(every_worker_sees_both, 30, "both engines registered with every worker")
        yield ports
    finally:
        for registration in registrations:
            registration.stop()
        supervisor.stop(signal.SIGINT, 60)


def summarize(strategy: str, outcomes: list[Outcome], counters: dict[str, Any],
              instance_ids: Sequence[str]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None and o.ttft_ms is not None]
    ttft = [o.ttft_ms for o in ok]
    shares = {name: 0 for name in instance_ids}
    for o in ok:
        if o.instance in shares:
            shares[o.instance] += 1
    guards = [o.guard for o in ok if o.guard is not None]
    credits = [o.credit for o in ok if o.credit is not None]
    return {
        "contender": strategy, "requests": len(outcomes), "ok": len(ok),
        "errors": dict(Counter(o.error for o in outcomes if o.error).most_common(5)),
        **counters,
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
        "share": shares,
        "guard_fired": sum(guards), "guard_decisions": len(guards),
        "credited": sum(1 for c in credits if c > 0),
        "credit_p50": round(statistics.median(credits), 4) if credits else None,
    }


def run_contender(contender: Contender, engines: Sequence[Any], planned: list[Planned], log_dir: Path,
                  env: dict[str, str]) -> dict[str, Any]:
    with proxy_for(contender.strategy, engines, log_dir, {**env, **dict(contender.env)}) as ports:
        for engine in engines:
            reset_prefix_cache(engine.url)
        before = [prefix_counters(_get_text(f"{e.url}/metrics")) for e in engines]
        outcomes = asyncio.run(drive(ports.dp_url, planned))
        index = index_account(json.loads(_get_text(f"{ports.cp_url}/debug/status")))
    after = [prefix_counters(_get_text(f"{e.url}/metrics")) for e in engines]
    return {**summarize(contender.name, outcomes, hit_rate(before, after),
                        [f"vllm-{i}" for i in range(len(engines))]), "index": index}


def index_account(status: dict[str, Any]) -> dict[str, Any]:
    """What the sidecar's affinity index heard in a run: the workers' guesses, the engines'
    events, and where each instance's prefix entries came from."""
    affinity = status["event_channel"]["affinity"] or {}
    keys = ("prefix_blocks", "prefix_guesses_ignored", "engine_blocks_stored", "engine_blocks_removed",
            "engine_clears")
    return {**{key: affinity.get(key) for key in keys},
            "prefix_from": {iid: row["prefix_from"] for iid, row in affinity.get("instances", {}).items()},
            "feeds": {iid: {k: feed[k] for k in ("batches", "gaps", "engine_restarts", "block_size")}
                      for iid, feed in (status.get("kv_event_feeds") or {}).items()}}


def schedule(repeats: int, which: Sequence[Any] = CONTENDERS) -> list[Any]:
    """ABBA...: kv_aware, least_load, least_load, kv_aware, ... (ABCCBA with three)."""
    order: list[Any] = []
    for r in range(repeats):
        order += list(which if r % 2 == 0 else reversed(which))
    return order


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender over its runs: hit rate from the summed counters, medians of the TTFTs."""
    out = []
    for strategy in dict.fromkeys(r["contender"] for r in runs):
        mine = [r for r in runs if r["contender"] == strategy]
        if not mine:
            continue
        hits, queries = sum(r["prefix_cache_hits"] for r in mine), sum(r["prefix_cache_queries"] for r in mine)
        share: Counter[str] = Counter()
        for r in mine:
            share.update(r["share"])
        out.append({"contender": strategy, "runs": len(mine),
                    "requests": sum(r["requests"] for r in mine), "ok": sum(r["ok"] for r in mine),
                    "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                    "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
                    "hit_rate_per_run": [r["prefix_cache_hit_rate"] for r in mine],
                    "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine if r["ttft_p50_ms"] is not None),
                    "ttft_p99_ms": statistics.median(r["ttft_p99_ms"] for r in mine if r["ttft_p99_ms"] is not None),
                    "share": dict(share),
                    "guard_fired": sum(r["guard_fired"] for r in mine),
                    "guard_decisions": sum(r["guard_decisions"] for r in mine),
                    "errors": sum(r["requests"] - r["ok"] for r in mine)})
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_affinity_vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity_vllm.json"))
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second, Poisson")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each contender, ABBA order")
    parser.add_argument("--kv-blocks", type=int, default=40, help="each engine's KV blocks (128 tokens each)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--credit-per-ms", type=float, default=None,
                        help="also run kv_aware with this PROXY_KV_AWARE_CREDIT_PER_MS (default 0.001)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a proxy setting for every contender (e.g. PROXY_KV_AWARE_CREDIT_PER_MS=0.01)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tests.real_engine.engines import MAX_MODEL_LEN, MAX_NUM_SEQS, start_engines, stop_engines

    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    machine = machine_info()
    planned = plan(args.seed, args.duration, args.rate)
    env = dict(item.split("=", 1) for item in args.env)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_affinity_vllm_"))
    print(f"{len(planned)} requests per run over {args.duration:g} s; logs in {log_dir}", flush=True)
    engines = start_engines(2, log_dir, extra_args=["--num-gpu-blocks-override", str(args.kv_blocks)],
                            extra_env={"VLLM_SERVER_DEV_MODE": "1"}, kv_events=True)
    runs = []
    try:
        version = json.loads(_get_text(f"{engines[0].url}/version"))["version"]
        for contender in schedule(args.repeats, contenders(args.credit_per_ms, engines)):
            result = run_contender(contender, engines, planned, log_dir, env)
            runs.append(result)
            print(json.dumps(result), flush=True)
    finally:
        stop_engines(engines)
    report = {
        "command": "python -m bench.bench_affinity_vllm " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "duration_s": args.duration, "rate_per_s": args.rate, "repeats": args.repeats,
        "requests_per_run": len(planned), "system_prompts": SYSTEM_PROMPTS, "zipf_s": ZIPF_S,
        "system_prompt_chars": len(system_prompt(0)), "max_tokens": MAX_TOKENS, "workers": WORKERS,
        "profile": PROFILE, "proxy_env": env,
        "engine": {"vllm_version": version, "engines": len(engines), "kv_blocks": args.kv_blocks,
                   "block_size": 128, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                   "engine_cores": [e.cpu for e in engines]},
        "started_at": started_at,
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine, "at_end": {"loadavg": os.getloadavg()}},
        "results": aggregate(runs), "runs": runs, "logs": str(log_dir),
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
