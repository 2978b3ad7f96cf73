"""`cacheroute-proxy config [WORD] [--json | --markdown] [--update-doc PATH]`: every setting with
its environment variable, type, default, bounds and help, as cacheroute_proxy/config.py defines
it (WORD: only the variables that contain it). `--update-doc` rewrites the settings tables of a
copy of docs/configuration.md in place (`make config-doc`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from .. import settings_table


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    command = sub.add_parser("config", help="list every setting: variable, type, default, bounds, help")
    command.add_argument("word", nargs="?", default="", help="only the variables containing WORD")
    shown = command.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="one object a setting")
    shown.add_argument("--markdown", action="store_true", help="the tables of docs/configuration.md")
    shown.add_argument("--update-doc", metavar="PATH", type=Path,
                       help="rewrite the settings tables of PATH (docs/configuration.md) in place")


def run(args: argparse.Namespace) -> int:
    if args.update_doc is not None:
        return _update_doc(args.update_doc)
    listed = settings_table.rows(args.word)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(listed).decode()) + "\n")
    elif args.markdown:
        shown = {row.topic for row in listed}
        sys.stdout.write("\n".join(f"{topic.title}\n\n{settings_table.markdown_table(topic.key, args.word)}"
                                   for topic in settings_table.topics() if topic.key in shown))
    else:
        sys.stdout.write(settings_table.text_listing(listed))
        if not args.word:
            sys.stdout.write("\n" + settings_table.retired_listing())
    return 0


def _update_doc(path: Path) -> int:
    try:
        before = path.read_text()
        after = settings_table.rewrite_doc(before)
    except (OSError, ValueError) as exc:
        print(f"cacheroute-proxy config: {path}: {exc}", file=sys.stderr)
        return 1
    if after != before:
        path.write_text(after)
    print(f"{path}: settings tables {'rewritten' if after != before else 'already current'}")
    return 0
