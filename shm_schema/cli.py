"""`python -m shm_schema.cli {show,unlink}`: inspect or remove the segment by hand."""

from __future__ import annotations

import argparse
import json
import sys

from cacheroute.config import Settings

from . import header
from .segment import Segment, SegmentError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shm_schema.cli")
    parser.add_argument("command", choices=["show", "unlink"])
    parser.add_argument("--name", default=None, help="segment name (default: PROXY_SHM_NAME)")
    args = parser.parse_args(argv)
    name = args.name or Settings.from_env().shm_name
    if args.command == "unlink":
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


if __name__ == "__main__":
    sys.exit(main())
