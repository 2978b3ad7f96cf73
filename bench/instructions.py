"""Instructions a request costs, counted by callgrind: bench/pipeline_cost.py's variants without
its clocks (`python -m bench.instructions`).

CPU time on a shared 2-core machine moves by 10-20 % from one block to the next, more than most
changes to the request path are worth; the instructions a process executes do not move with
what else runs (valgrind counts them, the same for the same code and inputs). Each variant runs
twice under `valgrind --tool=callgrind` in a process of its own, `--requests` apart, after the
same warm-up, so the difference divided by `--requests` is what one request executes: the
worker's parts (pipeline_cost's Worker, the collector as a worker sets it) and the canned
upstream and client. `full − variant` is that part's cost; `full − relay floor` the product's
own. Python's hash seed is fixed, so a run repeats to within a few instructions a request.

Not time: an instruction of a cache miss costs more than one of a tight loop, and the running
proxy misses more (bench/flow_profile.py). Use it to compare code, not to predict µs.
Needs valgrind (Debian's package); ~35 s a run under it, two runs a variant.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness.cli import measured, stop_on_sigterm
from bench.harness.results import Run, tool_versions, write_report

WARM_REQUESTS = 192
RUN_TIMEOUT_S = 900
_COLLECTED = re.compile(rb"Collected : (\d+)")


async def drive(variant: str, requests: int) -> None:
    """Warm up, then `requests` more requests of `variant`, as pipeline_cost's blocks run them."""
    from bench import pipeline_cost

    async with pipeline_cost.canned_worker() as worker:
        handler, context = pipeline_cost.variants(worker)[variant]
        worker.publish_snapshot()
        with context():
            for count in (WARM_REQUESTS, requests):
                await pipeline_cost.serve_batches(worker, handler, count // pipeline_cost.CONCURRENCY)
                gc.collect()


def instructions(variant: str, requests: int) -> int:
    """What a process executes that warms up and serves `requests` of `variant`."""
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
               sys.executable, "-m", "bench.instructions", "--drive", variant, str(requests)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env) as child:
        try:
            _, stderr = child.communicate(timeout=RUN_TIMEOUT_S)
        except BaseException:  # interrupted, or too long: the run stops first, removing its segment
            child.terminate()
            child.communicate(timeout=60)
            raise
    found = _COLLECTED.search(stderr)
    if child.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run of {variant!r} failed ({child.returncode}): "
                           f"{stderr.decode(errors='replace')[-2000:]}")
    return int(found.group(1))


def per_request(variant: str, requests: int) -> float:
    """Instructions one request of `variant` executes: two runs, `requests` apart."""
    return (instructions(variant, requests) - instructions(variant, 0)) / requests


def results(counts: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Each variant's instructions a request, and `full −` it (None for full itself)."""
    rounded = {name: round(count) for name, count in counts.items()}
    full = rounded.get("full")
    return {name: {"per_request": count, "part": None if name == "full" or full is None else full - count}
            for name, count in rounded.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="", help="comma-separated pipeline_cost variants (default: all)")
    parser.add_argument("--requests", type=int, default=1024, help="requests between the two runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--drive", nargs=2, metavar=("VARIANT", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    stop_on_sigterm()  # unwinds through every `with`: a run's segment is removed, a run is stopped
    if args.drive:  # one run, under valgrind
        return measured(lambda: asyncio.run(drive(args.drive[0], int(args.drive[1]))), "the run")[1]
    if shutil.which("valgrind") is None:
        print("bench.instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    from bench import pipeline_cost
    names = [v for v in args.variants.split(",") if v] or list(pipeline_cost.VARIANTS)
    run = Run("bench.instructions", argv)
    counts: dict[str, float] = {}

    def count_each() -> None:
        for name in names:
            counts[name] = per_request(name, args.requests)
            print(f"{name:28s} {counts[name]:12,.0f} instructions a request", flush=True)
    status = measured(count_each, "a callgrind run")[1]
    if status:
        return status
    report: dict[str, Any] = {
        **run.record(), "versions": tool_versions(commands=(("valgrind", "--version"),)),
        "requests": args.requests, "results": results(counts),
        "method": {"counter": "valgrind --tool=callgrind: the instructions the whole process executes",
                   "per_request": f"(a run with {args.requests} requests more - one without) / "
                                  f"{args.requests}, both after {WARM_REQUESTS} warm-up requests, "
                                  "PYTHONHASHSEED=0",
                   "variants": "bench/pipeline_cost.py's: the worker's parts in one process, canned "
                               "upstreams, a counting client"}}
    if args.out is not None:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
