"""The sidecar's CPU cost of consuming one proxied request's events, measured on its own.

Run:  python -m bench.bench_events --out bench/results/events.json [--baseline GIT_REF]
      python -m bench.bench_events --profile 16:stream   (cProfile of the sidecar's ticks)

In one process, on a real private Segment (default geometry, READY_CONCURRENCY 64): 2 or 16
instances registered through DirectoryWriter, four claimed worker rows, each with the workers'
own producer (proxy_workers.event_channel.EventChannelWriter, so the events are exactly those a worker
writes), and the sidecar's consumer (sidecar.pressure.PressurePublisher, with the affinity
models the sidecar runs). Every 5 ms (PROXY_EVENT_POLL_MS' default) the producers write one
poll interval's worth of requests, spread over instances and rows, and then `tick()` runs as the
sidecar's loop runs it: drain every row, apply to the timelines, publish the pressure snapshot
(at most every 10 ms, at least every 100 ms). The steady state holds ~32 requests in flight
per instance at 4,000 requests/s in all: a streaming request writes reserve, first token (30%
into its life) and complete; a non-streaming one reserve and complete (the worker reports no
first token for a whole answer).

The figure is the thread CPU time (`time.thread_time_ns`) of `tick()` alone, summed over the
measured ticks and divided by the requests completed in them: drain + apply + publish,
amortised. The producer's time is outside it. Median over interleaved repeats. With
--baseline REF the same scenarios also run against the product as it was at REF (git archive,
this file copied in), each tree in its own long-lived subprocess, repeats interleaved A/B.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from cacheroute_proxy.config import Settings

ROOT = Path(__file__).resolve().parent.parent
INSTANCE_COUNTS = (2, 16)
MODES = ("stream", "non_stream")
READY_CONCURRENCY = 64
IN_FLIGHT_PER_INSTANCE = 32
REQUESTS_PER_S = 4000
POLL_S = Settings().event_poll_ms / 1000  # the sidecar's poll (PROXY_EVENT_POLL_MS)
WORKER_ROWS = 4
FIRST_TOKEN_AT = 0.3    # of a streaming request's life
WARMUP_TICKS = 60
MEASURED_TICKS = 200
TARGET_RATIO = 10.0


def case_name(instances: int, mode: str) -> str:
    return f"{instances}:{mode}"


class Scenario:
    """A segment, its producers and the sidecar's publisher, in a steady state of requests."""

    def __init__(self, instances: int, mode: str, seed: int) -> None:
        from proxy_workers.event_channel import EventChannelWriter
        from shm_schema import DirectoryWriter, Segment, WorkerRow, header
        from sidecar.affinity import AffinityModels
        from sidecar.pressure import PressurePublisher

        settings = Settings()
        self.name = f"/cacheroute_bench_events_{uuid.uuid4().hex[:10]}"
        self.seg = Segment.create_or_attach(self.name, settings.shm_instance_capacity,
                                            settings.shm_worker_capacity,
                                            settings.event_ring_capacity)
        self.rng = random.Random(seed)
        self.stream = mode == "stream"
        epoch = header.claim_sidecar(self.seg)
        writer = DirectoryWriter(self.seg)
        self.instances = [writer.allocate(f"instance-{i:02d}", "127.0.0.1", 9000 + i,
                                          now_ms=int(time.time() * 1000)) for i in range(instances)]
        self.rows = [WorkerRow.claim(self.seg, index) for index in range(WORKER_ROWS)]
        self.event_writers = [EventChannelWriter(self.seg, row) for row in self.rows]
        self.publisher = PressurePublisher(self.seg, epoch, READY_CONCURRENCY, settings.pace_step,
                                           affinity=AffinityModels(self.seg, lambda s, g: 0))
        self.per_tick = round(REQUESTS_PER_S * POLL_S)
        self.life_ticks = max(2, round(IN_FLIGHT_PER_INSTANCE * instances / self.per_tick))
        self._due: dict[int, list[tuple[str, Any, int]]] = defaultdict(list)
        self._next_instance = 0
        self.tick_number = 0

    def produce(self) -> int:
        """One poll interval of worker activity; returns the requests it completed."""
        now = self.tick_number
        for _ in range(self.per_tick):
            events = self.event_writers[self.rng.randrange(len(self.event_writers))]
            instance = self.instances[self._next_instance % len(self.instances)]
            self._next_instance += 1
            key = events.new_key()
            events.reserve(key, instance.slot, instance.generation, 20.0, 80.0, 64, 512)
            life = self.life_ticks + self.rng.randrange(-1, 2)
            if self.stream:
                self._due[now + max(1, round(life * FIRST_TOKEN_AT))].append(("first", events, key))
            self._due[now + life].append(("complete", events, key))
        completed = 0
        due = self._due.pop(now, [])
        self.rng.shuffle(due)  # the rows' writes interleave as the workers' requests end
        for what, events, key in due:
            if what == "first":
                events.first_token(key)
            else:
                events.complete(key, False)
                completed += 1
        self.tick_number += 1
        return completed

    def run(self, warmup: int, measured: int, poll_s: float = POLL_S) -> dict[str, Any]:
        """Ticks at the poll interval (the real one by default; 0 = back to back, caches
        warm); the CPU of the measured ticks per request."""
        cpu_ns = completed = consumed_before = 0
        deadline = time.monotonic()
        for index in range(warmup + measured):
            done = self.produce()
            deadline += poll_s
            pause = deadline - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            start = time.thread_time_ns()
            self.publisher.tick()
            spent = time.thread_time_ns() - start
            if index == warmup - 1:
                consumed_before = self.publisher.stats.consumed
            if index >= warmup:
                cpu_ns += spent
                completed += done
        stats = self.publisher.stats
        return {"us_per_request": cpu_ns / 1000 / max(completed, 1),
                "us_per_tick": cpu_ns / 1000 / max(measured, 1), "requests": completed,
                "events_per_request": (stats.consumed - consumed_before) / max(completed, 1),
                "published": stats.published,
                "dropped": stats.dropped_by_workers}

    def close(self) -> None:
        from shm_schema import Segment

        try:
            for row in self.rows:
                row.release()
            self.seg.close()
        finally:
            Segment.unlink(self.name)


