"""Rules on one setting's value that bounds and choices cannot say (an http(s) URL, HOST:PORT,
a readable token file, KV event publishers, static KDN links, a loopback host): each a function
that says what is wrong, used by the definitions in cacheroute_proxy/config.py."""

from __future__ import annotations

import ipaddress
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .setting import Rule


def is_http_url(value: str) -> bool:
    """An http(s) URL with a host and, if any, a numeric port."""
    url = urlsplit(value)
    try:
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname)


def host_port(value: str) -> tuple[str, int] | None:
    """"host:port" or "[v6]:port" -> (host, port); None if it is not one."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def read_token_file(path: str) -> str:
    """The token a file holds; ValueError saying why there is none."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def kv_event_endpoints(text: str) -> dict[str, str]:
    """"instance_id=tcp://host:port,..." as {instance id: ZMQ endpoint}; ValueError if not one."""
    endpoints: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        instance_id, _, endpoint = (part.strip() for part in entry.partition("="))
        if not instance_id or not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{entry!r} is not instance_id=tcp://host:port (or ipc://path)")
        if "://*" in endpoint:
            raise ValueError(f"{entry!r}: name the engine's host (as 127.0.0.1), not the * it binds")
        if instance_id in endpoints:
            raise ValueError(f"instance {instance_id!r} is given twice")
        endpoints[instance_id] = endpoint
    return endpoints


def check_kdn_links(links: dict[str, dict[str, Any]]) -> None:
    """The numbers IWS reads from a static link: a bandwidth > 0 and an RTT >= 0, when given."""
    for key, metrics in links.items():
        for name, low in (("bandwidth_mbps", 0.0), ("latency_ms", None), ("rtt_ms", None)):
            value = metrics.get(name)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (value > low if low is not None else value >= 0)):
                raise ValueError(f"{key}: {name} must be a number {'> 0' if low is not None else '>= 0'}, "
                                 f"got {value!r}")


def http_url(example: str, empty: bool = False) -> Rule:
    """An http(s) URL (or, with `empty`, "" for none)."""
    return Rule.holds(f"an http(s) URL such as {example}", lambda v: (empty and not v) or is_http_url(v))


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name localhost."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
