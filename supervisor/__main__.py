"""`cacheroute-proxy run` (or `python -m supervisor run`): the whole proxy on one host;
`cacheroute-proxy status` / `loads [--watch S]`: what it is doing.

Starts the sidecar, then the simulated instances (PROXY_SIM_INSTANCES, 0 for a real
deployment) and N workers on the shared service port; Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import sys

from cacheroute import logs
from cacheroute.config import ConfigError, Settings

from cacheroute.auth import load_token

from . import status_view
from .arbiter import Arbiter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cacheroute-proxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sidecar, N workers and the simulated instances")
    run.add_argument("--workers", "-n", type=int, default=None, help="number of workers (PROXY_WORKERS)")
    run.add_argument("--strategy", dest="instance_strategy", default=None,
                     help="round_robin|rr|least_load|ll (PROXY_INSTANCE_STRATEGY)")
    run.add_argument("--sim-instances", type=int, default=None,
                     help="simulated instances to start (PROXY_SIM_INSTANCES; 0 = none)")
    run.add_argument("--port", dest="dp_port", type=int, default=None, help="service port (PROXY_DP_PORT)")
    run.add_argument("--load-view", default=None, help="shared|per_worker (PROXY_LOAD_VIEW)")
    for name, helptext in (("status", "sidecar, segment, event channel, reaper and workers"),
                           ("loads", "per-instance loads and least_load scores as a table")):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--url", default=None, help="control plane (default: PROXY_CP_HOST/PORT)")
        command.add_argument("--watch", type=float, default=None, metavar="S", help="refresh every S seconds")
    args = parser.parse_args(argv)
    if args.command in ("status", "loads"):
        return _inspect(args)
    try:
        settings = Settings.from_env().with_overrides(
            workers=args.workers, instance_strategy=args.instance_strategy,
            sim_instances=args.sim_instances, dp_port=args.dp_port, load_view=args.load_view)
    except (ConfigError, ValueError) as exc:
        print(f"cacheroute-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("supervisor", settings.log_level)
    return Arbiter(settings).run()


def _inspect(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env()
    except (ConfigError, ValueError) as exc:
        print(f"cacheroute-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    base = (args.url or settings.cp_url).rstrip("/")
    token = load_token(settings.cp_token, settings.cp_token_file)
    path, formatter = (("/debug/status", status_view.format_status) if args.command == "status"
                       else ("/debug/instance_loads", status_view.format_loads))

    def render() -> str:
        return formatter(status_view.fetch(base + path, token))
    try:
        return status_view.show(render, sys.stdout, args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
