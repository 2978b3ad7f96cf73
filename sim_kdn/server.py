"""Runs the app under uvicorn (uvloop + httptools).

SIGTERM/SIGINT: uvicorn drains in-flight requests for ``shutdown_grace_s``, cancels the rest
(hung requests would otherwise block the exit forever), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from sim_common.serving import Server, uvicorn_config
from sim_kdn.app import create_app
from sim_kdn.config import KdnConfig
from sim_kdn.store import KnowledgeStore

log = logging.getLogger(__name__)


def run(config: KdnConfig, store: KnowledgeStore) -> None:
    uvloop.run(serve(config, store))


async def serve(config: KdnConfig, store: KnowledgeStore) -> None:
    server = Server(uvicorn_config(create_app(config, store), config, config.port))
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if server.should_exit:
            server.force_exit = True  # second signal: stop waiting for in-flight requests
        log.info("received %s, shutting down", signal.Signals(signum).name)
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.serve()
