"""kv_aware against least_load and round_robin, and the shared index against per-worker ones, on
simulated instances whose KV holds part of the knowledge a KDN serves.

Run:  python -m bench.bench_affinity --out bench/results/affinity.json [--workload knowledge64]
      [--requests 1500] [--load 0.6] [--seed 1]

Every contender gets a fresh copy of the same stack, all on 127.0.0.1 free ports with a private
segment: a simulated KDN (every id with prebuilt KV), three simulated instances (one at half
speed) that keep the KV they are given in an LRU of `capacity_share` of the corpus's tokens (the
same capacity registered to the proxy as `meta.kv_mem_gb`), cache prompt prefixes and report
their resident ids in heartbeats, and `cacheroute-proxy run` with the contender's workers,
strategy and affinity view. Everything runs at `--time-scale` (0.05).

Load is calibrated first: a closed loop of CALIBRATION_CONCURRENCY streams through least_load
(4 workers) on a stack of its own measures the saturation throughput; the measured run then
offers `--load` of it on average, in bursts (BURST_S at `burst[0]` x the mean, then BURST_S at
`burst[1]` x), Poisson within each. The same seeded sequence goes to every contender.

Workloads (WORKLOADS): `knowledge64`, the targets' workload: 64 knowledge ids, one per request,
drawn Zipf(0.6); each instance holds 0.4 of the ids' KV. `mixed200`: 75 % kvcache requests
naming 1-3 of 200 ids drawn Zipf(1.1), 25 % plain chats over 4 shared system prompts; each
instance holds a third of the corpus.

Per contender: the resident-hit rate (of the kv-ready ids requested, the share whose KV was
already on the instance that served them: 1 - (ids the instances had the KDN copy in + ids the
proxy believed resident that the instance had evicted) / ids requested), KDN bytes moved, TTFT
p50/p99 (the first chunk of the answer), each instance's share of the requests against its
fair share by speed, and how kv_aware decided (its guard, its predicted saving). Before the
contenders run, the workload is replayed offline against LRU caches of the same capacity
(bench/affinity_ceiling.py): routing to the holder with no regard for load is the ceiling
affinity can reach. Everything started is stopped, by pid, at the end.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.harness.cli import name_values, stop_on_sigterm
from bench.harness.processes import wait_for
from bench.harness.results import machine_info, run_record, utc_now, write_report
from bench.harness.ab import interleaved
from bench.harness.stats import percentile
from bench.harness.arrivals import closed_loop, open_loop
from bench.harness.streamed import proxy_account, stream_chat
from cacheroute_sim.processes import ChildProcess, SupervisorPorts, free_port, free_port_pair

SYSTEM_PROMPTS = 4
INSTANCES = 3
SLOW_FACTOR = 2.0  # instance 0 takes twice as long for everything
BURST_S = 2.0
CALIBRATION_CONCURRENCY = 48  # streams in flight: twice what the three instances run at once
CALIBRATION_S = 15.0
SIM_KDN_BANDWIDTH_MBPS = 1000.0  # cacheroute_sim.kdn's default link, at time scale 1


@dataclass(frozen=True)
class Workload:
    name: str
    knowledge_ids: int
    zipf_s: float
    kids_per_request: tuple[int, int]  # how many distinct ids a knowledge request names
    plain_share: float  # of the requests, plain chats over SYSTEM_PROMPTS shared system prompts
    capacity_share: float  # of the corpus's tokens, each instance's KV
    burst: tuple[float, float] = (1.65, 0.35)  # x the mean rate, BURST_S each


WORKLOADS = {w.name: w for w in (
    Workload("knowledge64", 64, 0.6, (1, 1), 0.0, 0.4),
    Workload("mixed200", 200, 1.1, (1, 3), 0.25, 1 / 3),
)}


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
CALIBRATION = CONTENDERS[3]


# --- the workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    at_s: float
    kids: tuple[str, ...] = ()  # knowledge ids (a CacheRoute request), or () for a plain chat
    system: int = 0
    question: str = ""


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, count + 1)]


def requests_of(workload: Workload, rng: random.Random) -> Any:
    """An endless seeded stream of (kids, system, question), popularity rank shuffled over ids."""
    ids = [f"k{i:04d}" for i in range(workload.knowledge_ids)]
    rng.shuffle(ids)  # popularity rank -> id, not id order
    weights = zipf_weights(workload.knowledge_ids, workload.zipf_s)
    system_weights = zipf_weights(SYSTEM_PROMPTS, 1.1)
    low, high = workload.kids_per_request
    while True:
        if rng.random() >= workload.plain_share:
            chosen: list[str] = []
            for _ in range(rng.randint(low, high)):
                kid = rng.choices(ids, weights)[0]
                if kid not in chosen:
                    chosen.append(kid)
            yield tuple(chosen), 0, ""
        else:
            yield (), rng.choices(range(SYSTEM_PROMPTS), system_weights)[0], \
                f"question {rng.randrange(10**6)}: " + "w" * rng.randint(40, 200)


def plan(workload: Workload, seed: int, count: int, mean_rate: float) -> list[Planned]:
    """`count` requests, Poisson arrivals whose rate alternates every BURST_S between
    burst[0] and burst[1] x `mean_rate`."""
    rng = random.Random(seed)
    stream = requests_of(workload, rng)
    high, low = (factor * mean_rate for factor in workload.burst)
    planned, t = [], 0.0
    while len(planned) < count:
        t += rng.expovariate(high if int(t // BURST_S) % 2 == 0 else low)
        kids, system, question = next(stream)
        planned.append(Planned(t, kids, system, question))
    return planned


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


# --- driving it -----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    knowledge: bool
    ttft_ms: float | None = None
    instance: str | None = None
    kv_ready: int = 0
    resident: int = 0
    guard: bool | None = None
    saved_ms: float | None = None
    ended_at: float | None = None  # time.monotonic() when the answer ended
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], knowledge: bool) -> Outcome:
    streamed = await stream_chat(session, url, body)
    account = proxy_account(streamed.meta)
    outcome = Outcome(knowledge, streamed.ttft_ms, streamed.instance, guard=account.guard,
                      saved_ms=account.saved_ms, ended_at=streamed.ended_at, error=streamed.error)
    meta = streamed.meta
    if meta is not None:
        outcome.kv_ready = len(meta.get("kv_ready_kids") or [])
        outcome.resident = len(meta.get("resident_kids") or [])
        if meta.get("error"):
            outcome.error = meta["error"]
    return outcome


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                 connector=aiohttp.TCPConnector(limit=512))


async def drive(url: str, planned: list[Planned], kdn_addr: str, tokens: dict[str, int]) -> list[Outcome]:
    """Open loop: each request at its planned time, whatever the others are doing."""
    async with _session() as session:
        return await open_loop(((p.at_s, p) for p in planned), lambda request: _one(
            session, url, body_of(request, kdn_addr, tokens), bool(request.kids)))


async def closed_loop_rate(url: str, workload: Workload, seed: int, kdn_addr: str, tokens: dict[str, int],
                           concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` streams back to back for `seconds` (the first BURST_S warm up, uncounted):
    completed requests a second."""
    begin = time.monotonic()
    async with _session() as session:
        outcomes = await closed_loop(requests_of(workload, random.Random(seed)), concurrency,
                                     lambda request: _one(session, url, body_of(Planned(0.0, *request), kdn_addr,
                                                                                 tokens), bool(request[0])),
                                     seconds)
    counted = [o for o in outcomes if o.error is None and o.ended_at is not None
               and BURST_S <= o.ended_at - begin <= seconds]
    return {"concurrency": concurrency, "seconds": seconds, "completed": len(counted),
            "errors": sum(1 for o in outcomes if o.error is not None),
            "saturation_rps": round(len(counted) / (seconds - BURST_S), 2)}


