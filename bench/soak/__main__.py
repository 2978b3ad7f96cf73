"""`python -m bench.soak`: run one soak, print its summary, write the JSON (--out); exit 0 when
every end invariant holds, 1 otherwise."""

from __future__ import annotations

import sys

from bench.harness.cli import stop_on_sigterm
from bench.harness.results import Run, write_report
from bench.soak.config import parse_args
from bench.soak.report import summary_lines
from bench.soak.run import run_soak


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    stop_on_sigterm()  # unwinds through run_soak's finally: everything is stopped
    report = run_soak(cfg, Run("bench.soak", argv))
    print("\n".join(summary_lines(report)))
    if out:
        write_report(out, report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
