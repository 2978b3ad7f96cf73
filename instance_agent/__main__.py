"""`python -m instance_agent` (`cacheroute-proxy instance-agent`): run the agent beside one
engine until SIGTERM/SIGINT; exit 2 on a bad option, naming it."""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from cacheroute_proxy import logs
from cacheroute_proxy.config import ConfigError

from .agent import Agent
from .config import parse


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse(argv)
    except ConfigError as exc:
        print(f"instance-agent: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("agent", config.log_level, config.log_format)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_run(Agent(config)))
    return 0


async def _run(agent: Agent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await agent.run(stop)


if __name__ == "__main__":
    sys.exit(main())
