"""Run one proxy worker: bind the shared service port (SO_REUSEPORT) and a private port,
attach to the sidecar's segment, claim a worker row, serve until SIGTERM/SIGINT, then give
back whatever the worker still holds and free its row."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import socket
import time
from typing import Any, AsyncIterator, NamedTuple


from cacheroute_proxy import engine_prefix, exits, logs, serving
from cacheroute_proxy.auth import load_token
from cacheroute_proxy.config import Settings
from shm_schema import Segment, SegmentError, WorkerRow, WorkerTableFull

from proxy_workers.predictors import get_predictors

from . import metrics
from .admission_bell import open_bells
from .affinity import AffinityScorer
from .affinity_index import make_index
from .app import WorkerApp, WorkerContext, build_app, worker_name
from .drain import Drain
from .event_channel import EventChannelWriter
from cacheroute_proxy.http1 import Http1Server, head_limits
from .kdn_links import LinkRefresher, LinkTable, sidecar_links_url
from .knowledge import KnowledgePreparer
from .pipeline import Pipeline
from .router import Router
from .tracing import start_tracing
from .upstream import Upstream

log = logging.getLogger("cacheroute.worker")

SEGMENT_WAIT_S = 15.0
# How often a worker ticks its event channel (EventChannelWriter.tick). Spilled events are moved
# into the ring soon. With requests live a restarted sidecar learns of them by the first event
# any of them writes, or at the next tick: ticking every 20 ms for that alone would wake each
# worker ~50 times a second through every stream.
EVENT_TICK_S = 0.02
LIVE_EVENT_TICK_S = 0.5
IDLE_EVENT_TICK_S = 1.0  # nothing spilled, no request live: nothing to move or re-announce
# After a rolling restart's SIGTERM the predecessor closes its listeners within moments, but the
# replacement may be quicker: it waits this long for the private port instead of exiting 5
# (which would stop the whole supervisor).
PRIVATE_PORT_WAIT_S = 10.0
BACKLOG = 2048
# Collections start after this many more tracked objects allocated than freed (Python's
# default: 700). A request in flight holds ~25 of them and frees nearly all by reference
# counting, so at 32 requests in flight the default ran a collection every ~35 requests that
# found almost nothing.
GC_FIRST_THRESHOLD = 20_000


def bind_socket(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    """A bound socket, listening unless `listen` is False (then it holds the address, but the
    kernel queues no connection on it until `sock.listen(BACKLOG)`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # Every worker binds the same port; the kernel spreads new connections across them.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def bind_private(host: str, port: int, wait_s: float = PRIVATE_PORT_WAIT_S) -> socket.socket:
    """The private port (no SO_REUSEPORT), retrying EADDRINUSE for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return bind_socket(host, port, reuse_port=False)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            if not said:
                said = True
                log.info("private port %d is busy (a draining predecessor?); retrying for up to %.0fs",
                         port, wait_s)
            time.sleep(0.05)


class _Lifespan:
    """Starts and stops what lives as long as the server: upstream pool, row heartbeat, event
    ticks, the KDN links' refresh."""

    def __init__(self, ctx: WorkerContext, events: EventChannelWriter, links: LinkRefresher) -> None:
        self._ctx = ctx
        self._event_channel = events
        self._links = links

    @contextlib.asynccontextmanager
    async def __call__(self, app: object) -> AsyncIterator[None]:
        await self._ctx.upstream.start()
        pipeline = self._ctx.pipeline
        pipeline.listen()
        tracing = self._ctx.tracing
        tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._tick_events()),
                 asyncio.create_task(self._links.run())]
        settle_collector()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await self._ctx.upstream.close()
            if pipeline.bells is not None:
                pipeline.bells.close()
            if tracing is not None:  # the spans still batched go out before the worker does
                tracing.shutdown()

    async def _heartbeat(self) -> None:
        while True:
            self._ctx.router.row.heartbeat()
            await asyncio.sleep(1.0)

    async def _tick_events(self) -> None:
        """Move spilled events into the ring; re-announce live requests to a new sidecar."""
        channel = self._event_channel
        while True:
            channel.tick()
            await asyncio.sleep(EVENT_TICK_S if channel.spilled
                                else LIVE_EVENT_TICK_S if channel.live else IDLE_EVENT_TICK_S)


def bind_addresses(settings: Settings, index: int) -> tuple[socket.socket, socket.socket] | int:
    """(shared, private), or the exit status after one line naming the address that is taken.
    The shared port is bound first and at once -- a taken service address fails the start in
    moments -- but it listens only when the worker is about to serve: while this waits for a
    draining predecessor's private port, the segment or the app, no connection queues on a
    shared listener nobody accepts on."""
    host, port = settings.dp_host, settings.dp_port
    try:
        shared = bind_socket(host, port, reuse_port=True, listen=False)
    except OSError as exc:
        log.error("%s", exits.in_use_message(host, port, "service address (PROXY_DP_HOST/PORT)", exc))
        return exits.SERVICE_ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else exits.CANNOT_START
    host, port = settings.worker_private_host, settings.worker_private_port(index)
    try:
        private = bind_private(host, port)
    except OSError as exc:
        shared.close()
        log.error("%s", exits.in_use_message(host, port, "private address (PROXY_WORKER_PRIVATE_*)", exc))
        return exits.PRIVATE_ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else exits.CANNOT_START
    return shared, private


