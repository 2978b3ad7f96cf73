"""Runs the app under uvicorn (uvloop + httptools).

SIGTERM/SIGINT: uvicorn drains in-flight requests for ``shutdown_grace_s``, cancels the rest
(hung requests would otherwise block the exit forever), then the process exits 0.
"""

from __future__ import annotations

import logging

import uvloop

from cacheroute_sim.common.uvicorn_seam import SignalFreeServer
from cacheroute_sim.common.serving import serve_until_signalled, uvicorn_config
from cacheroute_sim.kdn.app import create_app
from cacheroute_sim.kdn.config import KdnConfig
from cacheroute_sim.kdn.store import KnowledgeStore

log = logging.getLogger(__name__)


def run(config: KdnConfig, store: KnowledgeStore) -> None:
    uvloop.run(serve(config, store))


async def serve(config: KdnConfig, store: KnowledgeStore) -> None:
    await serve_until_signalled(SignalFreeServer(uvicorn_config(create_app(config, store), config, config.port)), log)
