"""The run: for each backend (the simulated instances, then the Starlette fake; one after the
other, never side by side), start its instances and every contender, warm each up, then for
each repeat, each scenario, each contender (order rotated every repeat and scenario) measure
one point. Each backend's figures, ratios and targets are a section of their own.

Scenarios (all POST /v1/chat/completions, a small OpenAI chat body):
- c1: wrk -t1 -c1 non-streaming; `direct` is measured right before every other contender, so
  added latency is a paired difference (contender p50 - direct p50, p99 likewise) per repeat.
- c32: wrk -t1 -c32 non-streaming: requests/s, CPU seconds per 1,000 requests.
- stream32: 32 streaming clients (bench/peers/stream_load.py): streams/s (only streams ending
  with [DONE]), TTFT, CPU seconds per 1,000 streams.
- stream256: 16 streaming clients, 256 tokens a stream: streams/s, CPU seconds per 1M relayed
  tokens (what the relay costs per chunk, once a stream's fixed costs fade).

By default every contender stays up for the whole run (so the order can be interleaved); idle
contenders' background CPU is measured once and recorded. --isolate instead starts each
contender (and warms it up) for its own point only, so nothing idles beside it, at the cost of
a start per point.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.harness.backends import Instances
from bench.harness.contenders import Contender, rotated, router_available
from bench.harness.processes import StartError
from bench.harness.results import Run, tool_versions
from bench.harness.wrk import wrk_point
from bench.peers import measure, summary, targets
from bench.peers.plan import SCENARIOS, ContenderPlan, RunConfig, chosen, instances_for

Log = Callable[[str], None]


def run(cfg: RunConfig, log: Log, provenance: Run) -> dict[str, Any]:
    """The results: the run's command and machine, then each backend's section."""
    result = _skeleton(cfg)
    for backend in cfg.backends:
        log(f"backend {backend}")
        result["backends"][backend] = run_backend(cfg, backend, log)
    result["notes"] += _standing_notes(result, cfg, provenance.machine)
    return {**provenance.record(), **result}


def run_backend(cfg: RunConfig, backend: str, log: Log) -> dict[str, Any]:
    """One backend's section: its instances, contenders (medians and runs), ratios, targets."""
    plans = chosen(cfg)
    section: dict[str, Any] = {"instances": {}, "contenders": [], "ratios_to_nginx": {},
                               "targets": [], "repeat_ratios": [], "notes": []}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        instances = stack.enter_context(instances_for(backend, cfg))
        section["instances"] = {"kind": instances.kind, "count": len(instances.urls)}
        log(f"instances ({backend}): {instances.urls}")
        script = measure.write_script(Path(tmp), cfg.max_tokens)
        slots = _slots(plans, instances, cfg, stack, script, section["notes"], log)
        if not cfg.isolate:
            section["idle_cpu_cores_per_contender"] = measure.idle_cpu(
                [s.contender for s in slots if s.contender], 2.0)
            _warm_up([s.contender for s in slots if s.contender], script, cfg, log)
        runs = _measure_all(slots, script, cfg, section["notes"], log)
    section["contenders"] = [summary.contender_entry(s.describe(), runs[s.plan.name]) for s in slots]
    section["ratios_to_nginx"] = summary.ratios_to(section["contenders"], targets.NGINX)
    section["ratios_to_router"] = summary.ratios_to(section["contenders"], targets.ROUTER)
    section["ratios_to_floor"] = summary.ratios_to(section["contenders"], targets.FLOOR)
    section["targets"] = targets.targets(section["contenders"])
    section["repeat_ratios"] = targets.repeat_ratios(section["contenders"])
    section["notes"] += summary.flag_notes(section["contenders"])
    if not section["ratios_to_nginx"]:
        section["notes"].append("nginx was not among the contenders that ran: no ratios to nginx")
    return section


def _measure_all(slots: list["Slot"], script: Path, cfg: RunConfig, notes: list[str],
                 log: Log) -> dict[str, list[dict[str, Any]]]:
    """Every point of every repeat, scenario and contender: {contender name: its points}."""
    direct = slots[0].contender
    assert direct is not None
    runs: dict[str, list[dict[str, Any]]] = {s.plan.name: [] for s in slots}
    for repeat in range(cfg.repeats):
        for s_index, scenario in enumerate(SCENARIOS):
            for slot in rotated(slots, repeat + s_index):
                point = _point(slot, scenario, direct, script, cfg, notes, log)
                if point is None:
                    continue
                for run_point in point.pop("_extra_runs", []):  # direct's paired baseline
                    runs[direct.name].append({**run_point, "repeat": repeat})
                point.update(scenario=scenario, repeat=repeat)
                runs[slot.plan.name].append(point)
    return runs


