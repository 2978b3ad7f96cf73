"""`python -m bench.report [--results bench/results] [--out BENCHMARKS.md] [--charts DIR]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cacheroute_sim.processes import ROOT
from bench.report.build import build, charts_available


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="Write BENCHMARKS.md and its charts from bench/results/*.json.")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--charts", type=Path, default=None, help="default: <results>/charts")
    args = p.parse_args(argv)
    charts_dir: Path | None = args.charts or args.results / "charts"
    if not charts_available():
        print("matplotlib is not installed (pip install -e '.[bench]'): the report has no charts",
              file=sys.stderr)
        charts_dir = None
    text, used = build(args.results, args.out, charts_dir)
    args.out.write_text(text)
    print(f"wrote {args.out} from {', '.join(used) or 'no results'}"
          + (f"; charts in {charts_dir}" if charts_dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