class WorkerParts(NamedTuple):
    ctx: WorkerContext
    events: EventChannelWriter
    links: LinkTable


def assemble(settings: Settings, seg: Segment, row: WorkerRow, index: int,
             tracing: Any = None) -> WorkerParts:
    """A worker's request path over its claimed row: router, upstream client, pipeline."""
    events = EventChannelWriter(seg, row, ring_requests=settings.sidecar_wake == "reservation")
    predictors = get_predictors(settings.predictor_profile)
    links = LinkTable.from_settings(settings)
    affinity = make_index(settings, seg, events)
    upstream = Upstream(settings, replace_trace_context=tracing is not None)
    preparer = KnowledgePreparer(settings, upstream, predictors, links)
    router = Router(settings, seg, row, AffinityScorer(settings, affinity, predictors, preparer,
                                                       engine_prefix.from_settings(settings)))
    pipeline = Pipeline(settings, events, preparer, predictors, router.view.ready_wait_ms, router.affinity,
                        open_bells(seg, row.row), router.booking)
    ctx = WorkerContext(settings=settings, index=index, router=router, upstream=upstream,
                        pipeline=pipeline, tracing=tracing)
    return WorkerParts(ctx, events, links)


def run(settings: Settings, index: int) -> int:
    bound = bind_addresses(settings, index)
    if isinstance(bound, int):
        return bound
    shared, private = bound
    try:
        seg = Segment.attach(settings.shm_name, wait_s=SEGMENT_WAIT_S)
    except SegmentError as exc:
        log.error("%s", exc)
        return exits.CANNOT_START
    try:
        row = WorkerRow.claim(seg, index)
    except WorkerTableFull as exc:
        log.error("%s", exc)
        seg.close()
        return exits.CANNOT_START
    try:
        metrics_dir = settings.resolved_metrics_dir
        try:
            metrics.open_store(metrics_dir)
        except OSError as exc:
            log.error("cannot open this worker's metrics file in %s (PROXY_METRICS_DIR): %s",
                      metrics_dir, exc.strerror or exc)
            return exits.CANNOT_START
        try:
            parts = assemble(settings, seg, row, index, start_tracing(settings, worker_name(index), index))
        except engine_prefix.EnginePrefixError as exc:
            log.error("%s", exc)
            return exits.CANNOT_START
        ctx, upstream = parts.ctx, parts.ctx.upstream
        refresher = LinkRefresher(parts.links, lambda: upstream.session, sidecar_links_url(settings),
                                  load_token(settings.cp_token, settings.cp_token_file),
                                  settings.kdn_links_refresh_s)
        app = build_app(ctx, lifespan=_Lifespan(ctx, parts.events, refresher))
        shared.listen(BACKLOG)
        log.info("worker %d serving %s (shared) and %s (private), row %d, strategy %s, view %s",
                 index, exits.host_port(settings.dp_host, settings.dp_port),
                 exits.host_port(settings.worker_private_host, settings.worker_private_port(index)),
                 row.row, ctx.router.policy.name, settings.load_view)

        return _serve(app, settings, [shared, private], index)
    finally:
        leftover = row.release()
        if leftover:
            log.warning("released inflight still held at exit: %s", leftover)
        seg.close()


def _serve(app: WorkerApp, settings: Settings, sockets: list[socket.socket], index: int) -> int:
    """Serve until SIGTERM/SIGINT, drain (proxy_workers/drain.py), tell systemd what it does."""
    drain = Drain(settings.drain_timeout_s)
    server = Http1Server(app.asgi, drain, settings.keepalive_timeout_s, head_limits(settings),
                         routes=app.routes)

    def describe(server: Http1Server) -> str:  # systemd's STATUS= line, every few seconds
        return f"worker {index}: {server.requests_in_flight()} requests in flight"
    logs.keep_control_after_signals()
    serving.serve(server, sockets, describe)
    logs.keep_control_after_signals()  # the loop gave its handlers back: still no kill before cleanup
    return 0 if server.has_started() else exits.SERVER_FAILED


def settle_collector() -> None:
    """Once the worker is built: what exists now lives as long as the worker, out of the
    collector's sight (a full collection scans only what requests allocate; it took ~40 ms
    otherwise), and collections wait for real garbage rather than for requests in flight."""
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_FIRST_THRESHOLD, second, third)
