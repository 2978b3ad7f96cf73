"""`python -m bench.soak`: run one soak, print its summary, write the JSON (--out); exit 0 when
every end invariant holds, 1 otherwise."""

from __future__ import annotations

import signal
import sys

from bench.soak.config import parse_args
from bench.soak.report import summary_lines, write_report
from bench.soak.run import run_soak


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_soak's finally: everything is stopped

    signal.signal(signal.SIGTERM, on_term)
    command = "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run_soak(cfg, command)
    print("\n".join(summary_lines(report)))
    if out:
        write_report(out, report)
        print(f"written {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
