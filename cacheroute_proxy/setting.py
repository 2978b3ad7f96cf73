"""What one setting is, written once beside its field in `Settings` (cacheroute_proxy/config.py)
as `Annotated[type, Env(...)]`: its environment variable, its topic, one line of help, and the
rule its value keeps (bounds, choices, or a `Rule` for what those cannot say).

From that one definition come the reading of a variable (`read`), the check of a value
(`problem`: the variable, the value and the rule, in one sentence), `cacheroute-proxy config`
and the tables of docs/configuration.md (cacheroute_proxy/settings_table.py). Rules that join
two settings are not here: they are small functions in config.py.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import msgspec


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable."""


class Topic(NamedTuple):
    key: str    # names the table of docs/configuration.md (<!-- settings: key -->)
    title: str


@dataclass(frozen=True)
class Rule:
    """A rule on one value that bounds and choices cannot say. `text` finishes "must be ..."
    (and is the listing's bounds); `problem` says what is wrong with a value, None if nothing."""

    text: str
    problem: Callable[[Any], str | None]

    @classmethod
    def holds(cls, text: str, predicate: Callable[[Any], bool]) -> "Rule":
        return cls(text, lambda value: None if predicate(value) else f"must be {text}, got {value!r}")

    @classmethod
    def raises(cls, text: str, parse: Callable[[Any], object]) -> "Rule":
        """The rule that `parse` accepts the value; its ValueError says what is wrong."""
        def problem(value: Any) -> str | None:
            try:
                parse(value)
            except ValueError as exc:
                return str(exc)
            return None
        return cls(text, problem)


@dataclass(frozen=True)
class Env:
    """One setting's definition, less its type and default (the field's own)."""

    var: str                 # the environment variable: the original Proxy's name where it had one
    topic: Topic
    help: str                # one line; Markdown (backticks, links), as docs/configuration.md shows it
    ge: float | None = None  # bounds, as msgspec.Meta spells them
    gt: float | None = None
    le: float | None = None
    finite: bool = False     # no inf or nan
    what: str = ""           # the value's name in an error ("a TCP port", "load view")
    choices: tuple[str, ...] | Mapping[str, str] = ()  # a mapping: alias -> the name it stands for
    rule: Rule | None = None


class Field(NamedTuple):
    name: str       # the attribute of Settings
    type: Any       # its type, Annotated taken off (Optional kept)
    default: Any
    env: Env


def fields_of(struct: type[msgspec.Struct]) -> tuple[Field, ...]:
    """Every field of `struct` with its Env, in the order they are written."""
    hints = typing.get_type_hints(struct, include_extras=True)
    found = []
    for info in msgspec.structs.fields(struct):
        hint = hints[info.name]
        env = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Env)), None)
        if env is None:
            raise TypeError(f"{struct.__name__}.{info.name} has no Env(...): every setting needs one")
        default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
        found.append(Field(info.name, hint.__origin__, default, env))
    return tuple(found)


# --- reading ----------------------------------------------------------------------------------------
def read(field: Field, text: str) -> Any:
    """The value of `field` from its variable's text; ConfigError if it is not of the type."""
    var = field.env.var
    value: Any = text
    if is_json(field.type):
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{var}: not valid JSON, got {text!r} ({exc})") from None
    return convert(field, value, shown=text)


def convert(field: Field, value: Any, shown: Any = None) -> Any:
    """`value` (text, or what a flag parsed) as the field's type; ConfigError if it is not one."""
    try:
        return msgspec.convert(value, field.type, strict=False)
    except msgspec.ValidationError as exc:
        detail = f" ({str(exc).replace(' - at `$`', '')})" if is_json(field.type) else ""
        shown = value if shown is None else shown
        expected = type_name(field.type, in_a_sentence=True)
        raise ConfigError(f"{field.env.var}: expected {expected}, got {shown!r}{detail}") from None


def to_text(value: Any) -> str:
    """What a variable holds to give back `value` (the inverse of `read`)."""
    return msgspec.json.encode(value).decode() if isinstance(value, (dict, list)) else str(value)


# --- checking ---------------------------------------------------------------------------------------
def check(field: Field, value: Any) -> None:
    """ConfigError naming the variable, the value and the rule, if `value` breaks the rule."""
    said = None if value is None else problem(field.env, value)
    if said:
        raise ConfigError(f"{field.env.var}: {said}")


def problem(env: Env, value: Any) -> str | None:
    if env.choices and value not in env.choices:
        return f"unknown {env.what or 'value'} {value!r}; choose one of {', '.join(env.choices)}"
    if _out_of_bounds(env, value):
        what = env.what or ("a finite number" if env.finite else "")
        return f"must be {f'{what} ' if what else ''}{bounds_text(env, words=True)}, got {value!r}"
    return env.rule.problem(value) if env.rule else None


def _out_of_bounds(env: Env, value: Any) -> bool:
    # Written as "inside" so that nan, which compares false with everything, is outside.
    inside = (env.ge is None or value >= env.ge) and (env.gt is None or value > env.gt) \
        and (env.le is None or value <= env.le)
    return not inside or (env.finite and not math.isfinite(value))


# --- how a definition reads -------------------------------------------------------------------------
def bounds_text(env: Env, words: bool = False) -> str:
    """"1..256" (words: "between 1 and 256"), "> 0", ">= 0", "> 0 and <= 3600"; "" if unbounded."""
    if env.ge is not None and env.le is not None:
        return f"between {env.ge} and {env.le}" if words else f"{env.ge}..{env.le}"
    return " and ".join(f"{op} {bound}" for op, bound in ((">=", env.ge), (">", env.gt), ("<=", env.le))
                        if bound is not None)


# type -> (its name in the listing, in an error)
_TYPE_NAMES: dict[Any, tuple[str, str]] = {
    int: ("integer", "an integer"), float: ("number", "a number"),
    bool: ("boolean", "true or false (or 1 or 0)"), str: ("text", "text"), "json": ("JSON", "a JSON object"),
}


def type_name(hint: Any, in_a_sentence: bool = False) -> str:
    """"integer", "number", "boolean", "text", "JSON"; in a sentence: "an integer", ..."""
    names = _TYPE_NAMES["json" if is_json(hint) else optional_of(hint)]
    return names[in_a_sentence]


def is_json(hint: Any) -> bool:
    """Maps (and lists) are given as JSON text."""
    return typing.get_origin(optional_of(hint)) in (dict, list)


def optional_of(hint: Any) -> Any:
    """T for `T | None`, else the hint."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return others[0] if len(others) == 1 else hint
    return hint
