"""kv_aware against least_load and round_robin, and the shared index against per-worker ones.

Run:  python -m bench.bench_affinity --out bench/results/affinity.json [--duration 40] [--seed 1]

Every contender gets a fresh copy of the same stack, all on 127.0.0.1 free ports with a private
segment: a simulated KDN (200 knowledge ids, every one with prebuilt KV, 50..3000 tokens), three
simulated instances (one at half speed) that keep the KV they are given in an LRU of about a
third of the corpus's tokens (`--kv-capacity-tokens`, the same capacity registered to the proxy
as `meta.kv_mem_gb`), cache prompt prefixes (`--prefix-caching`) and report their resident ids
in heartbeats (`--report-resident`), and `cacheroute-proxy run` with the contender's workers,
strategy and affinity view. Everything runs at `--time-scale` (0.05: a 3,000-token prefill takes
~220 ms, its KDN transfer ~130 ms).

The same seeded workload goes to each: bursty arrivals (2 s at the high rate, 2 s at the low
one), 75 % CacheRoute kvcache requests naming 1-3 distinct ids drawn from a Zipf(1.1) popularity
over the 200 ids, 25 % plain OpenAI chats whose system prompt is one of 4 shared ones (Zipf too).
All stream; TTFT is the time to the first chunk of the answer.

Per contender: the resident-hit rate (of the kv-ready ids requested, the share whose KV was
already on the instance that served them: 1 - (ids the instances had the KDN copy in + ids the
proxy believed resident that the instance had evicted) / ids requested), KDN bytes moved, TTFT
p50/p99 (all requests, and knowledge ones alone), the prefix-cache hit rate of the plain
requests' prompt tokens, each instance's share of the requests with their coefficient of
variation, and how often kv_aware's balance guard fired (`affinity_guard` in the trace).
Everything started is stopped, by pid, at the end.

Before the contenders run, the workload is replayed offline against LRU caches of the same
capacity (bench/affinity_ceiling.py): the hit rate of routing at random and of routing to the
instance that holds most of a request's knowledge with no regard for load. Their ratio is about
as far as any affinity can get ahead of load-only routing on this workload.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.affinity_ceiling import ceilings
from bench.launch import wait_for
from bench.machine import machine_info, write_report
from bench.stats import percentile
from bench.streamed import stream_chat
from cacheroute_sim.processes import ChildProcess, SupervisorPorts, free_port

KNOWLEDGE_IDS = 200
ZIPF_S = 1.1
SYSTEM_PROMPTS = 4
INSTANCES = 3
SLOW_FACTOR = 2.0  # instance 0 takes twice as long for everything


@dataclass(frozen=True)
class Contender:
    name: str
    workers: int
    strategy: str
    affinity_view: str = "shared"


CONTENDERS = (
    Contender("kv_aware shared x4", 4, "kv_aware"),
    Contender("kv_aware per_worker x4", 4, "kv_aware", "per_worker"),
    Contender("kv_aware x1", 1, "kv_aware"),
    Contender("least_load x4", 4, "least_load"),
    Contender("round_robin x4", 4, "round_robin"),
)


# --- the workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    at_s: float
    kids: tuple[str, ...] = ()  # knowledge ids (a CacheRoute request), or () for a plain chat
    system: int = 0
    question: str = ""


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, count + 1)]


def plan(seed: int, duration_s: float, high_rate: float, low_rate: float) -> list[Planned]:
    """The seeded request sequence: Poisson arrivals whose rate alternates every 2 s."""
    rng = random.Random(seed)
    ids = [f"k{i:04d}" for i in range(KNOWLEDGE_IDS)]
    rng.shuffle(ids)  # popularity rank -> id, not id order
    weights = zipf_weights(KNOWLEDGE_IDS, ZIPF_S)
    system_weights = zipf_weights(SYSTEM_PROMPTS, ZIPF_S)
    planned, t = [], 0.0
    while True:
        rate = high_rate if int(t // 2) % 2 == 0 else low_rate
        t += rng.expovariate(rate)
        if t >= duration_s:
            return planned
        if rng.random() < 0.75:
            chosen: list[str] = []
            for _ in range(rng.randint(1, 3)):
                kid = rng.choices(ids, weights)[0]
                if kid not in chosen:
                    chosen.append(kid)
            planned.append(Planned(t, tuple(chosen)))
        else:
            planned.append(Planned(t, (), rng.choices(range(SYSTEM_PROMPTS), system_weights)[0],
                                   f"question {rng.randrange(10**6)}: " + "w" * rng.randint(40, 200)))


def system_prompt(index: int) -> str:
    base = f"You are assistant {index} of the shared corpus; answer briefly and cite the source. "
    return base * (1600 // len(base) + 1)  # ~1,600 characters: 6 blocks of 64 tokens


def body_of(request: Planned, kdn_addr: str, tokens: dict[str, int]) -> dict[str, Any]:
    if request.kids:
        return {"Request_ID": 1, "Prompt": {"model": "sim", "user_prompt": "What does it say?",
                                            "token_length": 8, "max_tokens": 8, "stream": True},
                "Service": {"Enable_know_injection": True, "Injection_type": "kvcache",
                            "Knowledge_List": list(request.kids),
                            "Knowledge_length": sum(tokens[k] for k in request.kids)},
                "Task": {"KDN_server_addr": kdn_addr}}
    return {"model": "sim", "stream": True, "max_tokens": 8,
            "messages": [{"role": "system", "content": system_prompt(request.system)},
                         {"role": "user", "content": request.question}]}


# --- one run ------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    knowledge: bool
    ttft_ms: float | None = None
    instance: str | None = None
    kv_ready: int = 0
    resident: int = 0
    guard: bool | None = None
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], knowledge: bool) -> Outcome:
    streamed = await stream_chat(session, url, body)
    outcome = Outcome(knowledge, streamed.ttft_ms, streamed.instance, error=streamed.error)
    meta = streamed.meta
    if meta is not None:
        outcome.kv_ready = len(meta.get("kv_ready_kids") or [])
        outcome.resident = len(meta.get("resident_kids") or [])
        outcome.guard = meta["trace"].get("affinity_guard")
        if meta.get("error"):
            outcome.error = meta["error"]
    return outcome


async def drive(url: str, planned: list[Planned], kdn_addr: str, tokens: dict[str, int]) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=256)) as session:
        begin = time.monotonic()
        tasks = []
        for request in planned:
            delay = request.at_s - (time.monotonic() - begin)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, body_of(request, kdn_addr, tokens),
                                                  bool(request.kids))))
        return list(await asyncio.gather(*tasks))


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _post(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())



@dataclass
class Stack:
    """KDN + three instances + the proxy for one contender; stopped by pid in stop()."""
    contender: Contender
    time_scale: float
    capacity_tokens: int
    log_dir: Path
    processes: list[ChildProcess] = field(default_factory=list)
    ports: SupervisorPorts | None = None
    kdn_addr: str = ""
    instance_urls: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # --env, for every contender

    def start(self) -> None:
        c, scale = self.contender, str(self.time_scale)
        kdn_port = free_port()
        self.kdn_addr = f"127.0.0.1:{kdn_port}"
        self._spawn(["-m", "cacheroute_sim.kdn", "--port", str(kdn_port), "--time-scale", scale,
                     "--kv-ready-ratio", "1", "--knowledge-count", str(KNOWLEDGE_IDS)], "kdn")
        self.ports = ports = SupervisorPorts(c.workers, "cacheroute_bench_aff")
        env = {**ports.supervisor_env(c.strategy), "PROXY_AFFINITY_VIEW": c.affinity_view, **self.extra_env,
               # The capacity each instance registers (meta.kv_mem_gb) is in tokens x 1 MB.
               "PROXY_AFFINITY_KV_MB_PER_TOKEN": "1", "PROXY_PREDICTOR_PROFILE": "sim"}
        self._spawn(["-m", "cacheroute_proxy", "run"], "proxy", env)
        wait_for(lambda: _get(f"{self.kdn_url}/healthz") is not None, 30, "kdn")
        wait_for(lambda: all(_get(f"{ports.worker_url(i)}/healthz")["ok"] for i in range(c.workers)),
              60, "workers")
        for i in range(INSTANCES):
            port = free_port()
            self.instance_urls.append(f"http://127.0.0.1:{port}")
            self._spawn(["-m", "cacheroute_sim.instance", "--host", "127.0.0.1", "--port", str(port),
                         "--instance-id", f"inst-{i}", "--proxy-cp-url", ports.cp_url,
                         "--time-scale", scale, "--slow-factor", str(SLOW_FACTOR if i == 0 else 1.0),
                         "--kv-capacity-tokens", str(self.capacity_tokens),
                         "--kv-mem-gb", str(self.capacity_tokens / 1024),
                         "--prefix-caching", "--report-resident", "--heartbeat-interval", "2",
                         "--default-max-tokens", "8"], f"inst-{i}")
        wait_for(lambda: sum(r["is_alive"] for r in _get(f"{ports.cp_url}/debug/instance_loads")["instances"])
              == INSTANCES, 30, "instances registered")

    @property
    def kdn_url(self) -> str:
        return f"http://{self.kdn_addr}"

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.processes.append(ChildProcess(argv, env or {}, self.log_dir / f"{name}.log"))

    def stop(self) -> None:
        for process in reversed(self.processes):  # instances, proxy, KDN
            process.stop(signal.SIGINT if process is self.processes[1] else signal.SIGTERM, 45)


def corpus_tokens(kdn_url: str) -> dict[str, int]:
    found = _post(f"{kdn_url}/knowledge/search/text",
                  {"knowledge_ids": [f"k{i:04d}" for i in range(KNOWLEDGE_IDS)], "need_fields": ["length"]})
    return {item["id"]: max(1, math.ceil(item["length"] / 4)) for item in found["items"]}


def summarize(contender: Contender, outcomes: list[Outcome], stack: Stack,
              planned: list[Planned]) -> dict[str, Any]:
    instances = [_get(f"{url}/sim/stats") for url in stack.instance_urls]
    kdn = _get(f"{stack.kdn_url}/sim/stats")
    ok = [o for o in outcomes if o.error is None and o.ttft_ms is not None]
    ttft = [o.ttft_ms for o in ok]
    knowledge_ttft = [o.ttft_ms for o in ok if o.knowledge]
    requested = sum(o.kv_ready for o in ok if o.knowledge)
    pulled = sum(s["kv_inject_pulled_ids"] for s in instances)
    believed_but_gone = sum(s["kv_resident_misses"] for s in instances)
    # The first request for an id misses wherever it goes: no strategy can avoid those.
    compulsory = len({k for p in planned for k in p.kids})
    misses = pulled + believed_but_gone
    shares = {f"inst-{i}": 0 for i in range(INSTANCES)}
    for o in ok:
        if o.instance in shares:
            shares[o.instance] += 1
    counts = list(shares.values())
    mean = statistics.fmean(counts) if counts else 0.0
    queries = sum(s["prefix_cache_queries"] for s in instances)
    guards = [o.guard for o in ok if o.guard is not None]
    return {
        "contender": contender.name, "workers": contender.workers, "strategy": contender.strategy,
        "affinity_view": contender.affinity_view,
        "requests": len(outcomes), "ok": len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "kv_ids_requested": requested, "kv_ids_pulled": pulled,
        "kv_ids_believed_resident_but_evicted": believed_but_gone,
        "resident_hit_rate": round(1 - misses / requested, 4) if requested else None,
        "compulsory_misses": compulsory,
        "hit_rate_bound": round(1 - compulsory / requested, 4) if requested else None,
        "avoidable_hit_rate": round(1 - (misses - compulsory) / (requested - compulsory), 4)
        if requested > compulsory else None,
        "proxy_skipped_ids": sum(o.resident for o in ok),
        "kdn_bytes": kdn["payload_bytes"], "kdn_injects": kdn["injects"],
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
        "knowledge_ttft_p50_ms": round(percentile(knowledge_ttft, 0.5), 1) if knowledge_ttft else None,
        "knowledge_ttft_p99_ms": round(percentile(knowledge_ttft, 0.99), 1) if knowledge_ttft else None,
        "prefix_cache_hit_rate": round(sum(s["prefix_cache_hits"] for s in instances) / queries, 4)
        if queries else None,
        "share": shares,
        "share_cv": round(statistics.pstdev(counts) / mean, 4) if mean else None,
        "max_share_over_mean": round(max(counts) / mean, 3) if mean else None,
        "kv_evictions": sum(s["kv_evictions"] for s in instances),
        "guard_fired": sum(guards), "guard_decisions": len(guards),
    }


def run_one(contender: Contender, args: argparse.Namespace, planned: list[Planned]) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    # A third of the corpus's tokens per instance (the corpus is the same for every contender).
    stack = Stack(contender, args.time_scale, args.capacity_tokens, log_dir,
                  extra_env=dict(item.split("=", 1) for item in args.env))
    try:
        stack.start()
        tokens = corpus_tokens(stack.kdn_url)
        outcomes = asyncio.run(drive(stack.ports.dp_url, planned, stack.kdn_addr, tokens))  # type: ignore[union-attr]
        time.sleep(0.5)
        result = summarize(contender, outcomes, stack, planned)
        result["logs"] = str(log_dir)
        return result
    finally:
        stack.stop()


def capacity_for(time_scale: float, share: float) -> tuple[int, dict[str, int]]:
    """`share` of the corpus's tokens, measured on a KDN of the same seed, and the tokens of
    each id."""
    port = free_port()
    kdn = ChildProcess(["-m", "cacheroute_sim.kdn", "--port", str(port), "--time-scale", str(time_scale),
                        "--kv-ready-ratio", "1", "--knowledge-count", str(KNOWLEDGE_IDS)], {},
                       Path(tempfile.mkdtemp(prefix="bench-affinity-kdn-")) / "kdn.log")
    try:
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz") is not None, 30, "kdn")
        tokens = corpus_tokens(f"http://127.0.0.1:{port}")
        return int(sum(tokens.values()) * share), tokens
    finally:
        kdn.stop(signal.SIGTERM, 10)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity.json"))
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load per contender")
    parser.add_argument("--high-rate", type=float, default=14.0, help="requests/s in a burst")
    parser.add_argument("--low-rate", type=float, default=3.0, help="requests/s between bursts")
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--capacity-share", type=float, default=1 / 3,
                        help="the share of the corpus's tokens each instance's KV holds (1/3: the "
                             "three together hold it all; 1/9: together a third)")
    parser.add_argument("--only", default=None, help="run only the contenders whose name contains this")
    parser.add_argument("--replay-only", action="store_true",
                        help="print the offline replay of the workload (seconds) and stop: no load, no results file")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a proxy setting for every contender (e.g. PROXY_KV_AWARE_CREDIT_PER_MS=0.003)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    machine = machine_info()
    planned = plan(args.seed, args.duration, args.high_rate, args.low_rate)
    if not 0 < args.capacity_share <= 1:
        raise SystemExit("--capacity-share must be in (0, 1]")
    args.capacity_tokens, tokens = capacity_for(args.time_scale, args.capacity_share)
    ceiling = ceilings([p.kids for p in planned if p.kids], tokens, args.capacity_tokens, INSTANCES)
    print(f"{len(planned)} requests over {args.duration:g}s; instance KV capacity "
          f"{args.capacity_tokens} tokens ({args.capacity_share:.3f} of the corpus); replayed "
          f"without load: {json.dumps(ceiling)}", flush=True)
    if args.replay_only:
        return 0
    results = []
    for contender in CONTENDERS:
        if args.only and args.only not in contender.name:
            continue
        result = run_one(contender, args, planned)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "logs"}), flush=True)
    report = {"command": "python -m bench.bench_affinity " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seed": args.seed, "duration_s": args.duration, "time_scale": args.time_scale,
              "requests": len(planned), "capacity_tokens": args.capacity_tokens,
              "capacity_share": round(args.capacity_share, 4),
              "knowledge_ids": KNOWLEDGE_IDS, "zipf_s": ZIPF_S, "instances": INSTANCES,
              "slow_factor": SLOW_FACTOR, "replayed_without_load": ceiling, "proxy_env": dict(item.split("=", 1) for item in args.env),
              "started_at": started_at,
              "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine, "results": results}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
