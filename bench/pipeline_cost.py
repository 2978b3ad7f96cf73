"""Where a worker's CPU goes on one proxied request, measured in one process with no client
socket (`python -m bench.pipeline_cost`).

The worker's real parts over a private segment with two instances registered and a fresh
pressure snapshot of them, as the sidecar keeps one: DataPlane.serve
(body recovery, selection, lease, pipeline, trace, forward, meta, metrics, events) and the real
upstream client over loopback to canned upstreams on the same event loop. The client side is a
fake connection that counts the bytes it is given, so nothing of the HTTP server's parsing or
socket writes is in the figures: this is the part of a request that is this product's own.

Variants, interleaved block by block in the same process (CPU time per request; the median
and the fastest of the repeats, a part's cost being the difference of the fastest blocks):
- `full`: every part (a plain request: the lean path, proxy_workers/plain_path.py);
- `exchange`: the same request through the exchange and the pipeline, as a request the lean
  path does not take goes;
- `without metrics`, `without events`, `without meta`, `without predictions`, `without
  disconnect watch`, `without admission`: the same with one part replaced by a no-op or its
  bare minimum (the metric files' writes; the reserve/complete events to the sidecar; encoding
  the trace and splicing it into the answer; the reserve's predicted service, decode and queue
  wait; watching the client for a disconnect; the whole pipeline stage -- release order,
  host-wide admission, events, predictions -- forwarding at once), so the difference is that
  part's cost;
- `relay floor`: bench-peers' relay floor (bench/peers/relay_floor.py) on the same client:
  read the body, open the next upstream, read its answer, send it whole: what any proxy on this
  client and server pays.

Then each variant again one request at a time on evicted caches (`--cold-requests`, in a
shuffled order each round): before each, a 64 MiB buffer is written through, so the request
finds neither its code nor its data in any cache, as when requests come tens of milliseconds
apart on a machine the engines share. Thread CPU per request, median; a part's cold cost is
the full path's median minus the variant's.

After the blocks, one more block of the full path runs under cProfile: what a request costs by
function (calls a request, a coroutine counted at each resumption; and the share of the
profiled own time, shown as µs of the unprofiled full path) and by package. The profiler adds
a fixed cost to every call, so a function called often weighs more in it than it does
unprofiled: the shares say where the time is, not to the microsecond.

The event ring is drained between blocks, as the sidecar would. Bounded: `--requests` per
block, `--repeats` blocks per variant; everything it creates (the segment, the metrics
directory) is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import os
import pstats
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import uvloop

from bench.harness.results import Run, write_report
from bench.harness.stats import median

BODY = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 4, "stream": False}, separators=(",", ":")).encode()
ANSWER = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                     "model": "sim-model", "choices": [{"index": 0, "message": {
                         "role": "assistant", "content": "Hello there, friend."}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}}).encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"date: Tue, 01 Dec 2026 17:00:00 GMT\r\nserver: uvicorn\r\nx-request-id: 1\r\n\r\n%s"
            % (len(ANSWER), ANSWER))
HEADERS = [(b"host", b"127.0.0.1:8001"), (b"user-agent", b"wrk"), (b"content-type", b"application/json"),
           (b"content-length", str(len(BODY)).encode())]
CONCURRENCY = 32
PROFILE_TOP = 25  # functions listed in the by-function profile
EVICTION_BYTES = 64 << 20  # written through before each cold request: more than any cache here
CACHE_LINE = 64
_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


class CannedUpstream(asyncio.Protocol):
    """Answers every complete request on the connection with RESPONSE at once."""

    def connection_made(self, transport: Any) -> None:
        self.transport, self.pending = transport, b""

    def data_received(self, data: bytes) -> None:
        self.pending += data
        while (end := self.pending.find(b"\r\n\r\n")) >= 0:
            head = self.pending[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.pending) < end + 4 + length:
                return
            self.pending = self.pending[end + 4 + length:]
            self.transport.write(RESPONSE)


class CountingConnection:
    """What a Cycle writes to and tells: a client that takes everything at once."""
    write_paused = False
    client, local = ("127.0.0.1", 1), ("127.0.0.1", 8001)

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def response_done(self, cycle: Any) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    async def writable(self) -> None:
        pass


@contextlib.contextmanager
def replaced(target: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


class Worker:
    """A worker's parts, assembled as proxy_workers/server.py does it, over a private segment."""

    def __init__(self, ports: list[int]) -> None:
        from bench.peers.relay_floor import Relay
        from cacheroute_proxy.config import Settings
        from proxy_workers.app import DataPlane
        from proxy_workers.server import assemble
        from shm_schema import DirectoryWriter, Segment, WorkerRow
        from shm_schema.events import EventReader

        self.name = f"/cacheroute_cost_{uuid.uuid4().hex[:10]}"
        settings = Settings(instance_strategy="least_load", ready_concurrency=64, prepare_concurrency=64)
        self.seg = Segment.create_or_attach(self.name, 64, 2, 4096)
        writer = DirectoryWriter(self.seg)
        self.instances = [writer.allocate(f"inst-{i}", "127.0.0.1", port) for i, port in enumerate(ports)]
        self.row = WorkerRow.claim(self.seg, 0)
        parts = assemble(settings, self.seg, self.row, 0)
        ctx = parts.ctx
        self.upstream = ctx.upstream
        self.plane = DataPlane(ctx)
        self.events = EventReader(self.seg)
        # bench-peers' relay floor over the same client and instances: one floor for both benches.
        self.floor = Relay([f"http://127.0.0.1:{port}" for port in ports], ctx.upstream).handle

    async def full(self, cycle: Any) -> None:
        from proxy_workers.request_model import Endpoint
        cycle.task = asyncio.current_task()  # as the server's Connection sets it
        await self.plane.serve(Endpoint.CHAT, cycle)

    def drain_events(self) -> None:
        for _ in self.events.drain(self.row.row):
            pass

    def publish_snapshot(self) -> None:
        """A fresh pressure snapshot of both instances, as the sidecar keeps one: a request's
        booking reads its predicted ready wait from it (untimed; fresh for PROXY_SNAPSHOT_STALE_MS,
        longer than a block)."""
        from shm_schema.records import SnapshotRecord
        from shm_schema.snapshot import SnapshotWriter
        SnapshotWriter(self.seg).publish({
            record.slot: SnapshotRecord(record.generation, 0, 0, 0, 0, 0) for record in self.instances})

    def close(self) -> None:
        from shm_schema import Segment
        self.row.release()
        self.seg.close()
        Segment.unlink(self.name)


