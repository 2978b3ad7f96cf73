"""`cacheroute-proxy run` (or `python -m cacheroute_proxy run`): the whole proxy on one host;
`cacheroute-proxy sidecar` / `worker --index N`: one role alone (one systemd unit each);
`cacheroute-proxy status` / `loads [--watch S]`: what it is doing;
`cacheroute-proxy shm show|unlink`: the shared-memory segment by hand.

`run` starts the sidecar, then N workers on the shared service port; Ctrl-C stops everything.
Instances register themselves (the demo's simulated ones: `make run-workers`).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import logs, probe
from ..auth import load_token
from ..config import ConfigError, Settings
from . import shm, status_view

# `cacheroute-proxy <role> ...` becomes the role's own program (exec: same pid, as systemd's
# Type=notify expects), so its options are parsed in one place and this package never imports
# the roles that build on it (`python -m sidecar`, `python -m proxy_workers`).
ROLES: dict[str, tuple[str, str]] = {
    "sidecar": ("sidecar", "run the sidecar alone (control plane, segment owner): "
                                    "sidecar [--cp-host H] [--cp-port P] [--ttl S]"),
    "worker": ("proxy_workers", "run one worker: worker --index N [--strategy S] [--port P]"),
    "instance-agent": ("instance_agent", "run beside one engine and register it with the proxy: "
                                         "instance-agent --instance-url http://HOST:PORT [...]"),
}
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# systemd variables meant for the process systemd started, not for the children of `run`.
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROLES:
        return _run_role(argv[0], argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("status", "loads"):
        return _inspect(args)
    if args.command == "shm":
        return shm.run(args)
    try:
        settings = Settings.from_env().with_overrides(
            workers=args.workers, instance_strategy=args.instance_strategy,
            dp_port=args.dp_port, load_view=args.load_view)
    except (ConfigError, ValueError) as exc:
        print(f"cacheroute-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("supervisor", settings.log_level)
    for name in SYSTEMD_ENV:  # else every child would report READY/WATCHDOG as if it were us
        os.environ.pop(name, None)
    from ..supervisor.arbiter import Arbiter  # imports prometheus_client: only now (see _share_metrics_dir)
    return Arbiter(settings).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheroute-proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sidecar and N workers")
    run.add_argument("--workers", "-n", type=int, default=None, help="number of workers (PROXY_WORKERS)")
    run.add_argument("--strategy", dest="instance_strategy", default=None,
                     help="round_robin|rr|least_load|ll|kv_aware|kv (PROXY_INSTANCE_STRATEGY)")
    run.add_argument("--port", dest="dp_port", type=int, default=None, help="service port (PROXY_DP_PORT)")
    run.add_argument("--load-view", default=None, help="shared|per_worker (PROXY_LOAD_VIEW)")
    for name, (_, helptext) in ROLES.items():  # listed for --help; main() dispatches them first
        sub.add_parser(name, help=helptext, add_help=False)
    for name, helptext in (("status", "sidecar, segment, event channel, reaper and workers"),
                           ("loads", "per-instance loads and least_load scores as a table")):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--url", default=None, help="control plane (default: PROXY_CP_HOST/PORT)")
        command.add_argument("--watch", type=float, default=None, metavar="S", help="refresh every S seconds")
    shm.add_parser(sub)
    return parser


def _run_role(role: str, argv: list[str]) -> int:
    if role == "worker":
        problem = _share_metrics_dir()
        if problem:
            print(f"cacheroute-proxy worker: {problem}", file=sys.stderr)
            return 2
    # -P: the working directory is not put on sys.path (a folder named like a role there
    # must not stand in for the installed one).
    os.execv(sys.executable, [sys.executable, "-P", "-m", ROLES[role][0], *argv])


def _share_metrics_dir() -> str | None:
    """prometheus_client picks its multiprocess mode once, when first imported: point it at the
    directory every worker shares (PROXY_METRICS_DIR), as the arbiter does for its children,
    before the worker imports it. Created if missing, never emptied here: the others write into
    it too (whoever owns the deployment empties it: the arbiter at start, systemd's
    RuntimeDirectory= of cacheroute-proxy-runtime.service). A problem is returned as text."""
    if os.environ.get(MULTIPROC_ENV):
        return None
    try:
        path = Settings.from_env().resolved_metrics_dir
    except (ConfigError, ValueError):
        return None  # the worker reports the configuration error itself, naming the variable
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot create the metrics directory {path} (PROXY_METRICS_DIR): {exc.strerror}"
    os.environ[MULTIPROC_ENV] = path
    return None


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
        return formatter(probe.fetch(base + path, token))
    try:
        return status_view.show(render, sys.stdout, args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
