"""python -m bench.stack_choice: the orchestrator, or (with --role) one of its children."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import bench.stack_choice as package

from .child import child_main
from .orchestrate import orchestrate


def main(argv=None):
    p = argparse.ArgumentParser(description=(package.__doc__ or "").split("\n")[0])
    p.add_argument("--out", default="bench/results/stack_choice.json")
    p.add_argument("--duration", type=int, default=5, help="seconds per c32 measurement")
    p.add_argument("--c1-duration", type=int, default=3, help="seconds per c1 measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pool", type=int, default=64, help="upstream pool size (>= concurrency)")
    p.add_argument("--budget-s", type=float, default=540.0, help="hard cap on measuring time")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--skip-servers", action="store_true")
    p.add_argument("--skip-clients", action="store_true")
    # child-only
    p.add_argument("--role", choices=["orchestrate", "server", "backend"], default="orchestrate",
                   help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--app", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    p.add_argument("--fds", help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role != "orchestrate":
        return child_main(a)
    results = orchestrate(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for key in ("asgi_servers_table_md", "upstream_clients_table_md"):
        if key in results:
            print("\n" + results[key])
    if results["unavailable"]:
        print("\nunavailable:", json.dumps(results["unavailable"], indent=1))
    print(f"\nwrote {out} ({results['meta']['wall_s']} s)")


if __name__ == "__main__":
    main()
