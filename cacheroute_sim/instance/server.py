"""Runs the data plane and the control plane (two uvicorn servers, uvloop + httptools, one
event loop, shared state) next to the registration loop and, with --resource-interval, the
sampler of the simulated machine's readings (resources.py).

Shutdown order on SIGTERM/SIGINT: stop heartbeats and unregister first (so the Proxy stops
routing here), then let uvicorn drain in-flight requests for ``shutdown_grace_s`` and cancel
the rest (held and hung requests would otherwise block the exit forever), then exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Sequence

import uvicorn
import uvloop

from cacheroute_proxy.instance_wire import ResourceSnapshotV1
from cacheroute_sim.common.uvicorn_seam import SignalFreeServer, has_started, request_exit
from cacheroute_sim.common.serving import uvicorn_config
from cacheroute_sim.instance.app import SimState, create_app
from cacheroute_sim.instance.config import SimConfig
from cacheroute_sim.instance.control_plane import create_cp_app
from cacheroute_sim.instance.generation import SimulatedDrop
from cacheroute_sim.instance.kdn_client import KdnClient
from cacheroute_sim.instance.registration import Registrar
from cacheroute_sim.instance.resources import SimulatedResources

log = logging.getLogger(__name__)


class _QuietExpectedErrors(logging.Filter):
    """uvicorn logs every exception escaping the app with a traceback; two are expected.

    A SimulatedDrop is a fault we injected on purpose: dropped (generation.py logs it).
    A CancelledError is a request cut off by the shutdown grace: one line, no traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, SimulatedDrop):
            return False
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args = "in-flight request cancelled at shutdown", ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def run(config: SimConfig) -> None:
    uvloop.run(serve(config))


async def serve(config: SimConfig) -> None:
    state = SimState(config)
    cp_sock = _bind_control_plane(config)
    kdn = KdnClient(config)
    servers = [SignalFreeServer(uvicorn_config(create_app(config, state), config, config.port))]
    sockets: list[list[socket.socket] | None] = [None]
    if cp_sock is not None:
        cp_port = cp_sock.getsockname()[1]
        servers.append(SignalFreeServer(uvicorn_config(create_cp_app(state, kdn), config, cp_port)))
        sockets.append([cp_sock])
    logging.getLogger("uvicorn.error").addFilter(_QuietExpectedErrors())
    stop = _install_signal_handlers(servers)
    tasks = [asyncio.create_task(srv.serve(sockets=socks), name=f"sim-uvicorn-{i}")
             for i, (srv, socks) in enumerate(zip(servers, sockets, strict=True))]
    resources = SimulatedResources(state.engine, config.max_concurrency) \
        if config.register and config.resource_interval_s > 0 else None
    sampler = asyncio.create_task(resources.run(), name="sim-resource-sampler") \
        if resources is not None else None
    registrar = await _start_registration(
        config, servers, tasks, cp_sock.getsockname()[1] if cp_sock is not None else None,
        state.engine.residency.resident_ids if config.report_resident else None,
        resources.snapshot if resources is not None else None)
    try:
        await asyncio.wait({*tasks, asyncio.create_task(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if registrar is not None:
            await registrar.close()
        if sampler is not None:
            sampler.cancel()
        for srv in servers:
            request_exit(srv)
        await asyncio.gather(*tasks)
        await kdn.close()
        if cp_sock is not None:
            cp_sock.close()


def _bind_control_plane(config: SimConfig) -> socket.socket | None:
    """The control-plane listening socket, bound before anything starts.

    An explicit ``--cp-port`` that cannot be bound is fatal (exit 1). The default (data port
    + 1) is only a convention: if that port is taken the Instance runs without a control
    plane, says so, and registers without ``meta.cp_port``.
    """
    port = config.resolved_cp_port
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, port))
    except OSError as exc:
        sock.close()
        if config.cp_port is not None:
            log.error("cannot bind the control plane on %s:%d: %s", config.host, port, exc)
            raise SystemExit(1) from None
        log.warning("control plane port %d (data port + 1) unavailable (%s); running without "
                    "a control plane (use --cp-port to choose one)", port, exc)
        return None
    log.info("control plane (POST /v1/kv/inject_ready) on http://%s:%d", config.host, port)
    return sock


async def _start_registration(config: SimConfig, servers: Sequence[uvicorn.Server],
                              tasks: list[asyncio.Task[None]], cp_port: int | None,
                              resident_keys: Callable[[], list[str]] | None = None,
                              resources: Callable[[str], ResourceSnapshotV1] | None = None
                              ) -> Registrar | None:
    if not config.register:
        return None
    # Register only once every port listens, or the Proxy may route to a closed port.
    while not all(has_started(s) for s in servers) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    if any(t.done() for t in tasks):
        return None
    registrar = Registrar(config, cp_port, resident_keys, resources)
    registrar.start()
    return registrar


def _install_signal_handlers(servers: Sequence[uvicorn.Server]) -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            for server in servers:  # second signal: stop waiting for in-flight requests
                request_exit(server, force=True)
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop
