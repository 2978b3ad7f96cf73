"""The Host header check of the sidecar's listeners, against DNS rebinding: a web page the
host's browser opens can make it send requests to 127.0.0.1 under the page's own name (the
attacker's DNS answers 127.0.0.1 for it), so a loopback control plane without a token would
take a register or unregister from any web site. The browser always sends the name it
resolved as Host, though: this middleware answers 421 to any request whose Host is not one of
the listener's own names, and says in words which names those are and which settings make
them. With a token configured it is not needed (a page cannot know the token) and not
installed.

Only the sidecar's listeners check Host: the workers' data plane answers under any name (a
load balancer or a DNS name in front of it is the usual way to reach it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import NamedTuple

from starlette.types import ASGIApp, Receive, Scope, Send

from cacheroute_proxy.config import ENV_NAMES
from cacheroute_proxy.http import error_response


class Listener(NamedTuple):
    """A listener as its refusal names it: what it is, and the settings that make its names."""
    what: str
    settings: tuple[str, ...]


CONTROL_PLANE = Listener("this control plane", (ENV_NAMES["cp_host"], ENV_NAMES["cp_port"]))
DASHBOARD = Listener("the dashboard's listener", (ENV_NAMES["ui_listen"], ENV_NAMES["ui_url"]))


def own_names(host: str) -> tuple[str, ...]:
    """The names a client of a listener on `host` legitimately sends as Host, without the port
    (an IPv6 address in brackets, as in a URL), in the order a refusal lists them."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    names = (shown, "127.0.0.1", "localhost", "[::1]", socket.gethostname())
    return tuple(dict.fromkeys(name.lower() for name in names))


class HostHeaderCheck:
    def __init__(self, app: ASGIApp, host: str, port: int, extra: Iterable[str] = (),
                 listener: Listener = CONTROL_PLANE) -> None:
        """`extra`: Host values of a URL the listener is published under (PROXY_UI_URL)."""
        self._app = app
        names = own_names(host)
        published = tuple(dict.fromkeys(name.lower() for name in extra))
        self._allowed = frozenset(names) | frozenset(f"{n}:{port}" for n in names) | frozenset(published)
        self._refusal = refusal_detail(listener, names, port, published)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1").lower()
            if host not in self._allowed:
                response = error_response(421, "misdirected_request", f"Host {host!r} {self._refusal}")
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


def refusal_detail(listener: Listener, names: tuple[str, ...], port: int,
                   published: tuple[str, ...]) -> str:
    """What follows the refused Host in the 421: the names taken, what sets them, the way out."""
    taken = f"{', '.join(names)} (each with or without :{port})"
    if published:
        taken += f" and {', '.join(published)}"
    return (f"is not a name of {listener.what}; it answers to {taken}, as "
            f"{' and '.join(listener.settings)} "
            f"set them (a web page under another name that resolves to this address is refused: "
            f"DNS rebinding). With a token ({ENV_NAMES['cp_token_file']}) any Host is accepted.")
