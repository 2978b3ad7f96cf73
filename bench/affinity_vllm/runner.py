"""One benchmark: the engines once, the calibration, then at each load every contender's runs
in ABC…CBA order, each on a fresh contender over engines whose prefix caches were just reset."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.harness.contenders import Contender
from bench.harness.processes import StartError
from tests.real_engine.engines import VllmEngine

from . import contenders, engine_side, figures, load
from .workload import Planned


@dataclass(frozen=True)
class Setup:
    """What every run shares."""
    engines: Sequence[VllmEngine]
    prompts: Sequence[str]
    max_tokens: int
    log_dir: Path
    proxy_env: dict[str, str]
    kv_aware_env: dict[str, str]
    variants: Sequence[contenders.Spec] = ()  # --variant: kv_aware with other settings
    outcomes_dir: Path | None = None  # --outcomes: each run's requests, a file a run


WARM_UP_REQUESTS = 150


def schedule(names: Sequence[str], repeats: int, start: int = 0) -> list[str]:
    """ABC…CBA: the contenders in order, then reversed, and so on, so a drift of the machine's
    load over the runs falls on every contender alike; from the contender at `start` (the load's
    index), so the first and last runs of a load, after its warm-up and at the end of the run,
    are not always the same contender's."""
    first = start % len(names) if names else 0
    rotated = list(names[first:]) + list(names[:first])
    order: list[str] = []
    for r in range(repeats):
        order += rotated if r % 2 == 0 else rotated[::-1]
    return order


def _contender(spec: contenders.Spec, setup: Setup) -> Contender:
    return contenders.build(spec, setup.engines, setup.log_dir, setup.proxy_env, setup.kv_aware_env)


def calibrate(setup: Setup, planned: Sequence[Planned], concurrency: int) -> dict[str, Any]:
    """least_load's saturation throughput: a closed loop of `concurrency` in flight over
    `planned` on a fresh least_load proxy and reset caches (figures.saturation_rps)."""
    with _contender(contenders.spec(contenders.BASELINE), setup) as contender:
        for engine in setup.engines:
            engine_side.reset_prefix_cache(engine)
        before = engine_side.read_counters(setup.engines)
        outcomes = load.closed_loop(contender.url, planned, setup.prompts, concurrency, setup.max_tokens)
        after = engine_side.read_counters(setup.engines)
    ends = [o.ended_at for o in outcomes if o.ended_at is not None]
    return {"contender": contenders.BASELINE, "concurrency": concurrency, "requests": len(planned),
            "saturation_rps": round(figures.saturation_rps(outcomes, concurrency), 3),
            **figures.summarize(outcomes, max(ends, default=0.0)),
            **engine_side.engine_account(before, after)}


def run(spec: contenders.Spec, setup: Setup, planned: Sequence[Planned], rate: float,
        outcomes_to: Path | None = None) -> dict[str, Any]:
    """One run: a fresh contender, both prefix caches reset, the planned requests at `rate`;
    the engines' counters, the contender's CPU and counters, the calls the engines got (and
    each request's outcome into `outcomes_to`)."""
    with _contender(spec, setup) as contender:
        for engine in setup.engines:
            engine_side.reset_prefix_cache(engine)
        calls = engine_side.CallLog(setup.engines)
        calls.mark()
        before = engine_side.read_counters(setup.engines)
        router_before = _router_counters(contender)
        cpu_before, roles_before = contender.cpu_seconds(), contender.cpu_seconds_by_role()
        send_to = contender.sender(planned) if isinstance(contender, contenders.PlannedPlacement) \
            else lambda _: contender.url
        outcomes, wall_s = load.open_loop(send_to, planned, setup.prompts, rate, setup.max_tokens)
        if outcomes_to is not None:
            load.write_outcomes(outcomes_to, planned, outcomes, rate)
        cpu_s = contender.cpu_seconds() - cpu_before
        roles = {role: s - roles_before.get(role, 0.0) for role, s in contender.cpu_seconds_by_role().items()}
        engine_calls = calls.calls()
        after = engine_side.read_counters(setup.engines)
        record = {"contender": spec.name, "rate_per_s": round(rate, 3),
                  **figures.summarize(outcomes, wall_s), **engine_side.engine_account(before, after)}
        record.update(figures.cpu_figures(cpu_s, roles, record["ok"]))
        record["engine_calls"] = engine_side.contender_calls(engine_calls, len(setup.engines))
        if isinstance(contender, contenders.ProxyWithAgents):
            record["index"] = index_account(contender.status())
        else:
            record["router_counters"] = _deltas(router_before, _router_counters(contender))
        record["contender_setup"] = contender.describe()
    return record


