"""uvicorn as the simulators run it: uvloop + httptools, no lifespan, no access log, and
signals handled by the simulator itself (uvicorn_seam.SignalFreeServer: uvicorn's own handler
would re-raise SIGTERM after serve() and start draining before a simulated instance has
unregistered)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp

from cacheroute_sim.common.uvicorn_seam import SignalFreeServer, exit_requested, request_exit


class ServeConfig(Protocol):
    """The start-time config fields serving needs (SimConfig and KdnConfig have them)."""

    @property
    def host(self) -> str: ...

    @property
    def log_level(self) -> str: ...

    @property
    def shutdown_grace_s(self) -> float: ...


def uvicorn_config(app: ASGIApp, config: ServeConfig, port: int) -> uvicorn.Config:
    """``shutdown_grace_s`` bounds the drain; requests still in flight then are cancelled
    (held and hung ones would otherwise block the exit forever)."""
    return uvicorn.Config(
        app, host=config.host, port=port, http="httptools", lifespan="off", access_log=False,
        log_level=config.log_level,
        # Annotated int in uvicorn but only handed to asyncio.wait_for: fractions work.
        timeout_graceful_shutdown=config.shutdown_grace_s)  # type: ignore[arg-type]


async def serve_until_signalled(server: SignalFreeServer, log: logging.Logger) -> None:
    """Serve; the first SIGTERM/SIGINT drains (bounded by the config's grace), a second one
    stops waiting for what is in flight."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        request_exit(server, force=exit_requested(server))  # a second signal stops waiting

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.serve()
