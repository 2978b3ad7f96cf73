"""Run the sidecar: own the segment, serve the control plane, keep the directory and the
worker rows honest with periodic sweeps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Awaitable, Callable

import uvicorn
from starlette.applications import Starlette

from cacheroute import logs
from cacheroute.config import Settings
from cacheroute.routing.load_view import LoadView
from cacheroute.routing.strategies import LeastLoadStrategy
from shm_schema import Segment, SegmentError, header

from .app import SidecarState, build_app
from .pressure import PressurePublisher
from .reaper import WorkerReaper
from .registry import InstanceRegistry

log = logging.getLogger("cacheroute.sidecar")


def open_segment(settings: Settings) -> Segment:
    seg = Segment.create_or_attach(settings.shm_name, settings.shm_instance_capacity,
                                   settings.shm_worker_capacity, settings.event_ring_capacity)
    other = header.other_live_sidecar(seg)
    if other is not None:
        seg.close()
        raise SegmentError(f"another sidecar (pid {other}) already owns {settings.shm_name}")
    return seg


def build_state(settings: Settings, seg: Segment) -> SidecarState:
    epoch = header.claim_sidecar(seg)
    registry = InstanceRegistry(seg, settings.instance_ttl_s, settings.instance_purge_grace_s)
    adopted = 0 if seg.created else registry.rebuild()
    log.info("%s shared table %s (epoch %d, creation id %016x%s)",
             "created" if seg.created else "re-attached to", seg.name, epoch, seg.creation_id,
             f", adopted {adopted} instances" if adopted else "")
    reaper = WorkerReaper(seg)
    pressure = PressurePublisher(seg, epoch, settings.ready_concurrency)
    reaper.before_reap.append(pressure.drain_dead_row)
    return SidecarState(settings=settings, seg=seg, registry=registry, reaper=reaper,
                        pressure=pressure, view=LoadView(seg),
                        scorer=LeastLoadStrategy(settings.least_load_weights), epoch=epoch)


async def _every(interval_s: float, step: Callable[[], None], name: str) -> None:
    while True:
        try:
            step()
        except Exception:  # a bug in one sweep must not stop the others
            log.exception("%s failed", name)
        await asyncio.sleep(interval_s)


def _lifespan(state: SidecarState) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        settings = state.settings
        loops: list[Awaitable[None]] = [
            _every(min(1.0, settings.instance_ttl_s / 10), state.registry.sweep, "liveness sweep"),
            _every(settings.reaper_interval_s, state.reaper.tick, "worker reaper"),
            _every(settings.event_poll_ms / 1000, state.pressure.tick, "event channel"),
            _every(1.0, lambda: header.sidecar_heartbeat(state.seg), "sidecar heartbeat"),
        ]
        tasks = [asyncio.create_task(loop) for loop in loops]
        log.info("control plane on http://%s:%d", settings.cp_host, settings.cp_port)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return lifespan


def run(settings: Settings) -> int:
    try:
        seg = open_segment(settings)
    except SegmentError as exc:
        log.error("%s", exc)
        return 2
    try:
        state = build_state(settings, seg)
        app = build_app(state)
        app.router.lifespan_context = _lifespan(state)
        config = uvicorn.Config(app, host=settings.cp_host, port=settings.cp_port, loop="uvloop",
                                http="httptools", lifespan="on", log_config=None,
                                log_level=settings.log_level, access_log=False,
                                timeout_graceful_shutdown=5)
        logs.keep_control_after_signals()
        server = uvicorn.Server(config)
        server.run()
        return 0 if server.started else 3
    finally:
        header.release_sidecar(seg)
        seg.close()
