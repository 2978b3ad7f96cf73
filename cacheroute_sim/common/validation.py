"""Typed config from untyped input (CLI flags, JSON bodies), failing with the field named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A configuration value or knob update is invalid; the message names the field."""


def require(ok: bool, message: str) -> None:
    """A check for a Struct's ``__post_init__``: inside msgspec.convert the ValueError becomes
    a ValidationError, so a bad value fails at once instead of later on a request."""
    if not ok:
        raise ValueError(message)


def struct_from_mapping(cls: type[S], raw: Mapping[str, Any], *, strict: bool = False) -> S:
    try:
        return msgspec.convert(dict(raw), cls, strict=strict)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