# --- the stack ------------------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _post(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _kdn_argv(port: int, time_scale: float, workload: Workload) -> list[str]:
    return ["-m", "cacheroute_sim.kdn", "--port", str(port), "--time-scale", str(time_scale),
            "--kv-ready-ratio", "1", "--knowledge-count", str(workload.knowledge_ids)]


@dataclass
class Stack:
    """KDN + three instances + the proxy for one contender; stopped by pid in stop()."""
    contender: Contender
    workload: Workload
    time_scale: float
    capacity_tokens: int
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)  # --env, for every contender
    processes: list[ChildProcess] = field(default_factory=list)
    ports: SupervisorPorts | None = None
    kdn_addr: str = ""
    instance_urls: list[str] = field(default_factory=list)

    def start(self) -> None:
        c, scale = self.contender, str(self.time_scale)
        kdn_port = free_port()
        self.kdn_addr = f"127.0.0.1:{kdn_port}"
        self._spawn(_kdn_argv(kdn_port, self.time_scale, self.workload), "kdn")
        self.ports = ports = SupervisorPorts(c.workers, "cacheroute_bench_aff")
        env = {**ports.supervisor_env(c.strategy), "PROXY_AFFINITY_VIEW": c.affinity_view, **self.extra_env,
               # The capacity each instance registers (meta.kv_mem_gb) is in tokens x 1 MB.
               "PROXY_AFFINITY_KV_MB_PER_TOKEN": "1", "PROXY_PREDICTOR_PROFILE": "sim",
               # The simulated KDN link: its bandwidth, as fast as the time scale makes it.
               "KDN_DEFAULT_BANDWIDTH_MBPS": f"{SIM_KDN_BANDWIDTH_MBPS / self.time_scale:g}"}
        self._spawn(["-m", "cacheroute_proxy", "run"], "proxy", env)
        wait_for(lambda: _get(f"{self.kdn_url}/healthz") is not None, 30, "kdn")
        wait_for(lambda: all(_get(f"{ports.worker_url(i)}/healthz")["ok"] for i in range(c.workers)),
                 60, "workers")
        for i in range(INSTANCES):
            port = free_port_pair()  # and its control plane's, port + 1
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


