"""PROXY_STATIC_INSTANCES: engines the sidecar registers and probes itself, for engines that run
without an agent (as vllm-router's --worker-urls or an nginx upstream block).

The value is a comma-separated list of `url` or `url=id`, e.g.
`http://127.0.0.1:8000=vllm-a,http://127.0.0.1:8001`. The URL is the engine's base: plain
http (the proxy never speaks TLS itself), a host and a port, no path. The id defaults to the
original's `hp_<host>:<port>`. A bad value is a ValueError saying what is wrong (config.py
names the variable).
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

from .instance_wire import HOST_RULE, is_host

MAX_ID_BYTES = 112  # what an instance slot holds (shm_schema.layout.MAX_ID_BYTES)


class StaticInstance(NamedTuple):
    url: str          # http://host:port, no trailing slash
    host: str
    port: int
    instance_id: str


def parse_static_instances(text: str) -> tuple[StaticInstance, ...]:
    entries = [entry.strip() for entry in text.split(",")]
    found = tuple(_entry(entry) for entry in entries if entry)
    ids = [target.instance_id for target in found]
    duplicates = sorted({iid for iid in ids if ids.count(iid) > 1})
    if duplicates:
        raise ValueError(f"instance id {duplicates[0]!r} is given twice")
    return found


def _entry(entry: str) -> StaticInstance:
    url_text, _, given_id = entry.partition("=")
    url_text, given_id = url_text.strip(), given_id.strip()
    if "=" in entry and not given_id:
        raise ValueError(f"{entry!r} has an empty id after '='")
    url = urlsplit(url_text)
    try:
        port = url.port or 80
    except ValueError:
        raise ValueError(f"{url_text!r} has a port that is not a number 1..65535") from None
    host = url.hostname or ""
    problem = (
        "must be an http:// URL (the proxy does not speak TLS to instances)" if url.scheme != "http"
        else "names no host" if not host
        else f"host {host!r} is not {HOST_RULE}" if not is_host(host)
        else "must not carry a user name or password" if url.username or url.password
        else "must be the engine's base URL, without a path, query or fragment"
        if url.path not in ("", "/") or url.query or url.fragment
        else None)
    if problem:
        raise ValueError(f"{url_text!r} {problem}")
    instance_id = given_id or f"hp_{host}:{port}"
    if len(instance_id.encode()) > MAX_ID_BYTES:
        raise ValueError(f"instance id {instance_id!r} is longer than {MAX_ID_BYTES} bytes")
    shown_host = f"[{host}]" if ":" in host else host
    return StaticInstance(url=f"http://{shown_host}:{port}", host=host, port=port, instance_id=instance_id)
