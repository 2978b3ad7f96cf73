"""A before/after in one run: the product as it is (`current`) and, with `--baseline REF`, as it
was at that ref (bench/harness/baseline.py), measured in interleaved rounds (A B, B A, ...) so a
burst of noise from other tenants spreads over both."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Iterator


def ab_parser(prog: str, description: str, out: str, workers: int, seconds: float, rounds: int,
              seconds_help: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--seconds", type=float, default=seconds, help=seconds_help)
    parser.add_argument("--rounds", type=int, default=rounds, help="windows per tree, interleaved")
    parser.add_argument("--baseline", metavar="REF", help="also measure the product at this git ref")
    return parser


def trees(baseline: str | None) -> dict[str, Path | None]:
    """`current` (None: this checkout) and, given a ref, `baseline` (its exported tree)."""
    from bench.harness.baseline import baseline_tree

    found: dict[str, Path | None] = {"current": None}
    if baseline:
        found["baseline"] = baseline_tree(baseline, Path(tempfile.mkdtemp(prefix="bench_ab_")))
    return found


def interleaved(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, name) in the order to measure: each round reverses the one before."""
    for round_index in range(rounds):
        for name in (names if round_index % 2 == 0 else list(reversed(names))):
            yield round_index, name
