"""The inspecting commands, once: `status`, `instances`, `scheduler`, `loads`, `watch`.

Each is its options (argparse) and a function from the control plane and the parsed options to
an Output (the text to print and the JSON it came from). The one-shot subcommands
(`cacheroute-proxy instances --all`) and the console (`:instances --all`) both parse with
`add_options` and print through `execute`, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from . import pool_view, status_view
from .control_client import ControlPlane, ControlPlaneError

WATCH_INTERVAL_S = 2.0
WATCH_LIMIT = 20  # instances a watch lists by default: a screenful with the status above


@dataclass(frozen=True)
class Output:
    text: str
    data: Any  # what --json prints


@dataclass(frozen=True)
class Command:
    name: str
    usage: str      # the options as the console's :help lists them
    summary: str
    add_options: Callable[[argparse.ArgumentParser], None]
    run: Callable[[ControlPlane, argparse.Namespace], Output]
    interval: Callable[[argparse.Namespace], float | None] = lambda args: None  # refresh period, if watching


# --- option types --------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def interval_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:  # faster would hammer the control plane; slower is no watch
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 seconds, got {text}")
    return value


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the control plane's JSON instead of text")


def _watch_and_json_options(parser: argparse.ArgumentParser) -> None:
    """status's and loads' options: the one-shot refreshes with --watch, scripts take --json."""
    parser.add_argument("--watch", type=interval_s, default=None, metavar="S", help="refresh every S seconds")
    _json_option(parser)


# --- status ----------------------------------------------------------------------------------------


def _status(plane: ControlPlane, args: argparse.Namespace) -> Output:
    status = plane.get("/debug/status")
    return Output(status_view.format_status(status), status)


# --- instances ---------------------------------------------------------------------------------------
def _instances_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("count", nargs="?", type=positive_int, default=None, metavar="N",
                        help="list at most N (same as --limit N)")
    parser.add_argument("--all", action="store_true", help="also those out of the candidate set "
                        "(unhealthy, expired and not yet purged)")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N", help="list at most N")
    _json_option(parser)


def _pool(plane: ControlPlane) -> tuple[list[dict[str, Any]], float]:
    """Every registered instance (the list with include_dead) and the TTL."""
    rows = plane.get("/v1/instance/list?include_dead=true")
    return rows, float(plane.get("/healthz").get("ttl_s", 0.0))


def _instances(plane: ControlPlane, args: argparse.Namespace) -> Output:
    rows, ttl_s = _pool(plane)
    limit = args.limit or args.count
    text = pool_view.format_instances(rows, ttl_s=ttl_s, show_all=args.all, limit=limit)
    listed = [r for r in rows if args.all or r.get("is_alive")][:limit]
    return Output(text, {"ttl_s": ttl_s, "alive": sum(1 for r in rows if r.get("is_alive")),
                         "registered": len(rows), "instances": listed})


# --- scheduler -----------------------------------------------------------------------------------------
def _scheduler(plane: ControlPlane, args: argparse.Namespace) -> Output:
    link = plane.get("/debug/status").get("scheduler") or {"enabled": False}
    return Output(pool_view.format_scheduler(link), link)


# --- loads ---------------------------------------------------------------------------------------------
def _loads(plane: ControlPlane, args: argparse.Namespace) -> Output:
    loads = plane.get("/debug/instance_loads")
    return Output(status_view.format_loads(loads), loads)


# --- watch ---------------------------------------------------------------------------------------------
def _watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="list every registered instance, not only the alive")
    parser.add_argument("--interval", type=interval_s, default=WATCH_INTERVAL_S, metavar="S",
                        help=f"seconds between refreshes (default {WATCH_INTERVAL_S:g})")
    parser.add_argument("--limit", type=positive_int, default=WATCH_LIMIT, metavar="N",
                        help=f"list at most N instances (default {WATCH_LIMIT})")


def _watch(plane: ControlPlane, args: argparse.Namespace) -> Output:
    status = plane.get("/debug/status")
    rows, ttl_s = _pool(plane)
    pool = pool_view.format_instances(rows, ttl_s=ttl_s, show_all=args.all, limit=args.limit)
    return Output(status_view.format_status(status) + "\n\n" + pool, {"status": status, "instances": rows})


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("status", "[--watch S]", "sidecar, segment, event channel, reaper, Scheduler registration, "
            "workers", _watch_and_json_options, _status, interval=lambda args: args.watch),
    Command("instances", "[N] [--all] [--limit N]", "the instance pool: alive only, or --all "
            "(unhealthy and expired too)", _instances_options, _instances),
    Command("scheduler", "", "the registration with the Scheduler (SCHEDULER_CP_URL)", _json_option, _scheduler),
    Command("loads", "[--watch S]", "per-instance loads and least_load scores", _watch_and_json_options, _loads,
            interval=lambda args: args.watch),
    Command("watch", "[--all] [--interval S] [--limit N]", "status and instances, refreshed until Ctrl-C",
            _watch_options, _watch, interval=lambda args: args.interval),
)}


def execute(command: Command, plane: ControlPlane, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run once and print (0; 1 if the control plane failed), or refresh until Ctrl-C, which
    raises KeyboardInterrupt to the caller: the one-shot exits, the console prompts again."""
    interval = command.interval(args)
    if interval is not None:
        return status_view.show(_refreshing(command, plane, args, interval), out, interval)
    try:
        output = command.run(plane, args)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=err, flush=True)
        return 1
    text = json.dumps(output.data, indent=2) if getattr(args, "json", False) else output.text
    print(text, file=out, flush=True)
    return 0


def _refreshing(command: Command, plane: ControlPlane, args: argparse.Namespace,
                interval: float) -> Callable[[], str]:
    """The watched text under a header that counts refreshes; a failed refresh is shown, and
    the next one tries again (a restarting proxy is what one watches)."""
    rounds = 0

    def render() -> str:
        nonlocal rounds
        rounds += 1
        header = (f"{command.name} every {interval:g}s, refresh {rounds}, {time.strftime('%H:%M:%S')} "
                  f"({plane.base_url}; Ctrl-C to stop)")
        try:
            body = command.run(plane, args).text
        except ControlPlaneError as exc:
            body = f"error: {exc}"
        return header + "\n\n" + body
    return render