def corpus_tokens(kdn_url: str, workload: Workload) -> dict[str, int]:
    found = _post(f"{kdn_url}/knowledge/search/text",
                  {"knowledge_ids": [f"k{i:04d}" for i in range(workload.knowledge_ids)], "need_fields": ["length"]})
    return {item["id"]: max(1, math.ceil(item["length"] / 4)) for item in found["items"]}


def capacity_for(workload: Workload, time_scale: float) -> tuple[int, dict[str, int]]:
    """The workload's share of the corpus's tokens, measured on a KDN of the same seed, and the
    tokens of each id."""
    port = free_port()
    kdn = ChildProcess(_kdn_argv(port, time_scale, workload), {},
                       Path(tempfile.mkdtemp(prefix="bench-affinity-kdn-")) / "kdn.log")
    try:
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz") is not None, 30, "kdn")
        tokens = corpus_tokens(f"http://127.0.0.1:{port}", workload)
        return int(sum(tokens.values()) * workload.capacity_share), tokens
    finally:
        kdn.stop(signal.SIGTERM, 10)


# --- one contender ----------------------------------------------------------------------------------------
def fair_shares() -> dict[str, float]:
    """Each instance's share of the work by its speed (instance 0 runs at 1 / SLOW_FACTOR)."""
    speeds = {f"inst-{i}": (1 / SLOW_FACTOR if i == 0 else 1.0) for i in range(INSTANCES)}
    return {name: speed / sum(speeds.values()) for name, speed in speeds.items()}


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
    fair = fair_shares()
    queries = sum(s["prefix_cache_queries"] for s in instances)
    guards = [o.guard for o in ok if o.guard is not None]
    saved = [o.saved_ms for o in ok if o.saved_ms is not None]
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
        "proxy_skipped_ids": sum(o.resident for o in ok),
        "kdn_bytes": kdn["payload_bytes"], "kdn_injects": kdn["injects"],
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
        "knowledge_ttft_p50_ms": round(percentile(knowledge_ttft, 0.5), 1) if knowledge_ttft else None,
        "knowledge_ttft_p99_ms": round(percentile(knowledge_ttft, 0.99), 1) if knowledge_ttft else None,
        "prefix_cache_hit_rate": round(sum(s["prefix_cache_hits"] for s in instances) / queries, 4)
        if queries else None,
        "share": shares,
        "max_share_over_fair": round(max(shares[n] / (fair[n] * len(ok)) for n in shares), 3) if ok else None,
        "kv_evictions": sum(s["kv_evictions"] for s in instances),
        "guard_fired": sum(guards), "guard_decisions": len(guards),
        "saved_ms_p50": round(statistics.median(saved), 1) if saved else None,
    }


def _stack(contender: Contender, args: argparse.Namespace, workload: Workload) -> Stack:
    return Stack(contender, workload, args.time_scale, args.capacity_tokens,
                 Path(tempfile.mkdtemp(prefix="bench-affinity-")),
                 extra_env=name_values(args.env))


