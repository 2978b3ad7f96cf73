"""The command line both simulators share: address flags, the "simulation" group, knob flags
folded into one validated Knobs, usage errors for bad values, and the log format."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cacheroute_sim.common.knobs import KnobsBase, knobs_from_mapping
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
    sim.add_argument("--log-level", default="info", choices=LOG_LEVELS)


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
    usage_errors: tuple[type[Exception], ...] = (ConfigError, *errors)
    try:
        knobs = knobs_from_mapping(knobs_type,
                                   {name: args.pop(name) for name in knobs_type.__struct_fields__})
        return build({**args, "knobs": knobs})
    except usage_errors as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def configure_logging(level: str, tag: str) -> None:
    """One format for both: ``[tag]`` (e.g. ``sim <id>``) tells which process of a demo spoke."""
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")