@contextlib.asynccontextmanager
async def canned_worker() -> AsyncIterator[Worker]:
    """A Worker over two canned upstreams on this loop; all of it closed afterwards."""
    from proxy_workers.server import settle_collector

    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(CannedUpstream, "127.0.0.1", 0) for _ in range(2)]
    worker = Worker([s.sockets[0].getsockname()[1] for s in servers])
    thresholds = gc.get_threshold()
    settle_collector()  # the collector as a worker sets it: what a request allocates weighs as there
    try:
        yield worker
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        worker.close()
        for server in servers:
            server.close()


def a_cycle(connection: Any = None) -> Any:
    """One request, its body already read, on `connection` (a CountingConnection by default)."""
    from cacheroute_proxy.http1 import Cycle
    cycle = Cycle(connection or CountingConnection(), "POST", b"/v1/chat/completions", b"",
                  list(HEADERS), "1.1", True)
    cycle.feed(BODY)
    cycle.end_of_body()
    return cycle


VARIANTS = ("full", "exchange", "without metrics", "without events", "without meta", "without predictions",
            "without disconnect watch", "without admission", "relay floor")


def variants(worker: Worker) -> dict[str, tuple[Callable[[Any], Awaitable[None]], Callable[[], Any]]]:
    from proxy_workers import event_channel, exchange, metrics, pipeline, plain_path, relay

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def book_unpredicted(self: Any, lease: Any, request: Any, trace: Any, key: int, knowledge: Any = None) -> None:
        self._events.reserve(key, lease.instance.slot, lease.instance.generation, 1.0, 1.0,
                             request.decode_tokens, request.prompt_tokens)

    class Unwatched:  # a DisconnectWatch watching nothing
        @staticmethod
        def absorbed() -> bool:
            return False

        @staticmethod
        def disarm() -> None:
            return None

    def unwatched(cycle: Any) -> Unwatched:
        return Unwatched()

    def admitted(self: Any, lease: Any, job: Any) -> bool:
        return True

    def admitted_plain(self: Any, lease: Any, trace: Any) -> tuple[Any, int]:
        trace.proxy_enqueue_ms = trace.ready_enqueue_ms = 0  # read by the booking and the forward
        return self._stages_for(lease), 0
    runs = {
        "full": (worker.full, contextlib.nullcontext),
        # the same request through the exchange, as one the lean path does not take goes
        "exchange": (worker.full, lambda: replaced(plain_path.PlainPath, "takes", lambda self, request: False)),
        "without metrics": (worker.full, lambda: replaced(metrics, "observe_request", nothing)),
        "without events": (worker.full, lambda: _without_events(event_channel.EventChannelWriter, nothing)),
        "without meta": (worker.full, lambda: _without_meta(relay)),
        "without predictions": (worker.full, lambda: replaced(pipeline.Pipeline, "book", book_unpredicted)),
        "without disconnect watch": (worker.full, lambda: _replaced_in((exchange, plain_path), "watch_disconnect", unwatched)),
        "without admission": (worker.full, lambda: _without_admission(pipeline.Pipeline, admitted, admitted_plain, nothing)),
        "relay floor": (worker.floor, contextlib.nullcontext),
    }
    assert tuple(runs) == VARIANTS
    return runs