def calibrate(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    stack = _stack(CALIBRATION, args, workload)
    try:
        stack.start()
        tokens = corpus_tokens(stack.kdn_url, workload)
        return {"contender": CALIBRATION.name, **asyncio.run(closed_loop_rate(
            stack.ports.dp_url, workload, args.seed + 1000, stack.kdn_addr, tokens,  # type: ignore[union-attr]
            CALIBRATION_CONCURRENCY, args.calibration_s))}
    finally:
        stack.stop()


def run_one(contender: Contender, args: argparse.Namespace, workload: Workload,
            planned: list[Planned]) -> dict[str, Any]:
    stack = _stack(contender, args, workload)
    try:
        stack.start()
        tokens = corpus_tokens(stack.kdn_url, workload)
        outcomes = asyncio.run(drive(stack.ports.dp_url, planned, stack.kdn_addr, tokens))  # type: ignore[union-attr]
        time.sleep(0.5)
        return {**summarize(contender, outcomes, stack, planned), "logs": str(stack.log_dir)}
    finally:
        stack.stop()


# --- main -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_affinity", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity.json"))
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="knowledge64")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--load", type=float, default=0.6, help="mean offered load, a share of saturation")
    parser.add_argument("--saturation-rps", type=float, default=None,
                        help="skip the calibration and take this saturation throughput")
    parser.add_argument("--calibration-s", type=float, default=CALIBRATION_S)
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each contender, interleaved (each round reverses the one before); "
                             "the report shows their medians")
    parser.add_argument("--only", default=None, help="run only the contenders whose name contains this")
    parser.add_argument("--replay-only", action="store_true",
                        help="print the offline replay of the workload and stop: no load, no results file")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a proxy setting for every contender (e.g. PROXY_KV_AWARE_BALANCE_ABS=16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()  # a timeout or kill unwinds through every `with`: what it started stops
    started_at, machine = utc_now(), machine_info()
    workload = WORKLOADS[args.workload]
    if not 0 < args.load <= 1:
        raise SystemExit("--load must be in (0, 1]")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    args.capacity_tokens, tokens = capacity_for(workload, args.time_scale)
    replay = plan(workload, args.seed, args.requests, 1.0)
    ceiling = ceilings([p.kids for p in replay if p.kids], tokens, args.capacity_tokens, INSTANCES)
    print(f"{workload.name}: {args.requests} requests; instance KV capacity {args.capacity_tokens} tokens "
          f"({workload.capacity_share:.3f} of the corpus); replayed without load: {json.dumps(ceiling)}", flush=True)
    if args.replay_only:
        return 0
    calibration = ({"given_saturation_rps": args.saturation_rps} if args.saturation_rps
                   else calibrate(args, workload))
    saturation = args.saturation_rps or calibration["saturation_rps"]
    mean_rate = args.load * saturation
    planned = plan(workload, args.seed, args.requests, mean_rate)
    print(f"saturation {saturation:g} req/s ({json.dumps(calibration)}); offering {mean_rate:.2f} req/s "
          f"on average over {planned[-1].at_s:.0f} s", flush=True)
    chosen = {c.name: c for c in CONTENDERS if not args.only or args.only in c.name}
    results = []
    for round_index, name in interleaved(list(chosen), args.repeats):
        result = {**run_one(chosen[name], args, workload, planned), "run": round_index}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "logs"}), flush=True)
    report = {**run_record("bench.bench_affinity", argv, started_at, machine),
              "workload": {"name": workload.name, "knowledge_ids": workload.knowledge_ids,
                           "zipf_s": workload.zipf_s, "kids_per_request": list(workload.kids_per_request),
                           "plain_share": workload.plain_share, "capacity_share": round(workload.capacity_share, 4),
                           "burst": list(workload.burst), "burst_s": BURST_S},
              "seed": args.seed, "requests": len(planned), "time_scale": args.time_scale,
              "load": args.load, "calibration": calibration, "saturation_rps": saturation,
              "mean_rate_rps": round(mean_rate, 3), "duration_s": round(planned[-1].at_s, 1),
              "capacity_tokens": args.capacity_tokens, "instances": INSTANCES, "slow_factor": SLOW_FACTOR,
              "fair_share": fair_shares(), "replayed_without_load": ceiling,
              "proxy_env": name_values(args.env), "repeats": args.repeats, "results": results}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
