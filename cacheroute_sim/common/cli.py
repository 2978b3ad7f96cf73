"""The command line the simulators share: address flags, the "simulation" group, knob flags
folded into one validated Knobs, usage errors for bad values, and the logging setup (the
product's, cacheroute_proxy/logs.py: the same line, or the same JSON object, as the proxy's
processes, from the same PROXY_LOG_LEVEL and PROXY_LOG_FORMAT)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cacheroute_proxy import logs
from cacheroute_proxy.config import ENV_NAMES, LOG_FORMATS
from cacheroute_sim.common.knobs import KnobsBase, knobs_from_mapping
from cacheroute_sim.common.serving import say_uvicorn_lines_once
from cacheroute_sim.common.validation import ConfigError

T = TypeVar("T")

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]

ArgGroup = argparse._ArgumentGroup  # argparse exports no public name for it


def new_parser(prog: str, description: str, *, port: int, id_flag: str,
               id_help: str) -> argparse.ArgumentParser:
    """A parser with the address flags: ``--host``, ``--port`` and the simulator's id flag."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument(id_flag, default=None, help=id_help)
    return p


def add_simulation_group(parser: argparse.ArgumentParser,
                         extra: Callable[[ArgGroup], None] | None = None) -> None:
    """The "simulation" group; ``extra`` adds a simulator's own flags after --time-scale."""
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="multiplies every simulated duration (0.05 = 20x faster)")
    if extra is not None:
        extra(sim)
    sim.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, default=2.0)
    sim.add_argument("--log-level", default=_from_env("log_level", "info").lower(), choices=LOG_LEVELS,
                     help=f"default info, or {ENV_NAMES['log_level']}")
    sim.add_argument("--log-format", default=_from_env("log_format", "text"), choices=LOG_FORMATS,
                     help=f"text (default, or {ENV_NAMES['log_format']}) or json: one JSON object a line")


def _from_env(setting: str, default: str) -> str:
    """The proxy's variable for `setting`, as the proxy's own processes read it (parse_config
    checks it against the flag's choices)."""
    return os.environ.get(ENV_NAMES[setting]) or default


def parse_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                 knobs_type: type[KnobsBase], build: Callable[[dict[str, Any]], T],
                 errors: tuple[type[Exception], ...] = ()) -> T:
    """``build`` the config from the parsed flags.

    Every field of ``knobs_type`` has a flag of the same name (a knob without one fails at
    start); those flags are validated into one Knobs handed to ``build`` under ``"knobs"``.
    A ConfigError, or one of ``errors`` raised by ``build``, is a usage error like a bad flag:
    the message and exit status 2.
    """
    args = vars(parser.parse_args(argv))
    for setting, choices in (("log_level", LOG_LEVELS), ("log_format", LOG_FORMATS)):
        if args[setting] not in choices:  # argparse checks a flag's value, not its default's
            parser.error(f"{ENV_NAMES[setting]}: {args[setting]!r} is not one of {', '.join(choices)}")
    usage_errors: tuple[type[Exception], ...] = (ConfigError, *errors)
    try:
        knobs = knobs_from_mapping(knobs_type,
                                   {name: args.pop(name) for name in knobs_type.__struct_fields__})
        return build({**args, "knobs": knobs})
    except usage_errors as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def configure_logging(level: str, fmt: str, role: str) -> None:
    """The product's logging setup; `role` (e.g. ``sim <id>``) tells which process of a demo spoke."""
    logs.configure(role, level, fmt)
    say_uvicorn_lines_once()
