"""uvicorn as the simulators run it: uvloop + httptools, no lifespan, no access log, and
signals handled by the simulator itself (uvicorn_seam.SignalFreeServer: uvicorn's own handler
would re-raise SIGTERM after serve() and start draining before a simulated instance has
unregistered).

uvicorn's lines go through the simulator's logging setup (the product's format, text or JSON,
cli.configure_logging), not through a handler and format of uvicorn's own, and each of its info
lines is said once a process (say_uvicorn_lines_once)."""

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
        # None: uvicorn installs no handler of its own; its loggers propagate to the root's.
        log_config=None, log_level=config.log_level,
        # Annotated int in uvicorn but only handed to asyncio.wait_for: fractions work.
        timeout_graceful_shutdown=config.shutdown_grace_s)  # type: ignore[arg-type]


class _InfoLinesOnce(logging.Filter):
    """A simulated instance runs two uvicorn servers in one process (its data plane and its KV
    control plane), and each says the same lines of its life: `Started server process [<pid>]`,
    `Shutting down`, `Finished server process [<pid>]`. The first of each says it. Warnings and
    errors are said every time they happen."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        line = record.getMessage()
        if line in self._said:
            return False
        self._said.add(line)
        return True


_UVICORN_INFO_ONCE = _InfoLinesOnce()


def say_uvicorn_lines_once() -> None:
    logging.getLogger("uvicorn.error").addFilter(_UVICORN_INFO_ONCE)  # added once: the same filter


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
