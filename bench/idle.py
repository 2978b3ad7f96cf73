"""The proxy at rest: the CPU its whole process tree (supervisor, sidecar, workers) spends over a
window with no traffic, by role, with two simulated instances registered. Optionally the same
for the product at a git ref (`--baseline REF`), interleaved (A B B A), in one run.

    python -m bench.idle --out bench/results/idle.json [--workers 4] [--seconds 60]
        [--rounds 2] [--baseline REF]

Target: at most 1 % of a core (0.6 s of CPU over 60 s) for sidecar + 4 workers and the
supervisor. A few requests go through first, so every path has run once; the window starts 2 s
after the last."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench.harness.ab import ab_parser, interleaved, trees
from bench.harness.backends import InstanceSpec, SimInstances
from bench.harness.cli import stop_on_sigterm
from bench.harness.contenders import ProxyContender
from bench.harness.cpu import charged
from bench.harness.processes import http_json
from bench.harness.results import Run, write_report

TARGET_SHARE = 0.01  # of one core
SETTLE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    return ab_parser("python -m bench.idle", __doc__.split("\n")[0], "bench/results/idle.json",
                     workers=4, seconds=60.0, rounds=2, seconds_help="the idle window")


def measure(contender: ProxyContender, seconds: float) -> dict[str, Any]:
    """A few requests, a pause, then the tree's CPU over `seconds` with no traffic."""
    for _ in range(4):
        status, body = http_json("POST", f"{contender.url}/v1/chat/completions",
                                 {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        if status != 200:
            raise SystemExit(f"{contender.name}: a request before the window got {status}: {body}")
    time.sleep(SETTLE_S)
    window = charged(contender, lambda: time.sleep(seconds) or {})
    spent = window["cpu_s"]
    return {"cpu_s": spent, "share_of_a_core": round(spent / seconds, 5),
            "by_role": window.get("cpu_s_by_role", {})}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()  # a timeout or kill unwinds through every `with`: what it started stops
    run = Run("bench.idle", argv)
    contenders = trees(args.baseline)
    windows: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    with SimInstances([InstanceSpec(), InstanceSpec()]) as instances:
        for round_index, name in interleaved(list(contenders), args.rounds):
            print(f"round {round_index + 1}: {name}, {args.seconds:g} s idle", flush=True)
            with ProxyContender(name, instances, args.workers, "least_load", tree=contenders[name]) as contender:
                window = measure(contender, args.seconds)
            print(f"  {window['cpu_s']} s of CPU ({window['share_of_a_core']:.3%} of a core) {window['by_role']}",
                  flush=True)
            windows[name].append(window)
    results = {name: {"cpu_s_median": statistics.median(w["cpu_s"] for w in ws),
                      "share_of_a_core_median": statistics.median(w["share_of_a_core"] for w in ws),
                      "windows": ws} for name, ws in windows.items()}
    current = results["current"]["share_of_a_core_median"]
    report = {**run.record(), "workers": args.workers, "seconds": args.seconds, "rounds": args.rounds,
              "baseline_ref": args.baseline, "results": results,
              "target": {"share_of_a_core_at_most": TARGET_SHARE, "value": current,
                         "verdict": "PASS" if current <= TARGET_SHARE else "FAIL"}}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
