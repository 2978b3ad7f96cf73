"""What a request's metrics cost a worker: the product's writes against prometheus_client's
multiprocess values, which the worker used before (`python -m bench.bench_metrics`).

Cases, each a timed loop of `--calls` calls, repeats interleaved across cases (medians):
- `observe_request`: proxy_workers.metrics.observe_request, what every answered request does
  (its counter and its duration histogram, three additions to the worker's metrics file in a
  temporary directory);
- `observe_ttft`: proxy_workers.metrics.observe_ttft, what a stream adds;
- `prometheus_client request` / `prometheus_client ttft`: the same through prometheus_client
  in multiprocess mode (a labelled child of a Counter `.inc()` and of a Histogram
  `.observe()`, the children looked up once as the worker did), files in another temporary
  directory.

prometheus_client picks its multiprocess mode when first imported: run as a program (a fresh
interpreter), this sets PROMETHEUS_MULTIPROC_DIR before importing anything that imports it.
Everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.machine import machine_info, run_record, utc_now, write_report

SECONDS = (0.0042, 0.031, 0.27, 2.2)  # a few durations, so the bucket search is not one path


def _timed(call: Callable[[float], None], calls: int) -> float:
    """ns per call of one loop."""
    values = SECONDS * (calls // len(SECONDS))
    started = time.perf_counter_ns()
    for value in values:
        call(value)
    return (time.perf_counter_ns() - started) / len(values)


def _cases(product_dir: str) -> dict[str, Callable[[float], None]]:
    from prometheus_client import Counter, Histogram

    from proxy_workers import metrics

    metrics.open_store(product_dir)
    requests = Counter("bench_requests_total", "x", ["route", "status", "instance_id"]).labels(
        "chat/completions", "200", "i0")
    duration = Histogram("bench_duration_seconds", "x", ["route", "instance_id"],
                         buckets=metrics.LATENCY_BUCKETS).labels("chat/completions", "i0")
    ttft = Histogram("bench_ttft_seconds", "x", ["route", "instance_id"],
                     buckets=metrics.LATENCY_BUCKETS).labels("chat/completions", "i0")

    def prometheus_request(seconds: float) -> None:
        requests.inc()
        duration.observe(seconds)

    return {
        "observe_request": lambda s: metrics.observe_request("chat/completions", 200, s, "i0"),
        "observe_ttft": lambda s: metrics.observe_ttft("chat/completions", "i0", s),
        "prometheus_client request": prometheus_request,
        "prometheus_client ttft": ttft.observe,
    }


def measure(calls: int, repeats: int) -> dict[str, list[float]]:
    product_dir, reference_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = reference_dir
    try:
        cases = _cases(product_dir)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for name, call in cases.items():  # warm up: series created, pages touched
            _timed(call, 1000)
        for _ in range(repeats):
            for name, call in cases.items():
                samples[name].append(_timed(call, calls))
        return samples
    finally:
        from proxy_workers import metrics
        metrics.open_store(None)
        shutil.rmtree(product_dir, ignore_errors=True)
        shutil.rmtree(reference_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started_at = utc_now()
    machine = machine_info()
    samples = measure(args.calls, args.repeats)
    results = {name: {"median_ns": round(statistics.median(v), 1), "min_ns": round(min(v), 1)}
               for name, v in samples.items()}
    ratios = {case: round(results[f"prometheus_client {ref}"]["median_ns"] / results[case]["median_ns"], 1)
              for case, ref in (("observe_request", "request"), ("observe_ttft", "ttft"))}
    print(f"# ns per call, median of {args.repeats} loops of {args.calls}")
    for name, r in results.items():
        print(f"{name:<28}{r['median_ns']:10.1f} (min {r['min_ns']:8.1f})")
    print("prometheus_client / product:", ratios)
    if args.out:
        write_report(args.out, {
            **run_record("bench.bench_metrics", argv, started_at, machine),
            "calls": args.calls, "repeats": args.repeats,
            "results": results, "prometheus_client_over_product": ratios,
            "method": ("ns per call of one timed loop (time.perf_counter_ns), median and fastest "
                       "of the repeats, cases interleaved; prometheus_client in multiprocess mode "
                       "(PROMETHEUS_MULTIPROC_DIR set before its import)")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