def run_case(instances: int, mode: str, seed: int, warmup: int = WARMUP_TICKS,
             measured: int = MEASURED_TICKS, poll_s: float = POLL_S) -> dict[str, Any]:
    scenario = Scenario(instances, mode, seed)
    try:
        return scenario.run(warmup, measured, poll_s)
    finally:
        scenario.close()


def serve() -> None:
    """Subprocess mode: one JSON request per stdin line, one JSON result per stdout line."""
    import sidecar.pressure

    print(json.dumps({"ready": sidecar.pressure.__file__}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(run_case(ask["instances"], ask["mode"], ask["seed"], ask["warmup"],
                                  ask["measured"], ask["poll_s"])), flush=True)


class Tree:
    """A long-lived `--serve` subprocess running this benchmark against the product in `tree`."""

    def __init__(self, label: str, tree: Path) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self._proc = subprocess.Popen([sys.executable, "-m", "bench.bench_events", "--serve"],
                                      cwd=tree, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        hello = json.loads(self._proc.stdout.readline())
        self.module = hello["ready"]
        if not self.module.startswith(str(tree)):
            raise SystemExit(f"{label}: imported {self.module}, not from {tree}")

    def run(self, **ask: Any) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(ask) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.label}: the benchmark subprocess ended")
        return json.loads(line)

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def baseline_tree(ref: str, into: Path) -> Path:
    """The product at `ref` (bench/harness/baseline.py) with this file copied in, for --serve."""
    from bench.harness.baseline import baseline_tree as archive

    tree = archive(ref, into)
    shutil.copy(Path(__file__), tree / "bench" / "bench_events.py")
    return tree


def measure(trees: list[Tree], repeats: int, warmup: int, measured: int,
            poll_s: float) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict]]] = {t.label: defaultdict(list) for t in trees}
    for repeat in range(repeats):
        for instances in INSTANCE_COUNTS:
            for mode in MODES:
                order = trees if repeat % 2 == 0 else trees[::-1]
                for tree in order:  # A/B interleaved, alternating who goes first
                    result = tree.run(instances=instances, mode=mode, seed=repeat,
                                      warmup=warmup, measured=measured, poll_s=poll_s)
                    samples[tree.label][case_name(instances, mode)].append(result)
                    print(f"repeat {repeat} {tree.label:9s} {case_name(instances, mode):14s} "
                          f"{result['us_per_request']:7.2f} µs/request", file=sys.stderr)
    return {label: {case: summary(runs) for case, runs in per_case.items()}
            for label, per_case in samples.items()}


