"""Runs the app under uvicorn (uvloop + httptools).

SIGTERM/SIGINT: uvicorn drains in-flight requests for ``shutdown_grace_s``, cancels the rest
(hung requests would otherwise block the exit forever), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
import uvloop

from sim_kdn.app import create_app
from sim_kdn.config import KdnConfig
from sim_kdn.store import KnowledgeStore

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Our handlers own SIGTERM/SIGINT; uvicorn's would re-raise the signal after serve()
        # returns and the process would end by signal instead of exit status 0.
        yield


def run(config: KdnConfig, store: KnowledgeStore) -> None:
    uvloop.run(serve(config, store))


async def serve(config: KdnConfig, store: KnowledgeStore) -> None:
    server = _Server(uvicorn.Config(
        create_app(config, store), host=config.host, port=config.port, http="httptools",
        lifespan="off", access_log=False, log_level=config.log_level,
        timeout_graceful_shutdown=config.shutdown_grace_s))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if server.should_exit:
            server.force_exit = True  # second signal: stop waiting for in-flight requests
        log.info("received %s, shutting down", signal.Signals(signum).name)
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.serve()