def index_account(status: dict[str, Any]) -> dict[str, Any]:
    """What this proxy's affinity index heard in a run: the engines' KV events (blocks stored,
    removed, clears) and where each instance's prefix entries came from, each instance's learned
    pace, the prompt homes the sidecar moved, and each feed's batches, gaps and restarts."""
    affinity = status["event_channel"]["affinity"] or {}
    keys = ("prefix_blocks", "prefix_guesses_ignored", "engine_blocks_stored", "engine_blocks_removed",
            "engine_clears")
    channel = status["event_channel"]
    return {**{key: affinity.get(key) for key in keys},
            "prefix_from": {iid: row["prefix_from"] for iid, row in affinity.get("instances", {}).items()},
            "pace": {iid: timeline["pace"] for iid, timeline in channel.get("timelines", {}).items()},
            "prompt_homes": channel.get("prompt_homes"),
            "feeds": {iid: {k: feed.get(k) for k in ("endpoint", "batches", "gaps", "engine_restarts", "block_size")}
                      for iid, feed in (status.get("kv_event_feeds") or {}).items()}}


def _router_counters(contender: Contender) -> dict[str, float]:
    """A peer router's own Prometheus counters (`*_total` series), {} for this proxy."""
    if not isinstance(contender, contenders.PeerRouter):
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{contender.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return counters_total(text)


def counters_total(text: str) -> dict[str, float]:
    """Every `*_total` series of a Prometheus text, by its name and labels."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{", 1)[0].endswith("_total"):
            found[series] = (found.get(series) or 0.0) + float(value)
    return found


def _deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {series: value - before.get(series, 0.0) for series, value in sorted(after.items())
            if value != before.get(series, 0.0)}


def _warm_up(name: str, setup: Setup, planned: Sequence[Planned], rate: float) -> None:
    """Before a load's runs, WARM_UP_REQUESTS at its rate through its first contender, not
    recorded. Without it the first run of a load was the slowest: over the 34 loads of the
    earlier result files, its TTFT p50 was 1.10x (median) that of the last run, the same
    contender; and ABC…CBA puts one contender first in a load."""
    print(f"  warm-up: {WARM_UP_REQUESTS} requests through {name}, not recorded", flush=True)
    try:
        run(contenders.spec(name, setup.variants), setup, planned[:WARM_UP_REQUESTS], rate)
    except StartError as error:
        print(f"  warm-up did not start: {str(error)[:500]}", flush=True)


def _outcomes_file(setup: Setup, share: float, order: int, name: str) -> Path | None:
    if setup.outcomes_dir is None:
        return None
    return setup.outcomes_dir / f"load{share:g}_run{order + 1:02d}_{name.replace(' ', '_')}.jsonl"


def run_all(names: Sequence[str], setup: Setup, planned: Sequence[Planned], loads: Sequence[float],
            repeats: int, saturation_rps: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every load, ABC…CBA (the second load BC…A A…CB, and so on): the runs, and the
    contenders that would not start (with why; the benchmark goes on without that run)."""
    runs, failed = [], []
    for index, share in enumerate(loads):
        rate = share * saturation_rps
        runs_of_load = schedule(names, repeats, index)
        _warm_up(runs_of_load[0], setup, planned, rate)
        for order, name in enumerate(runs_of_load):
            spec = contenders.spec(name, setup.variants)
            print(f"load {share:g} ({rate:.2f}/s), run {order + 1}: {name}", flush=True)
            try:
                record = run(spec, setup, planned, rate, _outcomes_file(setup, share, order, name))
            except StartError as error:
                failed.append({"load": share, "contender": name, "order": order, "error": str(error)[-3000:]})
                print(f"  did not start: {str(error)[:500]}", flush=True)
                continue
            record = {"load": share, "order": order, **record}
            runs.append(record)
            print(f"  hit rate {record['prefix_cache_hit_rate']}, TTFT p50 {record['ttft_p50_ms']} ms, "
                  f"p99 {record['ttft_p99_ms']} ms, {record['completed_per_s']}/s, errors {record['error_count']}, "
                  f"share {record['share']}, CPU {record['cpu_ms_per_request']} ms/request"
                  + (f", prompts on one instance {record['prompt_concentration']}"
                     if record.get("prompt_concentration") is not None else ""), flush=True)
    return runs, failed
