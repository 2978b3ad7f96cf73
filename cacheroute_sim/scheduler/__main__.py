"""``python -m cacheroute_sim.scheduler --port P``: command line -> SchedulerConfig -> server.run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cacheroute_sim.common import cli
from cacheroute_sim.scheduler.config import Knobs, SchedulerConfig, config_from_mapping
from cacheroute_sim.scheduler.server import run


def build_parser() -> argparse.ArgumentParser:
    p = cli.new_parser("python -m cacheroute_sim.scheduler", "Simulated Scheduler control plane (proxy registry).",
                       port=7002, id_flag="--scheduler-id", id_help="default sched_{host}:{port}")
    cli.add_simulation_group(p)
    knobs = p.add_argument_group("knobs (also settable at run time: POST /sim/config)")
    knobs.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=5.0,
                       help="heartbeat_interval_s told to proxies in the register reply")
    knobs.add_argument("--ttl", dest="ttl_s", type=float, default=30.0,
                       help="a proxy silent for longer is forgotten")
    knobs.add_argument("--fail-status", type=int, default=None,
                       help="answer this status instead of serving (e.g. 404, 503)")
    knobs.add_argument("--hang", action="store_true", help="never answer until POST /sim/release")
    knobs.add_argument("--fault-on", choices=["all", "register", "heartbeat", "unregister"],
                       default="all", help="which routes fail_status and hang apply to")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> SchedulerConfig:
    return cli.parse_config(build_parser(), argv, Knobs, config_from_mapping)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    cli.configure_logging(config.log_level, config.log_format, f"scheduler {config.resolved_id}")
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
