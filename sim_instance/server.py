"""Runs the app under uvicorn (uvloop + httptools) next to the registration loop.

Shutdown order on SIGTERM/SIGINT: stop heartbeats and unregister first (so the Proxy stops
routing here), then let uvicorn drain in-flight requests for ``shutdown_grace_s`` and cancel
the rest (held and hung requests would otherwise block the exit forever), then exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
import uvloop

from sim_instance.app import create_app
from sim_instance.config import SimConfig
from sim_instance.generation import SimulatedDrop
from sim_instance.registration import Registrar

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # One owner for SIGTERM/SIGINT (_install_signal_handlers). uvicorn's own handler
        # would start draining at the same moment we unregister, and re-raise the signal
        # once serve() returns; ours unregisters first, then asks uvicorn to drain.
        yield


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
    server = _Server(uvicorn.Config(
        create_app(config), host=config.host, port=config.port, http="httptools",
        lifespan="off", access_log=False, log_level=config.log_level,
        # Annotated int in uvicorn but only handed to asyncio.wait_for: fractions work.
        timeout_graceful_shutdown=config.shutdown_grace_s))  # type: ignore[arg-type]
    logging.getLogger("uvicorn.error").addFilter(_QuietExpectedErrors())
    stop = _install_signal_handlers(server)
    server_task = asyncio.create_task(server.serve(), name="sim-uvicorn")
    registrar = await _start_registration(config, server, server_task)
    try:
        await asyncio.wait({server_task, asyncio.create_task(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if registrar is not None:
            await registrar.close()
        server.should_exit = True
        await server_task


async def _start_registration(config: SimConfig, server: uvicorn.Server,
                              server_task: asyncio.Task[None]) -> Registrar | None:
    if not config.register:
        return None
    # Register only once the port listens, or the Proxy may route to a closed port.
    while not server.started and not server_task.done():
        await asyncio.sleep(0.01)
    if server_task.done():
        return None
    registrar = Registrar(config)
    registrar.start()
    return registrar


def _install_signal_handlers(server: uvicorn.Server) -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            server.force_exit = True  # second signal: stop waiting for in-flight requests
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop
