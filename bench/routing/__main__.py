"""`python -m bench.routing --out bench/results/routing.json [--repeats 3] [--quick]`;
`python -m bench.routing --reanalyse FILE` recomputes a results file's figures from its runs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.harness.cli import measured, stop_on_sigterm
from bench.harness.results import Run, write_report
from bench.routing.run import reanalysed, run_benchmark
from bench.routing.scenario import Scenario, contender_defs, quick


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.routing",
                                description="Routing quality with many workers (see bench/routing/__init__.py).")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: print only)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat of ~8 s of arrivals")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    p.add_argument("--contenders", nargs="+", default=None, metavar="NAME",
                   help="only these contenders (default: all)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=None)
    p.add_argument("--slow-factor", type=float, default=None)
    p.add_argument("--reanalyse", type=Path, default=None, metavar="FILE",
                   help="run nothing: recompute medians, checks and intervals of FILE from its "
                        "raw runs and rewrite it (or write --out)")
    return p


def scenario_from(args: argparse.Namespace) -> Scenario:
    scenario = quick(Scenario()) if args.quick else Scenario()
    schedule = scenario.schedule
    if args.duration is not None:
        schedule = replace(schedule, duration_s=args.duration)
    if args.seed is not None:
        schedule = replace(schedule, seed=args.seed)
    scenario = replace(scenario, schedule=schedule)
    if args.time_scale is not None:
        scenario = replace(scenario, time_scale=args.time_scale)
    if args.slow_factor is not None:
        scenario = replace(scenario, slow_factor=args.slow_factor)
    return scenario


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.out or args.reanalyse)
    stop_on_sigterm()
    scenario = scenario_from(args)
    defs = contender_defs(scenario)
    if args.contenders:
        unknown = set(args.contenders) - {d.name for d in defs}
        if unknown:
            print(f"unknown contender(s) {sorted(unknown)}; choose from {[d.name for d in defs]}",
                  file=sys.stderr)
            return 2
        defs = [d for d in defs if d.name in args.contenders]
    repeats = args.repeats or (1 if args.quick else 3)
    results, code = measured(lambda: run_benchmark(scenario, defs, repeats, Run("bench.routing", argv)),
                             "the simulated instances")  # a contender that does not start is left out
    if results is None:
        return code
    print_checks(results)
    if args.out:
        write(args.out, results)
    return 0


def reanalyse(source: Path, out: Path) -> int:
    try:
        results = reanalysed(json.loads(source.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{source}: not a routing results file ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print_checks(results)
    write(out, results)
    return 0


def write(out: Path, results: dict[str, Any]) -> None:
    """Indented, but a list of plain numbers on one line (the samples and series would
    otherwise take one line per number)."""
    write_report(out, results, indent=1, compact_numbers=True)


def print_checks(results: dict) -> None:
    print("\nmedians over repeats:")
    for c in results["contenders"]:
        m = c["median"]
        shares = " ".join(f"{k[6:]}={m[k]:.0%}" for k in m if k.startswith("share_") and m[k] is not None)
        print(f"  {c['name']:32s} TTFT p50 {m['ttft_p50_ms']} p99 {m['ttft_p99_ms']} ms, "
              f"total p99 {m['total_p99_ms']} ms, spread mean {m['inflight_spread_mean']} "
              f"p95 {m['inflight_spread_p95']}, errors {m['errors']}, {shares}")
    for kind in ("checks", "validity"):
        print(f"\n{kind}:")
        for check in results[kind]:
            verdict = {True: "PASS", False: "FAIL", None: "N/A "}[check["pass"]]
            print(f"  {verdict}  {check['name']}: {check['value']} (threshold {check['threshold']})")
    spread = results.get("uncertainty")
    if spread:
        print(f"\nratios with intervals ({spread['method']}):")
        for row in spread["rows"]:
            a, b = row["compares"]
            print(f"  {a} / {b}, {row['statistic']}: {row['ratio']} [{row['low']}, {row['high']}]")


if __name__ == "__main__":
    sys.exit(main())
