"""python -m bench.peers --out bench/results/peers.json [--backend sim|starlette|both]
[--repeats 3] [--duration 5] [--contenders direct nginx ...] [--quick] [--isolate]

This proxy (by default 2 workers, least_load) against nginx (least_conn, 2 workers) and
vllm-router (power_of_two), over two instances of each backend in turn: the project's
simulator (sim) and a plain Starlette/uvicorn OpenAI fake (starlette). Per backend: added
latency at c1 (paired with direct), requests/s and p99 at c32, streams/s and TTFT at c32, CPU
per 1,000 requests of each contender's process tree (this proxy's also by role: launcher,
sidecar, workers), RSS, and the peer targets (PASS/FAIL with per-repeat ratios).
--quick: 1 repeat of 2 s points (a smoke run, about 2-4 minutes for both backends).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from bench.harness.cli import Progress, stop_on_sigterm
from bench.harness.results import Run, write_report
from bench.peers import summary
from bench.peers.plan import BACKENDS, DEFAULT_CONTENDERS, KNOWN, RunConfig
from bench.peers.runner import run


def parse(argv: list[str] | None) -> RunConfig:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/peers.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured point")
    p.add_argument("--contenders", nargs="+", default=None, metavar="NAME",
                   help=f"default: {' '.join(DEFAULT_CONTENDERS)}; also: "
                        f"{' '.join(sorted(set(KNOWN) - set(DEFAULT_CONTENDERS)))}")
    p.add_argument("--backend", choices=[*BACKENDS, "both"], default="both",
                   help="which backend's instances the contenders are put in front of "
                        "(both: sim, then starlette)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 2 s points (smoke)")
    p.add_argument("--isolate", action="store_true",
                   help="start (and warm up) each contender for its own point only, so no idle "
                        "contender runs beside it; slower: one start per point")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.duration < 1:
        p.error("--repeats must be >= 1 and --duration >= 1 s")
    unknown = [n for n in a.contenders or [] if n not in KNOWN]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {sorted(KNOWN)}")
    repeats, duration = (1, 2.0) if a.quick else (a.repeats, a.duration)
    return RunConfig(out=a.out, repeats=repeats, duration_s=duration,
                     warmup_s=1.0 if a.quick else 2.0, warmup_streams=not a.quick,
                     contenders=a.contenders or [], isolate=a.isolate,
                     backends=list(BACKENDS) if a.backend == "both" else [a.backend])


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    missing = [tool for tool in ("wrk", "nginx") if shutil.which(tool) is None]
    if missing:
        print(f"bench.peers: {' and '.join(missing)} not found: apt-get install -y wrk nginx-light"
              " (make bench-peers does it)", file=sys.stderr)
        return 2
    stop_on_sigterm()
    log = Progress()
    try:
        result = run(cfg, log, Run("bench.peers", argv))
    except KeyboardInterrupt:
        print("bench.peers: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"bench.peers: {exc}", file=sys.stderr)
        return 1
    result["method"]["wall_s"] = round(time.monotonic() - log.started, 1)
    out = Path(cfg.out)
    write_report(out, result, indent=1)
    for backend, section in result["backends"].items():
        print(f"\n## backend: {backend}\n\n{summary.table(section)}\n")
        print("\n".join(summary.target_lines(section["targets"])))
        for note in section["notes"]:
            print(f"note ({backend}): {note}")
    for note in result["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
