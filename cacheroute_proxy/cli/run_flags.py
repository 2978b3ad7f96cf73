"""The flags of `cacheroute-proxy run`, shared with the demo launcher (cacheroute_sim/demo.py),
which passes them on: each one overrides one setting's environment variable, and nothing is
overridden that was not given (an unset flag leaves the environment, then the default, to
decide). A bad value is refused naming the flag (argparse's exit 2 for what it can tell, a
`ConfigError` naming flag and variable for what only Settings can check)."""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import msgspec

from ..config import ENV_NAMES, FIELD, ConfigError, Settings
from ..setting import is_json


class RunFlag(NamedTuple):
    flag: str
    field: str  # the Settings field it overrides
    help: str = ""  # "": the setting's choices, a|b|c
    choices: bool = False  # argparse refuses what is not one of the setting's choices


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object {kdn_key: {metrics}}")
    return value


RUN_FLAGS: tuple[RunFlag, ...] = (
    RunFlag("--workers", "workers", "number of workers"),
    RunFlag("--strategy", "instance_strategy"),
    RunFlag("--host", "dp_host", "the service address every worker binds (and the Scheduler is told, "
                                 "unless PROXY_ADVERTISE_HOST says otherwise)"),
    RunFlag("--port", "dp_port", "service port"),
    RunFlag("--load-view", "load_view"),
    RunFlag("--injection-strategy", "injection_strategy", choices=True),
    RunFlag("--ready-release-policy", "ready_release_policy", choices=True),
    RunFlag("--kdn-links-json", "kdn_links", "static KDN links, a JSON object {kdn_key: {metrics}}"),
    RunFlag("--proxy-ui-listen", "ui_listen", "the dashboard's own listener, HOST:PORT; \"\" for none"),
    RunFlag("--proxy-ui-url", "ui_url", "the dashboard's URL as a browser opens it, printed when ready"),
)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    for spec in RUN_FLAGS:
        names = [spec.flag, "-n"] if spec.flag == "--workers" else [spec.flag]
        choices = tuple(FIELD[spec.field].env.choices)
        parser.add_argument(*names, dest=spec.field, default=None, metavar=spec.field.split("_")[-1].upper(),
                            help=f"{spec.help or '|'.join(choices)} ({ENV_NAMES[spec.field]})",
                            **_kind(spec, choices))


def _kind(spec: RunFlag, choices: tuple[str, ...]) -> dict[str, Any]:
    """What argparse checks itself: the type (a JSON object for a map), the choices if asked."""
    hint = FIELD[spec.field].type
    kind: dict[str, Any] = {"type": _json_object} if is_json(hint) else {"type": int} if hint is int else {}
    return {**kind, "choices": choices} if spec.choices else kind


def settings_from(args: argparse.Namespace) -> Settings:
    """The environment's settings with the flags that were given applied; an invalid value of a
    flag raises ConfigError naming the flag and its variable."""
    given = {spec.field: getattr(args, spec.field) for spec in RUN_FLAGS
             if getattr(args, spec.field, None) is not None}
    settings = Settings.from_env()
    try:
        return settings.with_overrides(**given)
    except ValueError as exc:  # ConfigError too: it names the variable first ("PROXY_X: ...")
        raise ConfigError(_name_the_flag(str(exc), given)) from None


def run_argv(args: argparse.Namespace) -> list[str]:
    """The given flags again, as `cacheroute-proxy run` takes them (for the demo's child)."""
    argv: list[str] = []
    for spec in RUN_FLAGS:
        value = getattr(args, spec.field, None)
        if value is not None:
            argv += [spec.flag, msgspec.json.encode(value).decode() if isinstance(value, dict) else str(value)]
    return argv


def _name_the_flag(message: str, given: dict[str, Any]) -> str:
    for spec in RUN_FLAGS:
        var = ENV_NAMES[spec.field]
        if spec.field in given and message.startswith(f"{var}:"):
            return f"{spec.flag} ({var}){message[len(var):]}"
    return message
