"""Run the sidecar: own the segment, serve the control plane, keep the directory and the
worker rows honest with periodic sweeps."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from typing import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette

from cacheroute_proxy import exits, logs, serving, sysctl_check
from cacheroute_proxy.affinity_keys import knowledge_key
from cacheroute_proxy.auth import load_token
from cacheroute_proxy.config import Settings
from cacheroute_proxy.doorbell import open_doorbell
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.least_load import LeastLoadPolicy
from cacheroute_proxy.http1 import GracefulExit, Http1Server, head_limits
from shm_schema import Segment, SegmentError, header

from .affinity import AffinityModels, kv_capacity_tokens
from .app import SidecarState, build_app
from .host_header_check import HostHeaderCheck
from .kv_events import KvEventFeeds, zmq_missing
from . import pool_resource
from .pressure import PressurePublisher
from .prompt_homes import PromptHomes
from .reaper import WorkerReaper
from .registry import InstanceRegistry
from .scheduler_link import make_link
from .static_prober import StaticProber
from .topology import Topology
from .ui_listener import ByListener, ui_app

# What a request in flight at SIGTERM gets before the control plane closes (a registration, a
# heartbeat, a dashboard read: all short).
SHUTDOWN_GRACE_S = 5.0
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
    affinity = AffinityModels(seg, lambda slot, generation: kv_capacity_tokens(registry, settings,
                                                                               slot, generation))
    kept = 0 if seg.created else affinity.adopt()
    if kept:
        log.info("kept %d affinity entries of the previous sidecar", kept)
    registry.on_kv_reset.append(affinity.forget)
    registry.on_resident_keys.append(
        lambda record, kids: affinity.report(record.slot, record.generation, map(knowledge_key, kids)))
    homes = PromptHomes(seg, settings.affinity_home_halflife_s, settings.affinity_home_tolerance,
                       settings.affinity_block_tokens)
    if not seg.created and homes.adopt():
        log.info("kept the prompt homes of the previous sidecar")
    pressure = PressurePublisher(seg, epoch, settings.ready_concurrency, settings.pace_step,
                                 heartbeat_s=settings.snapshot_heartbeat_s, affinity=affinity, homes=homes)
    reaper.before_reap.append(pressure.drain_dead_row)
    pressure.on_rows_changed.append(reaper.tick)
    topology = Topology()
    registry.on_removed.append(topology.forget)  # an instance's links leave with it
    state = SidecarState(settings=settings, seg=seg, registry=registry, reaper=reaper,
                         pressure=pressure, view=LoadView(seg),
                         scorer=LeastLoadPolicy(settings.least_load_weights), epoch=epoch,
                         topology=topology)
    state.scheduler = make_link(
        settings, lambda proxy_id: pool_resource.snapshot_of(registry, state.view, settings, proxy_id),
        lambda: settings.instance_count if settings.instance_count is not None
        else len(registry.records(include_dead=False)),
        lambda: any(worker["alive"] for worker in reaper.workers()),
        kdn_links=state.kdn_links)
    state.kv_events = KvEventFeeds(registry, affinity, settings.kv_event_endpoints,
                                   settings.affinity_block_tokens, enabled=bool(settings.affinity_tokenizer))
    if settings.static_targets:
        state.static = StaticProber(registry, settings.static_targets, settings.static_probe_s)
        state.static.adopt()
    return state


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
        doorbell = open_doorbell(settings.shm_name)
        header.set_sidecar_sleeping(state.seg, False)  # a killed predecessor may have left it set
        state.reaper.watch_exits(asyncio.get_running_loop())
        loops: list[Awaitable[None]] = [
            _every(min(1.0, settings.instance_ttl_s / 10), state.registry.sweep, "liveness sweep"),
            _every(settings.reaper_interval_s, state.reaper.tick, "worker reaper"),
            state.pressure.run(settings.event_poll_ms / 1000, doorbell),
        ]
        if state.static is not None:
            loops.append(state.static.run())
        if state.kv_events is not None:
            loops.append(state.kv_events.run())
        tasks = [asyncio.create_task(loop) for loop in loops]
        if state.scheduler is not None:  # background: a slow or absent Scheduler delays nothing
            state.scheduler.start()
            tasks.append(asyncio.create_task(_leave_scheduler_on_sigusr1(state)))
        log.info("control plane on http://%s:%d", settings.cp_host, settings.cp_port)
        try:
            yield
        finally:
            if state.scheduler is not None:
                # The proxy leaves the Scheduler when it stops as a whole (SIGUSR1 already did,
                # or no worker is left); a sidecar restarting under live workers stays
                # registered, and its successor's register is an upsert.
                alive = any(worker["alive"] for worker in state.reaper.workers())
                await state.scheduler.stop(unregister=not alive)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.reaper.close()
            if doorbell is not None:
                doorbell.close()
            header.set_sidecar_sleeping(state.seg, False)  # the next sidecar starts polling
    return lifespan


async def _leave_scheduler_on_sigusr1(state: SidecarState) -> None:
    """SIGUSR1 = the whole proxy is stopping (the supervisor sends it before the workers drain):
    unregister now, so the Scheduler stops sending requests to workers that no longer accept.
    The sidecar itself keeps serving until its own SIGTERM."""
    asked = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, asked.set)
    await asked.wait()
    log.info("SIGUSR1: the proxy is stopping; leaving the Scheduler before the workers drain")
    assert state.scheduler is not None
    await state.scheduler.stop()


def status_line(state: SidecarState) -> str:
    """What `systemctl status` shows for the sidecar (refreshed every few seconds)."""
    records = state.registry.records()
    alive = sum(1 for record in records if record.alive)
    workers = sum(1 for worker in state.reaper.workers() if worker["alive"])
    return f"serving: {alive} of {len(records)} instances alive, {workers} workers, epoch {state.epoch}"


def bind_control_plane(settings: Settings) -> socket.socket:
    """Bound before anything else: a taken port is then exit 6 (cannot start, not restarted by
    the supervisor or systemd) with the reason, before the segment is touched."""
    return bind_listener(settings.cp_host, settings.cp_port)


def bind_listener(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def run(settings: Settings) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the lifespan handles it: never fatal
    if settings.affinity_tokenizer and zmq_missing():
        log.error("PROXY_AFFINITY_TOKENIZER is set: %s", zmq_missing())
        return exits.CANNOT_START
    try:
        control = bind_control_plane(settings)
    except OSError as exc:
        log.error("%s", exits.in_use_message(settings.cp_host, settings.cp_port,
                                             "control plane (PROXY_CP_HOST/PORT)", exc))
        return exits.CONTROL_ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else exits.CANNOT_START
    ui_socket = None
    if settings.ui_address is not None:
        try:
            ui_socket = bind_listener(*settings.ui_address)
        except OSError as exc:
            log.error("%s", exits.in_use_message(*settings.ui_address, "dashboard (PROXY_UI_LISTEN)", exc))
            control.close()
            return exits.CONTROL_ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else exits.CANNOT_START
        log.info("dashboard on %s (PROXY_UI_LISTEN %s)", settings.dashboard_url, settings.ui_listen)
    sysctl_check.note_about_sysctls()
    try:
        seg = open_segment(settings)
    except SegmentError as exc:
        log.error("%s", exc)
        control.close()
        if ui_socket is not None:
            ui_socket.close()
        return exits.CANNOT_START
    try:
        state = build_state(settings, seg)
        app = build_app(state)
        app.router.lifespan_context = _lifespan(state)
        # Without a token, only requests naming this control plane as Host (DNS rebinding).
        tokened = bool(load_token(settings.cp_token, settings.cp_token_file))
        served = app if tokened else HostHeaderCheck(app, settings.cp_host, settings.cp_port)
        if ui_socket is not None and settings.ui_address is not None:
            served = ByListener(served, ui_app(app.state.dashboard_routes, settings, not tokened),
                                settings.ui_address[1])
        server = Http1Server(served, GracefulExit(SHUTDOWN_GRACE_S), settings.keepalive_timeout_s,
                             head_limits(settings))
        logs.keep_control_after_signals()
        serving.serve(server, [control] if ui_socket is None else [control, ui_socket],
                      lambda _server: status_line(state))
        logs.keep_control_after_signals()  # the loop gave its handlers back: no kill before cleanup
        return 0 if server.has_started() else exits.SERVER_FAILED
    finally:
        header.release_sidecar(seg)
        seg.close()
