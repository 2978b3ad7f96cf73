"""uvicorn as both simulators run it: uvloop + httptools, no lifespan, no access log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp


class ServeConfig(Protocol):
    """The start-time config fields serving needs (SimConfig and KdnConfig have them)."""

    @property
    def host(self) -> str: ...

    @property
    def log_level(self) -> str: ...

    @property
    def shutdown_grace_s(self) -> float: ...


class Server(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to the simulator.

    uvicorn's own handler would re-raise the signal once serve() returns, so the process
    would end by signal instead of exit status 0; and it would start draining before the
    simulator did what must come first (the instance unregisters from the Proxy, then asks
    uvicorn to drain).
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(app: ASGIApp, config: ServeConfig, port: int) -> uvicorn.Config:
    """``shutdown_grace_s`` bounds the drain; requests still in flight then are cancelled
    (held and hung ones would otherwise block the exit forever)."""
    return uvicorn.Config(
        app, host=config.host, port=port, http="httptools", lifespan="off", access_log=False,
        log_level=config.log_level,
        # Annotated int in uvicorn but only handed to asyncio.wait_for: fractions work.
        timeout_graceful_shutdown=config.shutdown_grace_s)  # type: ignore[arg-type]


async def serve_until_signalled(server: Server, log: logging.Logger) -> None:
    """Serve; the first SIGTERM/SIGINT drains (bounded by the config's grace), a second one
    stops waiting for what is in flight."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if server.should_exit:
            server.force_exit = True
        log.info("received %s, shutting down", signal.Signals(signum).name)
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.serve()
