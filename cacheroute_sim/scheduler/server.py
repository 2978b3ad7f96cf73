"""Runs the app under uvicorn (uvloop + httptools); SIGTERM/SIGINT drain for
``shutdown_grace_s``, then cancel what is left (hung requests) and exit 0."""

from __future__ import annotations

import logging

import uvloop

from cacheroute_sim.common.uvicorn_seam import SignalFreeServer
from cacheroute_sim.common.serving import serve_until_signalled, uvicorn_config
from cacheroute_sim.scheduler.app import create_app
from cacheroute_sim.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)


def run(config: SchedulerConfig) -> None:
    uvloop.run(serve(config))


async def serve(config: SchedulerConfig) -> None:
    await serve_until_signalled(SignalFreeServer(uvicorn_config(create_app(config), config, config.port)), log)