def _standing_notes(result: dict[str, Any], cfg: RunConfig, machine: dict[str, Any]) -> list[str]:
    notes = [
        "direct = wrk straight at instance 0 alone: the latency baseline; its req/s and streams/s "
        "are one instance's, not comparable with the contenders' two-instance throughput",
        "contenders, the backend instances, wrk and the streaming client share this machine's "
        f"{machine.get('nproc')} cores: throughput includes that contention; CPU/1k is "
        "the contender's own process tree only",
        "the streaming client is Python (aiohttp + uvloop, its own process): at high streams/s it "
        "takes a core itself, so streams/s is a lower bound for fast contenders",
        f"this proxy runs with READY_CONCURRENCY = PREPARE_CONCURRENCY = {cfg.instance_max_concurrency}"
        " (the instances' capacity) so it does not queue below what the instances accept",
    ]
    if "starlette" in cfg.backends:
        notes.append("starlette backend = bench/peers/openai_fake.py, 2 processes (Starlette on "
                     "uvicorn, no access log): vLLM-shaped JSON and SSE, date/server/x-request-id "
                     "headers, a tiny fixed answer at once (no simulated time, no admission)")
    notes.append("targets: the data-plane targets, for proxy-w2-ll against nginx and vllm-router-p2, each "
                 "verdict from this run's medians; per-repeat ratios beside it")
    load = machine.get("loadavg") or [0.0]
    if load[0] > (machine.get("nproc") or 1):
        notes.append(f"BUSY MACHINE: load average {load[0]} at start > {machine.get('nproc')} "
                     "cores; figures are noisy, compare only ratios measured in this run")
    if result["versions"].get("vllm-router"):
        notes.append(f"vllm-router {result['versions']['vllm-router']} (PyPI, Rust): it waits for "
                     "GET /health on every worker before routing; both backends serve /health "
                     "like vLLM; its Prometheus listener is put on a free port")
    return notes


def _skeleton(cfg: RunConfig) -> dict[str, Any]:
    return {
        "versions": tool_versions(
            packages=("cacheroute-proxy", "aiohttp", "uvloop", "uvicorn", "starlette", "httptools", "psutil",
                      "vllm-router"),
            commands=(("nginx", "-v"), ("wrk", "-v"))),
        "method": _method(cfg), "backends": {}, "notes": []}


def _method(cfg: RunConfig) -> dict[str, Any]:
    return {
        "repeats": cfg.repeats, "duration_s_per_point": cfg.duration_s, "warmup_s": cfg.warmup_s,
        "warmup": "each contender, before the first point: wrk -c32 for half the warm-up"
                  + (", then the streaming client for the other half" if cfg.warmup_streams else ""),
        "order": "for each repeat, each scenario, each contender; contender order rotated by "
                 "(repeat + scenario index); "
                 + ("each contender started and warmed up for its own point only (--isolate)"
                    if cfg.isolate else "every contender up for the whole run"),
        "pinning": "none (not measured to help on this 2-core machine)",
        "scenarios": {
            "c1": "wrk -t1 -c1 POST non-streaming chat; direct measured right before each contender; "
                  "added_p50/p99 = contender - direct, per repeat, then the median",
            "c32": "wrk -t1 -c32 POST non-streaming chat: requests/s, latency, CPU/1k requests",
            "stream32": "32 asyncio+aiohttp clients (own process), stream: true; ok = ended with "
                        "[DONE]; TTFT = request sent -> first data: line",
            "stream256": f"{cfg.long_stream_concurrency} clients as stream32, "
                         f"{cfg.long_stream_tokens} tokens a stream: streams/s, CPU s per 1M "
                         "relayed tokens"},
        "body": measure.chat_body(cfg.max_tokens),
        "backends": {"sim": f"cacheroute_sim.instance, time scale {cfg.time_scale}, admission "
                            f"{cfg.instance_max_concurrency}",
                     "starlette": "bench/peers/openai_fake.py on uvicorn, no delay, no admission",
                     "run": cfg.backends, "instances_each": cfg.instances,
                     "shared_by_all_contenders": True},
        "proxy_env": {"READY_CONCURRENCY": cfg.instance_max_concurrency,
                      "PREPARE_CONCURRENCY": cfg.instance_max_concurrency,
                      "PROXY_INSTANCE_TTL_S": 86400, "PROXY_LOG_LEVEL": "warning"},
        "cpu": "user+sys delta of the contender's process tree (psutil, recursive) over the load; "
               "this proxy's also split by role: launcher (the tree's root, the supervisor), "
               "sidecar (-m sidecar), workers (-m proxy_workers), by command line",
        "rss": "sum of RSS over the contender's process tree, after each point; reported: after its last point",
        "medians": "median over repeats; errors are summed; ratios = contender / nginx, same run",
    }


class Slot:
    """One contender of the run: already up (shared mode), or started per point (--isolate)."""

    def __init__(self, plan: ContenderPlan, contender: Contender | None = None,
                 build: Callable[[], Contender] | None = None,
                 warm_up: Callable[[Contender], None] | None = None) -> None:
        self.plan, self.contender, self._build, self._warm_up = plan, contender, build, warm_up
        self.failed = False

    def describe(self) -> dict[str, Any]:
        p = self.plan
        return {"name": p.name, "kind": p.kind, "workers": p.workers, "strategy": p.strategy}

    @contextmanager
    def live(self) -> Iterator[Contender]:
        if self.contender is not None:
            yield self.contender
            return
        assert self._build is not None and self._warm_up is not None
        with self._build() as contender:  # started here, stopped when the point is measured
            self._warm_up(contender)
            yield contender


