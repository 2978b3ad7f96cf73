"""What the server accepts of a request head, and how long it waits for one (`HeadLimits`).

The values are settings (cacheroute_proxy/config.py: PROXY_MAX_URL_BYTES, PROXY_MAX_HEAD_BYTES,
PROXY_MAX_HEADERS, PROXY_HEAD_TIMEOUT_S); every role's server is given the same."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class HeadLimits(NamedTuple):
    url_bytes: int  # the request target (path and query): longer is 414
    head_bytes: int  # the request line and header lines together: more is 431
    headers: int  # header lines: more is 431
    timeout_s: float  # from a head's first byte to its last: longer is 408


class HeadSettings(Protocol):
    """The settings HeadLimits are read from (config.Settings)."""

    max_url_bytes: int
    max_head_bytes: int
    max_headers: int
    head_timeout_s: float


def head_limits(settings: HeadSettings) -> HeadLimits:
    return HeadLimits(settings.max_url_bytes, settings.max_head_bytes, settings.max_headers,
                      settings.head_timeout_s)
