"""`cacheroute-proxy shm {show,unlink} [--name N]`: inspect or remove the segment by hand."""

from __future__ import annotations

import argparse
import json
import sys

from shm_schema import Segment, SegmentError, header

from ..config import Settings


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    command = sub.add_parser("shm", help="show or remove the shared-memory segment")
    command.add_argument("action", choices=["show", "unlink"])
    command.add_argument("--name", default=None, help="segment name (default: PROXY_SHM_NAME)")


def run(args: argparse.Namespace) -> int:
    name = args.name or Settings.from_env().shm_name
    if args.action == "unlink":
        removed = Segment.unlink(name)
        print(f"{'removed' if removed else 'no segment named'} {name}")
        return 0
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
