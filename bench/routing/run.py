"""Orchestration: instances once, then for each repeat every contender in a rotated order --
start it, warm it up, replay the schedule while sampling, stop it -- and the results JSON."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import psutil

from bench.harness.backends import SimInstances
from bench.harness.cli import Progress
from bench.harness.contenders import Contender, ProxyContender, rotated
from bench.harness.cpu import charged
from bench.harness.processes import StartError, http_json
from bench.harness.results import Run, tool_versions
from bench.routing import summary, uncertainty
from bench.routing.client import run_schedule
from bench.routing.sampler import InflightSampler
from bench.routing.scenario import ContenderDef, Scenario
from bench.routing.schedule import Arrival, ScheduleSpec, build_schedule, offered_load

CHAT_PATH = "/v1/chat/completions"
IDLE_TIMEOUT_S = 120.0


log = Progress()


def run_benchmark(scenario: Scenario, defs: list[ContenderDef], repeats: int,
                  provenance: Run) -> dict[str, Any]:
    arrivals = build_schedule(scenario.schedule)
    labels = scenario.instance_labels()
    runs: dict[str, list[dict[str, Any]]] = {d.name: [] for d in defs}
    log(f"{len(arrivals)} arrivals over {scenario.schedule.duration_s:.0f} s; "
        f"{len(defs)} contenders x {repeats} repeats")
    with SimInstances(scenario.instance_specs(), time_scale=scenario.time_scale) as instances:
        for repeat in range(repeats):
            for position, cdef in enumerate(rotated(defs, repeat)):
                log(f"repeat {repeat + 1}/{repeats}: {cdef.name}")
                try:
                    run = measure(cdef, instances, arrivals, scenario, labels)
                except StartError as exc:
                    # One contender that does not come up must not lose the others' runs.
                    log(f"  did not start: {str(exc).splitlines()[0]}")
                    runs[cdef.name].append({"repeat": repeat, "position": position,
                                            "start_error": str(exc)[-2000:]})
                    continue
                run.update(repeat=repeat, position=position)
                runs[cdef.name].append(run)
                log(f"  TTFT p50 {run['ttft_p50_ms']} ms, p99 {run['ttft_p99_ms']} ms; "
                    f"share {_fmt_share(run['share'])}; spread mean {run['inflight_spread_mean']}; "
                    f"errors {run['errors']}; worker CPU peak {run['worker_cpu_peak']}")
    return assemble(scenario, defs, runs, labels, arrivals, repeats, provenance)


def _fmt_share(share: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in share.items())


def measure(cdef: ContenderDef, instances: SimInstances, arrivals: list[Arrival],
            scenario: Scenario, labels: list[str]) -> dict[str, Any]:
    with cdef.make(instances) as contender:
        url = contender.url + CHAT_PATH
        asyncio.run(run_schedule(url, warmup_schedule(), drain_timeout_s=60))
        wait_idle(instances)
        for i in range(len(instances.urls)):
            instances.reset_stats(i)
        workers = worker_pids(contender)
        with InflightSampler(instances.urls, workers) as sampler:
            spent = charged(contender, lambda: {"results": asyncio.run(
                run_schedule(url, arrivals, scenario.drain_timeout_s))})
        totals = [int(instances.stats(i)["total"]) for i in range(len(instances.urls))]
    results, window, cpu = spent["results"], spent["wall_s"], spent["cpu_s"]
    samples = sampler.samples
    in_window = arrival_window(samples, scenario.schedule)
    return {**summary.summarize_requests(results, dict(zip(instances.ids, labels, strict=True))),
            **summary.summarize_samples(samples, in_window),
            **summary.instance_shares(totals, labels),
            "window_s": round(window, 2), "contender_cpu_s": round(cpu, 3),
            "contender_cpu_util": round(cpu / window, 3), "contender_rss_mb": spent["rss_mb"],
            "worker_pids": workers, "loadavg_after": [round(x, 2) for x in psutil.getloadavg()]}


def arrival_window(samples: Any, spec: ScheduleSpec) -> int:
    """How many leading samples fall inside the arrival window (the drain after it is kept in
    the series for the plot but left out of the spread statistics)."""
    return sum(1 for t in samples.times_s if t <= spec.duration_s)


def warmup_schedule() -> list[Arrival]:
    """A few tiny streams, spread over every worker (new connection each), to open pools."""
    return [Arrival(at_s=0.05 * i, burst=0, prompt_tokens=8, max_tokens=2) for i in range(12)]


def wait_idle(instances: SimInstances) -> None:
    """Until no instance has anything in flight (the warm-up, or a previous contender's tail)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(instances.stats(i)["inflight"] == 0 for i in range(len(instances.urls))):
            return
        time.sleep(0.1)
    raise RuntimeError(f"instances still busy after {IDLE_TIMEOUT_S:.0f} s")


def worker_pids(contender: Contender) -> list[int]:
    """The proxy's workers (each answers /healthz with its pid) or nginx's worker processes."""
    if isinstance(contender, ProxyContender):
        pids = []
        for i in range(contender.supervisor.workers):
            status, body = http_json("GET", f"{contender.supervisor.worker_url(i)}/healthz")
            if status == 200 and isinstance(body, dict):
                pids.append(int(body["pid"]))
        return pids
    return [p.pid for root in contender.pids() for p in psutil.Process(root).children()]


def assemble(scenario: Scenario, defs: list[ContenderDef], runs: dict[str, list[dict[str, Any]]],
             labels: list[str], arrivals: list[Arrival], repeats: int, provenance: Run) -> dict[str, Any]:
    contenders = [{**d.describe(), "runs": runs[d.name]} for d in defs]
    return {
        **provenance.record(),
        "versions": tool_versions(("aiohttp", "uvicorn", "uvloop", "psutil", "msgspec"),
                                  (("nginx", "-v"),)),
        "method": method(scenario, arrivals, repeats),
        "scenario": scenario.describe(), "instance_labels": labels,
        "offered_load": offered_load(arrivals, scenario.schedule.duration_s),
        **derived(contenders, labels),
    }


def derived(contenders: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Everything computed from the runs (a results file can be re-analysed from its runs)."""
    contenders = [{**c, "median": summary.medians(c["runs"], labels)} for c in contenders]
    return {
        "contenders": contenders,
        "ratios_to_nginx": summary.ratios_to_nginx(contenders),
        "checks": summary.checks(contenders),
        "validity": summary.validity(contenders),
        "uncertainty": uncertainty.intervals(contenders),
        "notes": notes(contenders),
    }


def reanalysed(results: dict[str, Any]) -> dict[str, Any]:
    """A results file's derived figures recomputed by this code from its raw runs."""
    return {**results, **derived(results["contenders"], results["instance_labels"])}


def method(scenario: Scenario, arrivals: list[Arrival], repeats: int) -> dict[str, Any]:
    return {
        "claim": "N workers sharing one load table route like one process that sees everything: "
                 "4 workers least_load (shared) keep TTFT p99 within 10 % of 1 worker least_load, "
                 "and beat per-worker views and round_robin",
        "why_this_scenario": "a slow instance with fewer slots is where routing matters (requests "
                             "sent to it while its slots are full wait for a slot), and bursts "
                             "land on several workers at once, where views that miss the other "
                             "workers' requests pile onto the same instance; the offered load is "
                             "moderate so that the 1-worker reference is not CPU-bound "
                             "(its worker CPU is recorded)",
        "repeats": repeats,
        "interleaving": "for each repeat every contender once, order rotated by one per repeat",
        "contender_lifecycle": "started fresh for each run, warmed up with 12 tiny streams, "
                               "instances idle and their stats reset, then measured, then stopped",
        "schedule": "open loop: bursts with Poisson (exponential) gaps, all requests of a burst "
                    "fired at once, seeded; the same list for every contender and repeat",
        "client": "asyncio + aiohttp, one new connection per request (SO_REUSEPORT spreads them "
                  "over workers), streaming chat requests; TTFT = send to first content chunk",
        "share": "requests counted by each instance itself (/sim/stats total, reset before a run)",
        "inflight_spread": "each instance's own inflight gauge (/sim/stats) sampled every 50 ms "
                           "from a separate thread; spread = max - min per sample; mean and p95 "
                           "over the arrival window",
        "cpu": "contender = user+sys over its process tree for the window; worker = per-process "
               "utilisation over ~1 s intervals, peak reported",
        "percentiles": "nearest rank",
        "medians": "median over repeats of each run's figure",
        "pinning": "none (not measured to help)",
        "requests_per_run": len(arrivals),
    }


def notes(contenders: list[dict[str, Any]]) -> list[str]:
    out = []
    for c in contenders:
        failed = [r["repeat"] for r in c["runs"] if "start_error" in r]
        if failed:
            out.append(f"{c['name']}: did not start in repeat(s) {failed} (see start_error in its runs)")
        late = [r["client_late_p99_ms"] for r in c["runs"] if r.get("client_late_p99_ms") is not None]
        if late and statistics.median(late) > 20:
            out.append(f"{c['name']}: the client fired arrivals late (p99 {statistics.median(late):.0f} ms): "
                       "the machine was busy; treat its figures with care")
    return out