@contextlib.contextmanager
def _without_events(cls: Any, nothing: Callable[..., None]) -> Iterator[None]:
    with replaced(cls, "reserve", nothing), replaced(cls, "complete", nothing):
        yield


@contextlib.contextmanager
def _without_admission(cls: Any, admitted: Callable[..., bool], admitted_plain: Callable[..., Any],
                       nothing: Callable[..., None]) -> Iterator[None]:
    with replaced(cls, "admit_at_once", admitted), replaced(cls, "admit_plain", admitted_plain), \
            replaced(cls, "forwarded", nothing), replaced(cls, "leave_ready", nothing):
        yield


@contextlib.contextmanager
def _without_meta(relay: Any) -> Iterator[None]:
    with replaced(relay, "encode_meta", lambda *a, **k: b"{}"), \
            replaced(relay, "meta_spliced", lambda body, meta: (body, True)):
        yield


@contextlib.contextmanager
def _replaced_in(modules: tuple[Any, ...], name: str, value: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(replaced(module, name, value))
        yield


async def serve_batches(worker: Worker, handler: Callable[[Any], Awaitable[None]], batches: int) -> None:
    """`batches` rounds of CONCURRENCY requests at once, the event ring drained after each, as
    the sidecar would."""
    for _ in range(batches):
        await asyncio.gather(*(handler(a_cycle()) for _ in range(CONCURRENCY)))
        worker.drain_events()


async def measure(requests: int, repeats: int,
                  cold_requests: int = 0) -> tuple[dict[str, list[float]], dict[str, list[float]], pstats.Stats]:
    """Per variant: CPU µs per request of each warm block, each cold request's; and the profile."""
    async with canned_worker() as worker:
        runs = variants(worker)
        cold = await measure_cold(worker, runs, cold_requests)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        batches = max(1, requests // CONCURRENCY)
        for handler, _ in runs.values():  # warm every path (pools, plans, caches)
            await serve_batches(worker, handler, 10)
        for _ in range(repeats):
            for name, (handler, context) in runs.items():
                gc.collect()
                worker.publish_snapshot()
                with context():
                    started = time.process_time()
                    await serve_batches(worker, handler, batches)
                    elapsed = time.process_time() - started
                samples[name].append(elapsed / (batches * CONCURRENCY) * 1e6)
        worker.publish_snapshot()
        profiler = cProfile.Profile()
        profiler.enable()
        await serve_batches(worker, worker.full, batches)
        profiler.disable()
        return samples, cold, pstats.Stats(profiler)


async def measure_cold(worker: Worker, runs: dict[str, tuple[Callable[[Any], Awaitable[None]],
                                                             Callable[[], Any]]],
                       rounds: int) -> dict[str, list[float]]:
    """Each variant's thread CPU µs for one request on evicted caches, `rounds` times, the
    variants in a shuffled (seeded) order each round."""
    samples: dict[str, list[float]] = {name: [] for name in runs} if rounds else {}
    evicted = bytearray(EVICTION_BYTES)
    lines = b"\x01" * (EVICTION_BYTES // CACHE_LINE)
    order = list(runs.items())
    shuffle = random.Random(7).shuffle
    for done in range(rounds):
        shuffle(order)
        for name, (handler, context) in order:
            with context():
                cycle = a_cycle()
                worker.publish_snapshot()
                evicted[::CACHE_LINE] = lines  # one byte a cache line, through the whole buffer
                started = time.thread_time_ns()
                await handler(cycle)
                samples[name].append((time.thread_time_ns() - started) / 1000)
        if done % 16 == 15:
            worker.drain_events()
    worker.drain_events()
    return samples


def cold_results(samples: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    """Each variant's median cold µs, and the full path's median less it (None for full)."""
    if not samples:
        return {}
    medians = {name: median(values, 1) for name, values in samples.items()}
    return {name: {"median_us": value,
                   "part_us": None if name == "full" else round(medians["full"] - value, 1)}
            for name, value in medians.items()}


def by_function(stats: pstats.Stats, requests: int, full_us: float) -> dict[str, Any]:
    """The profiled block's own time by function and by package: calls a request, share of
    the profiled own time, and that share of `full_us` (the unprofiled full path)."""
    rows: dict[str, list[float]] = {}
    for (path, line, function), (_, calls, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        name = _where(path, line, function)
        row = rows.setdefault(name, [0, 0.0])
        row[0] += calls
        row[1] += own_s
    total_s = sum(own for _, own in rows.values()) or 1.0
    packages: dict[str, float] = {}
    for name, (_, own_s) in rows.items():
        package = _package(name)
        packages[package] = packages.get(package, 0.0) + own_s

    def share(own_s: float) -> dict[str, float]:
        return {"share": round(own_s / total_s, 4), "us": round(own_s / total_s * full_us, 2)}
    top = sorted(rows.items(), key=lambda item: -item[1][1])[:PROFILE_TOP]
    return {"requests": requests, "full_us": round(full_us, 1),
            "functions": [{"function": name, "calls_per_request": round(calls / requests, 2), **share(own_s)}
                          for name, (calls, own_s) in top],
            "packages": [{"package": package, **share(own_s)}
                         for package, own_s in sorted(packages.items(), key=lambda item: -item[1])]}


def _where(path: str, line: int, function: str) -> str:
    """A profiled function as pstats names it, by the path it has in this repository (or its
    module's file name elsewhere; a built-in by its name)."""
    if path == "~":
        return function.strip("<>")
    if path.startswith(_ROOT) and "site-packages" not in path:
        return f"{path[len(_ROOT):]}:{line}({function})"
    return f"{Path(path).name}:{line}({function})"


def _package(name: str) -> str:
    """The repository's package (or subpackage of cacheroute_proxy) a function is in; `other`:
    the standard library, third-party modules and built-ins; `bench`: this harness's canned
    upstream and client."""
    parts = name.split(":", 1)[0].split("/")
    if len(parts) < 2:
        return "other (stdlib, libraries, built-ins)"
    if parts[0] == "cacheroute_proxy" and len(parts) > 2:
        return "/".join(parts[:2])
    return "bench (the canned upstream and client)" if parts[0] == "bench" else parts[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2048, help="requests per block")
    parser.add_argument("--repeats", type=int, default=9, help="blocks per variant")
    parser.add_argument("--cold-requests", type=int, default=300,
                        help="requests of each variant on evicted caches (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    provenance = Run("bench.pipeline_cost", argv)
    metrics_dir = tempfile.mkdtemp(prefix="cacheroute-cost-metrics-")
    from proxy_workers import metrics
    metrics.open_store(metrics_dir)  # as a worker does: its own file, real writes
    try:
        samples, cold_samples, profile = uvloop.run(measure(args.requests, args.repeats, args.cold_requests))
    finally:
        metrics.open_store(None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    # A part's cost from the fastest blocks: on a shared machine other tenants only ever add.
    full = min(samples["full"])
    results = {name: {"median_us": median(values, 1), "min_us": round(min(values), 1),
                      "part_us": round(full - min(values), 1) if name != "full" else None}
               for name, values in samples.items()}
    print(f"# CPU us per request, median of {args.repeats} blocks of {args.requests} "
          f"(loadavg {os.getloadavg()[0]:.2f})")
    for name, r in results.items():
        part = "" if r["part_us"] is None else f"   full - this (fastest) = {r['part_us']:6.1f}"
        print(f"{name:<26}{r['median_us']:8.1f} (min {r['min_us']:6.1f}){part}")
    cold = cold_results(cold_samples)
    if cold:
        print(f"# cold: CPU us of one request on evicted caches, median of {args.cold_requests}")
        for name, r in cold.items():
            part = "" if r["part_us"] is None else f"   full - this = {r['part_us']:6.1f}"
            print(f"{name:<26}{r['median_us']:8.1f}{part}")
    profiled = by_function(profile, max(1, args.requests // CONCURRENCY) * CONCURRENCY,
                           results["full"]["median_us"])
    print("# the full path by package (share of the profiled own time, as us of the median)")
    for row in profiled["packages"]:
        print(f"{row['package']:<40}{row['share'] * 100:6.1f} %{row['us']:8.1f}")
    if args.out:
        report = {**provenance.record(),
                  "requests_per_block": args.requests, "repeats": args.repeats,
                  "concurrency": CONCURRENCY, "results": results, "profile": profiled,
                  "cold_requests": args.cold_requests, "cold": cold,
                  "method": ("CPU time (time.process_time) per request of each variant, blocks "
                             "interleaved in one process; a part is the fastest full block minus "
                             "the fastest block without it. Profile: one more block of the full "
                             "path under cProfile; a function's (or package's) share of the "
                             "profiled own time, shown as that share of the full path's median; "
                             "the profiler's cost a call makes often-called functions weigh more; a "
                             "coroutine's calls count its resumptions. Cold: each variant one "
                             "request at a time after a 64 MiB buffer was written through (a byte "
                             "a cache line), thread CPU (time.thread_time_ns), median; a part is "
                             "the full median minus the variant's")}
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
