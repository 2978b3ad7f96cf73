"""`cacheroute-proxy shm {show,unlink} [--name N] [--force]`: inspect or remove the segment by hand.

`unlink` refuses a segment that a running proxy uses (shm_schema/users.py): the processes keep
serving from their mapping, but the next sidecar or worker to start would create a new, empty
table beside them, losing every instance and count. `--force` is for the operator who means it.
"""

from __future__ import annotations

import argparse
import json
import sys

from shm_schema import Segment, SegmentError, header
from shm_schema.users import SegmentUser, live_users

from ..config import Settings

REFUSED = 1


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    command = sub.add_parser("shm", help="show or remove the shared-memory segment")
    command.add_argument("action", choices=["show", "unlink"])
    command.add_argument("--name", default=None, help="segment name (default: PROXY_SHM_NAME)")
    command.add_argument("--force", action="store_true",
                         help="unlink: remove it even while a sidecar or worker uses it")


def run(args: argparse.Namespace) -> int:
    name = args.name or Settings.from_env().shm_name
    if args.action == "unlink":
        return unlink(name, args.force)
    try:
        seg = Segment.attach(name)
    except SegmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(header.describe(seg), indent=2))
    finally:
        seg.close()
    return 0


def unlink(name: str, force: bool) -> int:
    try:
        users = live_users(name)
    except SegmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return REFUSED
    if users is None:
        print(f"no segment named {name}")
        return 0
    if users and not force:
        print(f"refused: {name} is in use by {_named(users)}. Removing it would leave them serving "
              "from a table that no process started later can find: the next sidecar or worker "
              "would create an empty one. Stop the proxy first (it removes the segment itself), "
              "or pass --force (make clean-shm FORCE=1).", file=sys.stderr)
        return REFUSED
    if users:
        print(f"warning: {name} was in use by {_named(users)}; they serve on from their mapping, "
              "and the next process to start creates a new, empty table", file=sys.stderr)
    removed = Segment.unlink(name)
    print(f"{'removed' if removed else 'no segment named'} {name}")
    return 0


def _named(users: list[SegmentUser]) -> str:
    """'the sidecar (pid 10) and 2 workers (pids 11, 12)'"""
    parts = [f"the sidecar (pid {user.pid})" for user in users if user.role == "sidecar"]
    workers = sorted(user.pid for user in users if user.role == "worker")
    if workers:
        noun = "worker (pid" if len(workers) == 1 else f"{len(workers)} workers (pids"
        parts.append(f"{noun} {', '.join(map(str, workers))})")
    return " and ".join(parts)
