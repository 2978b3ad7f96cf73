"""`python -m sidecar [--cp-host H] [--cp-port P] [--ttl S]`: run the sidecar alone."""

from __future__ import annotations

import argparse
import sys

from cacheroute_proxy import logs
from cacheroute_proxy.config import ConfigError, Settings

from .server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar", description=__doc__)
    parser.add_argument("--cp-host", default=None)
    parser.add_argument("--cp-port", type=int, default=None)
    parser.add_argument("--ttl", dest="instance_ttl_s", type=float, default=None)
    parser.add_argument("--strategy", dest="instance_strategy", default=None)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env().with_overrides(**vars(args))
    except (ConfigError, ValueError) as exc:
        print(f"sidecar: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("sidecar", settings.log_level, settings.log_format)
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
