"""`cacheroute-proxy run` (or `python -m cacheroute_proxy run`): the whole proxy on one host;
`cacheroute-proxy sidecar` / `worker --index N`: one role alone (one systemd unit each);
`cacheroute-proxy status` / `instances [--all] [--limit N]` / `scheduler` / `loads [--watch S]` /
`watch`: what it is doing (`--json` for scripts; exit 0 ok, 1 control plane unreachable or
HTTP error, 2 usage error); `cacheroute-proxy console`: the same commands at a prompt;
`cacheroute-proxy shm show|unlink`: the shared-memory segment by hand; `cacheroute-proxy config`:
every setting, its environment variable, type, default, bounds and help.

`run` starts the sidecar, then N workers on the shared service port; Ctrl-C stops everything.
Instances register themselves (the demo's simulated ones: `make run-workers`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import logs
from ..config import ConfigError
from ..supervisor import preflight
from . import run_flags, settings_list, shm
from .commands import COMMANDS, execute
from .console import run_console
from .control_client import ControlPlane

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
# systemd variables meant for the process systemd started, not for the children of `run`.
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROLES:
        return _run_role(argv[0], argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in COMMANDS or args.command == "console":
        return _inspect(args)
    if args.command == "shm":
        return shm.run(args)
    if args.command == "config":
        return settings_list.run(args)
    try:
        settings = run_flags.settings_from(args)
    except (ConfigError, ValueError) as exc:
        print(f"cacheroute-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("supervisor", settings.log_level, settings.log_format)
    taken = preflight.taken_address(settings)
    if taken:
        logging.getLogger("cacheroute.supervisor").error("%s; stopping (nothing was started)", taken)
        return 1
    for name in SYSTEMD_ENV:  # else every child would report READY/WATCHDOG as if it were us
        os.environ.pop(name, None)
    from ..supervisor.arbiter import Arbiter
    return Arbiter(settings).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheroute-proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sidecar and N workers")
    run_flags.add_run_flags(run)
    for name, (_, helptext) in ROLES.items():  # listed for --help; main() dispatches them first
        sub.add_parser(name, help=helptext, add_help=False)
    for name, command in COMMANDS.items():  # the console parses the same options (cli/commands.py)
        command.add_options(_url_option(sub.add_parser(name, help=command.summary)))
    _url_option(sub.add_parser("console", help="interactive prompt: :status, :instances, :watch, "
                                               ":scheduler, :loads, :help, :exit"))
    shm.add_parser(sub)
    settings_list.add_parser(sub)
    return parser


def _run_role(role: str, argv: list[str]) -> int:
    # -P: the working directory is not put on sys.path (a folder named like a role there
    # must not stand in for the installed one).
    os.execv(sys.executable, [sys.executable, "-P", "-m", ROLES[role][0], *argv])


def _url_option(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default=None, help="control plane (default: PROXY_CP_HOST/PORT)")
    return parser


def _inspect(args: argparse.Namespace) -> int:
    try:
        plane = ControlPlane.configured(args.url)
    except (ConfigError, ValueError) as exc:
        print(f"cacheroute-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "console":
        return run_console(plane, sys.stdout, sys.stderr)
    try:
        return execute(COMMANDS[args.command], plane, args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:  # the end of a watch
        return 0


if __name__ == "__main__":
    sys.exit(main())
