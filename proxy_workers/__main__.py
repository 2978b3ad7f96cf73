"""`python -m proxy_workers --index I [--strategy S]`: run one worker (the launcher runs N)."""

from __future__ import annotations

import argparse
import sys

from cacheroute_proxy import logs
from cacheroute_proxy.config import ConfigError, Settings

from .server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy_workers", description=__doc__)
    parser.add_argument("--index", type=int, default=0, help="worker index (private port = base + index)")
    parser.add_argument("--strategy", dest="instance_strategy", default=None,
                        help="round_robin (rr) or least_load (ll); default PROXY_INSTANCE_STRATEGY")
    parser.add_argument("--port", dest="dp_port", type=int, default=None)
    args = parser.parse_args(argv)
    index = args.index
    try:
        settings = Settings.from_env().with_overrides(instance_strategy=args.instance_strategy,
                                                      dp_port=args.dp_port)
    except (ConfigError, ValueError) as exc:
        print(f"worker: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure(f"worker{index}", settings.log_level, settings.log_format)
    return run(settings, index)


if __name__ == "__main__":
    sys.exit(main())
