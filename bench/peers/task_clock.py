"""CPU per request as the scheduler counts it: `python -m bench.peers.task_clock`.

bench-peers charges each contender the user+sys time of its process tree, which this kernel
accounts by scheduler tick (CONFIG_TICK_CPU_ACCOUNTING: a process is charged the whole tick it
is found running at). This probe reads the scheduler's own runtime instead: `perf stat -e
task-clock,context-switches` attached to the contender's processes while wrk runs c32 against
it (one perf per group, all over the same wrk run: the proxy's workers and sidecar apart, every
other contender as one tree). Same contenders, backends and body as bench-peers, interleaved,
the order rotated every repeat; medians.

Needs `perf` (Debian: linux-perf). Short and bounded: per repeat and contender, one wrk run of
`--seconds`; every process it started is stopped by pid at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.contenders import Contender, proxy_role
from bench.machine import machine_info, process_tree, run_record, tree_by_role, utc_now, write_report
from bench.peers import measure
from bench.peers.plan import BACKENDS, KNOWN, RunConfig, instances_for
from bench.wrk import run_wrk

DEFAULT = ["proxy-w2-ll", "vllm-router-p2", "nginx", "relay-floor-w2"]
EVENTS = "task-clock,context-switches"


def groups(contender: Contender) -> dict[str, list[int]]:
    """The pids perf attaches to, by group: the proxy's roles apart (its launcher does nothing
    per request), any other contender's whole tree as one."""
    if contender.kind != "proxy":
        return {"tree": [p.pid for p in process_tree(contender.pids())]}
    return {role: [p.pid for p in procs]
            for role, procs in tree_by_role(contender.pids(), proxy_role).items()}


def by_group(groups: dict[str, dict[str, float]]) -> str:
    """'sidecar 35.4, workers 408.2': each group's µs of CPU a request, for the log lines."""
    return ", ".join(f"{g} {v['task_clock_us_per_req']}" for g, v in groups.items())


def _perf(pids: list[int], seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(["perf", "stat", "-x,", "-e", EVENTS, "-p", ",".join(map(str, pids)),
                             "--", "sleep", f"{seconds:g}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _counts(perf: subprocess.Popen[str]) -> dict[str, float]:
    """task-clock (ms) and context-switches from perf's CSV lines."""
    _, err = perf.communicate(timeout=60)
    found: dict[str, float] = {}
    for line in err.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in ("task-clock", "context-switches"):
            try:
                found[fields[2]] = float(fields[0])
            except ValueError:  # "<not counted>"
                pass
    return found


def point(contender: Contender, script: Path, seconds: float) -> dict[str, Any]:
    """One wrk c32 run with every group's perf attached over it. perf is started just before
    wrk and outlasts it by a second: what wrk sends in perf's first few ms of attaching goes
    uncharged, and the contender's idle CPU in the second after is charged (the proxy's idle,
    60-75 ms/s, is under 2 % of a 5 s run's CPU; nginx's and the router's are nil)."""
    attached = {name: _perf(pids, seconds + 1.0) for name, pids in groups(contender).items()}
    load = run_wrk(contender.url, script, 32, seconds)
    done = load["requests"] or 1
    result: dict[str, Any] = {"rps": load["rps"], "requests": load["requests"],
                              "errors": load.get("errors", 0), "groups": {}}
    for name, perf in attached.items():
        counts = _counts(perf)
        result["groups"][name] = {
            "task_clock_us_per_req": round(counts.get("task-clock", 0.0) * 1000 / done, 1),
            "context_switches_per_req": round(counts.get("context-switches", 0.0) / done, 3)}
    result["task_clock_us_per_req"] = round(
        sum(g["task_clock_us_per_req"] for g in result["groups"].values()), 1)
    return result


def run(backend: str, names: list[str], repeats: int, seconds: float,
        log: Any = print) -> dict[str, Any]:
    cfg = RunConfig(out="-", backends=[backend])
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-task-clock-") as tmp:
        instances = stack.enter_context(instances_for(backend, cfg))
        script = measure.write_script(Path(tmp), cfg.max_tokens)
        contenders = [stack.enter_context(KNOWN[n].build(instances, cfg)) for n in names]
        for contender in contenders:  # warm-up, unmeasured
            run_wrk(contender.url, script, 32, 2)
        for repeat in range(repeats):
            shift = repeat % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                measured = point(contender, script, seconds)
                points[contender.name].append(measured)
                log(f"{backend} repeat {repeat} {contender.name}: {measured['rps']:.0f} req/s, "
                    f"{measured['task_clock_us_per_req']} µs/request ({by_group(measured['groups'])})")
    return {name: _medians(runs) for name, runs in points.items()}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(values: list[float]) -> float:
        return round(statistics.median(values), 1)
    group_names = runs[0]["groups"]
    return {"rps": median([r["rps"] for r in runs]),
            "task_clock_us_per_req": median([r["task_clock_us_per_req"] for r in runs]),
            "per_repeat_us": [r["task_clock_us_per_req"] for r in runs],
            "groups": {g: {k: median([r["groups"][g][k] for r in runs])
                           for k in ("task_clock_us_per_req", "context_switches_per_req")}
                       for g in group_names},
            "errors": sum(r["errors"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.task_clock", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=[*BACKENDS, "both"], default="both")
    p.add_argument("--contenders", nargs="+", default=DEFAULT, choices=sorted(KNOWN), metavar="NAME")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--out", default="bench/results/peers_task_clock.json")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    names = [n for n in args.contenders if n != "direct"]
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    started_at, machine = utc_now(), machine_info()
    measured = {b: run(b, names, args.repeats, args.seconds) for b in backends}
    result = {**run_record("bench.peers.task_clock", argv, started_at, machine),
              "repeats": args.repeats, "seconds": args.seconds, "backends": measured}
    for backend, medians in result["backends"].items():
        for name, m in medians.items():
            print(f"{backend:9} {name:16} {m['rps']:8.0f} req/s  {m['task_clock_us_per_req']:6.1f} "
                  f"µs CPU/request ({by_group(m['groups'])})")
    write_report(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
