"""Cost of instance selection and of the begin/end pair on the real shared-memory path.

Run:  python -m bench.bench_select --out bench/results/select.json

For 4, 16, 64 and 256 instances (each size in its own private segment of the default capacity
256, instances placed by DirectoryWriter, seeded random inflight counts set through a claimed
WorkerRow):

- least_load select: `proxy_workers.router.Router.choose()` with
  `Settings(instance_strategy="least_load", ...)`: cached directory snapshot, the three layers
  (inflight words, queue lanes, the sidecar's pressure snapshot, published fresh with random
  values), score, tie-break through the shared header cursor.
  The choice is one C call (cacheroute_proxy/routing/_least_load.c) where the install built
  it; `least_load_router_choose_python` is the same Router on the Python selector (what serves
  where no compiler was found), in the same run.
- least_load, inflight only: the same with every other weight 0 (only inflight is read).
- round_robin select: the same Router with the default strategy.
- kv_aware acquire: `Router.acquire` for a chat (a ~960-token system prompt, 14 blocks, and a
  short user turn, its keys derived anew each call as for a new request) and the lease's release, with
  `Settings(instance_strategy="kv_aware")`, the host-wide affinity index and the proxy's
  character blocks (no tokenizer), the guard's bounds past the table's spread (the predictions
  decide, as in nearly every real choice): the whole choice kv_aware makes (index refresh, holdings,
  the prompt's home, the predicted time to first token on each candidate, the guard, the claim
  it writes to the shared ring), beside least_load's acquire on the same table. The prompt's
  home holds its blocks, as the sidecar's model publishes them.
- dict least_load (baseline): what one process of the original does, a dict
  instance_id -> inflight and a min over it, ties rotated by a local counter.
- least_load formula floor (Python): the least a selection in plain Python can cost, its
  arithmetic alone: least_load's eight weighted terms written out in one expression per
  candidate, over columns already read (no reads of the table, no tie-break, no router). The
  Python selector feeds the same sums through least_load_totals, which takes any set of
  weighted components and skips unknown values, so it costs more; this row shows how much of
  its time no plain-Python form of the formula can save.
- begin+end pair: `WorkerRow.begin` + `WorkerRow.end` (journal, CAS loop, own-row mirror), and
  the dict baseline `d[k] += 1` / floored decrement.

Each figure is the median, over >= 7 repeats, of one timed loop of many calls
(`time.perf_counter_ns` around the loop; the loop's own overhead, ~20-40 ns, is included).
Repeats are interleaved across cases so a burst of noise from other tenants spreads over all of
them. Segments are private (unique names) and unlinked on exit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import msgspec

from bench.harness.results import Run, write_report
from bench.harness.stats import median
from cacheroute_proxy.affinity_keys import rendezvous_home
from cacheroute_proxy.config import Settings
from cacheroute_proxy.routing.least_load import DEFAULT_WEIGHTS, NATIVE_SELECTION
from proxy_workers.affinity import AffinityScorer
from proxy_workers.affinity_index import SharedAffinity
from proxy_workers.event_channel import EventChannelWriter
from proxy_workers.knowledge import KnowledgePreparer
from proxy_workers.predictors import get_predictors
from proxy_workers.request_model import Endpoint, recover
from proxy_workers.router import Router
from shm_schema import DirectoryWriter, Segment, WorkerRow, inflight_count, layout
from shm_schema.atomic import BACKEND
from shm_schema.counters import NATIVE_UPDATES
from shm_schema.events import EventReader
from shm_schema.snapshot import Pressure, SnapshotWriter
from sidecar.affinity import AffinityModels

SIZES = (4, 16, 64, 256)
CAPACITY = 256
TARGET_SELECT_16_US = 5.0  # docs/benchmarks.md, "Selection path"
TARGET_BEGIN_END_US = 1.0
TARGET_SECONDS_PER_LOOP = 0.04
BLOCK_TOKENS = Settings().affinity_block_tokens
SYSTEM_PROMPT = " ".join(f"rule {i}: answer from the cached documents only." for i in range(80))


def build() -> dict[str, str]:
    """What the figures depend on beside the machine: how the shared words are updated and how
    the choice is made (C where the install built it)."""
    import atomicshm
    return {
        "implementation": platform.python_implementation(),
        "atomicshm": atomicshm.__version__,
        "atomic_backend": BACKEND,
        "lane_updates": "C (shm_schema/_lanes.c)" if NATIVE_UPDATES else "Python closures",
        "selection": "C (cacheroute_proxy/routing/_least_load.c)" if NATIVE_SELECTION else "Python",
    }


class Table:
    """One segment with `n` instances, a claimed row and two routers over it."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.name = f"/cacheroute_bench_{uuid.uuid4().hex[:10]}"
        self.seg = Segment.create_or_attach(self.name, CAPACITY, 4)
        try:
            writer = DirectoryWriter(self.seg)
            self.instances = [writer.allocate(f"instance-{i:03d}", "127.0.0.1", 9000 + i,
                                              now_ms=1_000 + i) for i in range(n)]
            self.row = WorkerRow.claim(self.seg, 0)
            for inst in self.instances:
                for _ in range(rng.randrange(32)):
                    assert self.row.begin(inst.slot, inst.generation)
            # A fresh pressure snapshot (kept fresh for the whole run) and random queue lanes,
            # so least_load scores all three layers, as in production.
            now_us = int(time.time() * 1e6)
            SnapshotWriter(self.seg).publish({
                i.slot: Pressure(i.generation, rng.randrange(4), rng.randrange(8),
                                 now_us + rng.randrange(10**6), now_us + rng.randrange(10**6), now_us)
                for i in self.instances})
            for inst in self.instances:
                for lane in (layout.LANE_READY_ACTIVE, layout.LANE_PREPARE_WAITING):
                    for _ in range(rng.randrange(4)):
                        self.row.add(lane, inst.slot, inst.generation)
            common = dict(shm_name=self.name, shm_instance_capacity=CAPACITY,
                          shm_worker_capacity=4, workers=1, snapshot_stale_ms=1e9)
            self.least_load = Router(Settings(instance_strategy="least_load", **common),
                                     self.seg, self.row)
            only_inflight = {name: 0.0 for name in DEFAULT_WEIGHTS if name != "inflight"}
            self.least_load_python = Router(Settings(instance_strategy="least_load", **common),
                                            self.seg, self.row, native_selection=False)
            self.least_load_inflight = Router(Settings(instance_strategy="least_load",
                                                       least_load_weights=only_inflight, **common),
                                              self.seg, self.row)
            self.round_robin = Router(Settings(instance_strategy="round_robin", **common),
                                      self.seg, self.row)
            # The guard's bounds past the table's spread of requests in flight (0..31): the
            # predictions decide, as in nearly every real choice.
            self.kv_aware = self._kv_aware_router(Settings(
                instance_strategy="kv_aware", kv_aware_balance_abs=64, kv_aware_prompt_balance_abs=64,
                **common))
            self.chat = recover(Endpoint.CHAT, json.dumps({"messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "which document says so?"}]}).encode())
            self._hold_the_system_prompt()
            self._check()
        except BaseException:
            self.close()
            raise

    def _kv_aware_router(self, settings: Settings) -> Router:
        predictors = get_predictors(settings.predictor_profile)
        index = SharedAffinity(self.seg, EventChannelWriter(self.seg, self.row), settings.affinity_pending_s)
        scorer = AffinityScorer(settings, index, predictors,
                                KnowledgePreparer(settings, None, predictors))
        return Router(settings, self.seg, self.row, affinity=scorer)

    def _hold_the_system_prompt(self) -> None:
        """The row of the system prompt's home (its rendezvous one) in the affinity index holds
        the prompt's blocks, published by the sidecar's model from the PREFIX events a worker
        writes."""
        assert self.kv_aware.affinity is not None
        system = msgspec.structs.replace(self.chat, parsed_prompt=self.chat.parsed_prompt[:1])
        keys = self.kv_aware.affinity.prefix_of(system)
        assert len(keys) >= 14, "the system prompt fills its blocks"
        instance = self.instances[rendezvous_home(keys[0], [i.instance_id for i in self.instances])]
        EventChannelWriter(self.seg, self.row).residency(instance.slot, instance.generation, keys,
                                                         BLOCK_TOKENS, prefix=True)
        models = AffinityModels(self.seg, lambda slot, generation: 1 << 20)
        for event in EventReader(self.seg).drain(self.row.row):
            models.apply(event)
        models.publish()

    def least_load_acquire(self) -> None:
        """The same chat through least_load's choice and back."""
        self.least_load.acquire(frozenset(), self.chat).release()

    def kv_aware_acquire(self) -> None:
        """One chat through kv_aware's choice and back, its keys derived anew (a new request's)."""
        self.chat.prefix_keys = None
        self.kv_aware.acquire(frozenset(), self.chat).release()

    def _check(self) -> None:
        counts = {i.instance_id: inflight_count(self.seg, i.slot, i.generation) for i in self.instances}
        best = min(counts.values())
        for _ in range(8):
            assert counts[self.least_load.choose().instance_id] == best
            assert counts[self.least_load_python.choose().instance_id] == best
        self.chat.prefix_keys = None
        lease = self.kv_aware.acquire(frozenset(), self.chat)
        assert lease.choice.affinity is not None and lease.choice.guard is not None \
            and not lease.choice.guard.fired, "kv_aware chose on its predictions"
        lease.release()
        picked = {self.round_robin.choose().instance_id for _ in range(len(self.instances))}
        assert len(picked) == len(self.instances)

    def counts(self) -> dict[str, int]:
        return {i.instance_id: inflight_count(self.seg, i.slot, i.generation) or 0
                for i in self.instances}

    def close(self) -> None:
        try:
            for row in (getattr(self, "row", None), getattr(self, "python_row", None)):
                if row is not None:
                    row.release()
            self.seg.close()
        finally:
            Segment.unlink(self.name)


def dict_least_load(loads: dict[str, int]) -> Callable[[], str]:
    """The in-process baseline: min over a dict, exact ties rotated round-robin."""
    tie = itertools.count().__next__

    def select() -> str:
        best = min(loads.values())
        ties = [k for k, v in loads.items() if v == best]
        return ties[0] if len(ties) == 1 else ties[tie() % len(ties)]
    return select


def formula_floor(n: int, rng: random.Random) -> Callable[[], list[float]]:
    """least_load's sum over `n` candidates in its fastest plain-Python form: a fixed
    expression of the eight default weights, over columns as a selection would have read them
    (five counter lanes, the pending and decoding counts, the backlog in ms)."""
    weights = tuple(weight for weight in DEFAULT_WEIGHTS.values() if weight)
    assert len(weights) == 8, "the expression below writes out eight terms"
    counts = [[rng.randrange(32) for _ in range(n)] for _ in range(7)]
    backlog = [rng.random() * 1000 for _ in range(n)]
    w1, w2, w3, w4, w5, w6, w7, w8 = weights

    def totals() -> list[float]:
        return [w1 * a + w2 * b + w3 * c + w4 * d + w5 * e + w6 * f + w7 * g + w8 * h
                for a, b, c, d, e, f, g, h in zip(*counts, backlog)]
    return totals


def loop_of(call: Callable[[], object]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            call()
    return run


def calibrate(run: Callable[[int], None]) -> int:
    n = 200
    while True:
        start = time.perf_counter_ns()
        run(n)
        elapsed = time.perf_counter_ns() - start
        if elapsed > 5_000_000 or n >= 1 << 22:
            return max(1_000, int(n * TARGET_SECONDS_PER_LOOP * 1e9 / max(elapsed, 1)))
        n *= 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_select")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--repeats", type=int, default=9, help="timed loops per case (>= 7)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if args.repeats < 7:
        parser.error("--repeats must be >= 7")
    rng = random.Random(args.seed)
    started = time.monotonic()
    provenance = Run("bench.bench_select", argv)

    tables: dict[int, Table] = {}
    cases: dict[tuple[str, int | None], Callable[[int], None]] = {}
    try:
        for n in SIZES:
            table = tables[n] = Table(n, rng)
            cases[("least_load_router_choose", n)] = loop_of(table.least_load.choose)
            cases[("least_load_router_choose_python", n)] = loop_of(table.least_load_python.choose)
            cases[("least_load_inflight_only", n)] = loop_of(table.least_load_inflight.choose)
            cases[("round_robin_router_choose", n)] = loop_of(table.round_robin.choose)
            cases[("kv_aware_router_acquire", n)] = loop_of(table.kv_aware_acquire)
            cases[("least_load_router_acquire", n)] = loop_of(table.least_load_acquire)
            cases[("dict_least_load_baseline", n)] = loop_of(dict_least_load(table.counts()))
            cases[("least_load_formula_floor_python", n)] = loop_of(formula_floor(n, random.Random(n)))
        inst = tables[16].instances[0]
        row = tables[16].row
        slot, gen = inst.slot, inst.generation
        begin, end = row.begin, row.end  # bound, as Router.acquire / Lease.release call them

        def begin_end(n: int) -> None:
            for _ in range(n):
                begin(slot, gen)
                end(slot, gen)
        cases[("begin_end_pair", None)] = begin_end
        # The same pair through the Python closures (no compiler at install), on a second row.
        python_row = tables[16].python_row = WorkerRow.claim(tables[16].seg, 1)
        python_row._bind_updates(native=False)
        py_begin, py_end = python_row.begin, python_row.end

        def python_begin_end(n: int) -> None:
            for _ in range(n):
                py_begin(slot, gen)
                py_end(slot, gen)
        cases[("begin_end_pair_python", None)] = python_begin_end
        loads = {"instance-000": 0}

        def dict_begin(key: str) -> None:
            loads[key] += 1

        def dict_end(key: str) -> None:
            value = loads[key] - 1
            loads[key] = value if value > 0 else 0

        def dict_begin_end(n: int) -> None:
            for _ in range(n):
                dict_begin("instance-000")
                dict_end("instance-000")
        cases[("dict_begin_end_pair_baseline", None)] = dict_begin_end

        loops = {key: calibrate(run) for key, run in cases.items()}
        samples: dict[tuple[str, int | None], list[float]] = {key: [] for key in cases}
        for _ in range(args.repeats):
            for key, run in cases.items():
                n = loops[key]
                start = time.perf_counter_ns()
                run(n)
                samples[key].append((time.perf_counter_ns() - start) / n / 1_000)
        before_end = tables[16].counts()["instance-000"]
        assert before_end == inflight_count(tables[16].seg, slot, gen)
    finally:
        for table in tables.values():
            table.close()

    results: dict[str, dict[str, dict]] = {}
    for (case, n), values in samples.items():
        results.setdefault(case, {})[str(n) if n is not None else "any"] = {
            "median_us": median(values, 3),
            "min_us": round(min(values), 3),
            "max_us": round(max(values), 3),
            "loops": loops[(case, n)],
            "repeats": len(values),
        }
    ll16 = results["least_load_router_choose"]["16"]["median_us"]
    rr16 = results["round_robin_router_choose"]["16"]["median_us"]
    pair = results["begin_end_pair"]["any"]["median_us"]
    report = {
        **provenance.record(),
        "build": build(),
        "method": ("median over interleaved repeats of one timed loop of many calls "
                   "(time.perf_counter_ns); per-call microseconds, loop overhead included; "
                   f"segments of capacity {CAPACITY}, inflight counts random 0..31 (seed {args.seed})"),
        "sizes": list(SIZES),
        "results": results,
        "targets": {
            "select_16_instances_us": TARGET_SELECT_16_US,
            "begin_end_pair_us": TARGET_BEGIN_END_US,
            "least_load_select_16_met": ll16 <= TARGET_SELECT_16_US,
            "round_robin_select_16_met": rr16 <= TARGET_SELECT_16_US,
            "begin_end_pair_met": pair <= TARGET_BEGIN_END_US,
        },
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print_table(report)
    if args.out:
        write_report(args.out, report)
    return 0


def print_table(report: dict) -> None:
    res = report["results"]
    m, b = report["machine"], report["build"]
    print(f"# {m['cpu_model']} | nproc {m['nproc']} | Python {m['python']} | {b['atomic_backend']} | "
          f"updates in {b['lane_updates']} | selection in {b['selection']}")
    print(f"# median us per call over {res['begin_end_pair']['any']['repeats']} repeats; "
          f"loadavg {m['loadavg']} -> {m['at_end']['loadavg']}")
    header = f"{'case':<36}" + "".join(f"{'n=' + str(n):>10}" for n in report["sizes"])
    print(header)
    print("-" * len(header))
    for case in ("least_load_router_choose", "least_load_router_choose_python",
                 "least_load_inflight_only", "round_robin_router_choose",
                 "least_load_formula_floor_python", "dict_least_load_baseline",
                 "least_load_router_acquire", "kv_aware_router_acquire"):
        print(f"{case:<36}" + "".join(f"{res[case][str(n)]['median_us']:>10.2f}" for n in report["sizes"]))
    for case in ("begin_end_pair", "begin_end_pair_python", "dict_begin_end_pair_baseline"):
        print(f"{case:<36}{res[case]['any']['median_us']:>10.2f}   (size-independent)")
    t = report["targets"]
    print(f"target select(16) <= {t['select_16_instances_us']} us: least_load "
          f"{'MET' if t['least_load_select_16_met'] else 'MISSED'} "
          f"({res['least_load_router_choose']['16']['median_us']:.2f} us), round_robin "
          f"{'MET' if t['round_robin_select_16_met'] else 'MISSED'} "
          f"({res['round_robin_router_choose']['16']['median_us']:.2f} us)")
    print(f"target begin+end <= {t['begin_end_pair_us']} us: "
          f"{'MET' if t['begin_end_pair_met'] else 'MISSED'} "
          f"({res['begin_end_pair']['any']['median_us']:.2f} us)")
    print(f"wall {report['wall_seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