def summary(runs: list[dict]) -> dict[str, Any]:
    first = runs[0]
    return {"median_us_per_request": round(statistics.median(r["us_per_request"] for r in runs), 3),
            "repeats_us_per_request": [round(r["us_per_request"], 3) for r in runs],
            "median_us_per_tick": round(statistics.median(r["us_per_tick"] for r in runs), 2),
            "requests_per_repeat": first["requests"],
            "events_per_request": round(statistics.median(r["events_per_request"] for r in runs), 2),
            "dropped": max(r["dropped"] for r in runs)}


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    if "baseline" not in results:
        return {}
    out = {}
    for case, now in results["current"].items():
        before = results["baseline"][case]
        per_repeat = [round(b / a, 2) for a, b in zip(now["repeats_us_per_request"],
                                                       before["repeats_us_per_request"])]
        out[case] = {"median_ratio": round(statistics.median(per_repeat), 2),
                     "per_repeat": per_repeat}
    return out


def profile(case: str, ticks: int, top: int) -> None:
    instances, mode = case.split(":")
    scenario = Scenario(int(instances), mode, 0)
    try:
        scenario.run(WARMUP_TICKS, 0)
        profiler = cProfile.Profile(time.thread_time)
        for _ in range(ticks):
            scenario.produce()
            time.sleep(POLL_S)
            profiler.enable()
            scenario.publisher.tick()
            profiler.disable()
    finally:
        scenario.close()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=WARMUP_TICKS)
    p.add_argument("--measured", type=int, default=MEASURED_TICKS, help="ticks per repeat")
    p.add_argument("--poll-ms", type=float, default=POLL_S * 1000,
                   help="tick interval (default: PROXY_EVENT_POLL_MS' default; 0 = back to back, "
                        "caches warm: the code's own cost without what a 5 ms sleep evicts)")
    p.add_argument("--baseline", metavar="GIT_REF", default=None,
                   help="also measure the product as it was at GIT_REF, interleaved")
    p.add_argument("--profile", metavar="INSTANCES:MODE", default=None,
                   help="print a cProfile of the sidecar's ticks for one case, e.g. 16:stream")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    if args.profile:
        return profile(args.profile, args.measured * 2, 25)
    # Imported here, not at the top: a baseline tree runs this file with its own bench/ (--serve).
    from bench.harness.results import Run, git_commit, write_report

    provenance = Run("bench.bench_events", argv)
    with tempfile.TemporaryDirectory(prefix="bench_events_") as tmp:
        trees = [Tree("current", ROOT)]
        try:
            if args.baseline:
                trees.append(Tree("baseline", baseline_tree(args.baseline, Path(tmp))))
            results = measure(trees, args.repeats, args.warmup, args.measured, args.poll_ms / 1000)
        finally:
            for tree in trees:
                tree.close()
    data = {**provenance.record(), "benchmark": "events",
            "commit": git_commit(), "baseline_ref": args.baseline,
            "baseline_commit": git_commit(args.baseline) if args.baseline else None,
            "poll_ms": args.poll_ms, "results": results, "speedup_vs_baseline": ratios(results),
            "method": {
                "scenario": f"{'/'.join(map(str, INSTANCE_COUNTS))} instances, READY_CONCURRENCY "
                            f"{READY_CONCURRENCY}, ~{IN_FLIGHT_PER_INSTANCE} in flight per instance, "
                            f"{REQUESTS_PER_S} requests/s over {WORKER_ROWS} worker rows",
                "producer": "proxy_workers.event_channel.EventChannelWriter (the workers' own writer); "
                            "stream: reserve, first token, complete; non_stream: reserve, complete",
                "measured": f"thread CPU of PressurePublisher.tick() every {args.poll_ms:g} ms "
                            f"(drain + apply + publish), over {args.measured} ticks after "
                            f"{args.warmup}, divided by the requests completed in them",
                "repeats": f"{args.repeats}, interleaved across cases and A/B; medians"}}
    print(json.dumps(data, indent=2))
    if args.out:
        write_report(args.out, data)


if __name__ == "__main__":
    main()