def _slots(plans: list[ContenderPlan], instances: Instances, cfg: RunConfig, stack: ExitStack,
           script: Path, notes: list[str], log: Log) -> list[Slot]:
    if not cfg.isolate:
        return [Slot(plan, contender) for contender, plan in
                _start_all(plans, instances, cfg, stack, notes, log)]
    direct = plans[0].build(instances, cfg)  # no process of its own: always "up"
    slots = [Slot(plans[0], direct)]
    for plan in plans[1:]:
        if plan.kind == "router" and (why := router_available()):
            notes.append(f"{plan.name}: not run: {why}")
            continue
        slots.append(Slot(plan, build=lambda plan=plan: plan.build(instances, cfg),
                          warm_up=lambda c: _warm_up([c], script, cfg, log)))
    return slots


def _point(slot: Slot, scenario: str, direct: Contender, script: Path, cfg: RunConfig,
           notes: list[str], log: Log) -> dict[str, Any] | None:
    """One measured point, or None for a contender that could not be started (--isolate)."""
    if slot.failed:
        return None
    try:
        with slot.live() as contender:
            return _measure(scenario, contender, direct, script, cfg, log)
    except StartError as exc:  # --isolate only: a start per point; left out from then on
        slot.failed = True
        notes.append(f"{slot.plan.name}: did not start: {_first_lines(str(exc))}")
        log(f"skip {slot.plan.name}: {exc}")
        return None


def _start_all(plans: list[ContenderPlan], instances: Instances, cfg: RunConfig,
               stack: ExitStack, notes: list[str], log: Log) -> list[tuple[Contender, ContenderPlan]]:
    """Launch every contender, then wait for each (they come up in parallel); one that does
    not come up is stopped, noted and left out."""
    launched: list[tuple[Contender, ContenderPlan]] = []
    for plan in plans:
        if plan.kind == "router" and (why := router_available()):
            notes.append(f"{plan.name}: not run: {why}")
            log(f"skip {plan.name}: {why}")
            continue
        contender = plan.build(instances, cfg)
        stack.callback(contender.stop)  # registered first: stopped even if launch fails half-way
        contender.launch()
        launched.append((contender, plan))
    running = []
    for contender, plan in launched:
        try:
            contender.wait_ready()
        except StartError as exc:
            contender.stop()
            notes.append(f"{plan.name}: did not start: {_first_lines(str(exc))}")
            log(f"skip {plan.name}: {exc}")
            continue
        log(f"up: {plan.name} at {contender.url}")
        running.append((contender, plan))
    if not running or running[0][1].kind != "direct":
        raise RuntimeError("the direct baseline did not start")
    return running


def _first_lines(text: str, lines: int = 12) -> str:
    return " | ".join(text.strip().splitlines()[:lines])


def _warm_up(contenders: list[Contender], script: Path, cfg: RunConfig, log: Log) -> None:
    for contender in contenders:
        wrk_point(contender, script, cfg.high_concurrency, cfg.warmup_s / 2)
        if cfg.warmup_streams:
            measure.stream_point(contender, cfg.high_concurrency, cfg.warmup_s / 2, cfg.max_tokens)
    log(f"warmed up: {', '.join(c.name for c in contenders)}")


def _measure(scenario: str, contender: Contender, direct: Contender, script: Path, cfg: RunConfig,
             log: Log) -> dict[str, Any]:
    if scenario == "c32":
        point = wrk_point(contender, script, cfg.high_concurrency, cfg.duration_s)
    elif scenario == "stream32":
        point = measure.stream_point(contender, cfg.high_concurrency, cfg.duration_s, cfg.max_tokens)
    elif scenario == "stream256":
        point = measure.long_stream_point(contender, cfg.long_stream_concurrency, cfg.duration_s,
                                          cfg.long_stream_tokens)
    elif contender is direct:
        point = wrk_point(contender, script, 1, cfg.duration_s)
    else:
        point = _paired_c1(contender, direct, script, cfg)
    log(f"{scenario:8} {contender.name:24} {summary.one_line(scenario, point)}")
    return point


def _paired_c1(contender: Contender, direct: Contender, script: Path, cfg: RunConfig) -> dict[str, Any]:
    """direct, then the contender, back to back; the direct run is also one of direct's runs
    (handed back under "_extra_runs")."""
    base = wrk_point(direct, script, 1, cfg.duration_s)
    base.update(scenario="c1", paired_with=contender.name)
    point = wrk_point(contender, script, 1, cfg.duration_s)
    point["direct_p50_ms"], point["direct_p99_ms"] = base.get("p50_ms"), base.get("p99_ms")
    point["direct_errors"] = base.get("errors", 0)
    if point.get("p50_ms") is not None and base.get("p50_ms") is not None:
        point["added_p50_ms"] = round(point["p50_ms"] - base["p50_ms"], 4)
    if point.get("p99_ms") is not None and base.get("p99_ms") is not None:
        point["added_p99_ms"] = round(point["p99_ms"] - base["p99_ms"], 4)
    point["_extra_runs"] = [base]
    return point
