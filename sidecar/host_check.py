"""DNS rebinding: a web page the host's browser opens can make it send requests to 127.0.0.1
under the page's own name (the attacker's DNS answers 127.0.0.1 for it), so a loopback control
plane without a token would take a register or unregister from any web site. The browser
always sends the name it resolved as Host, though: this middleware answers 421 to any request
whose Host is not one of the control plane's own names. With a token configured it is not
needed (a page cannot know the token) and not installed.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from cacheroute_proxy.http import error_response


def own_names(host: str, port: int) -> frozenset[str]:
    """The Host header values a client of this listener legitimately sends (port or not)."""
    names = {host, "localhost", "127.0.0.1", "[::1]", socket.gethostname()}
    if ":" in host and not host.startswith("["):
        names.add(f"[{host}]")
    return frozenset(n.lower() for n in names) | frozenset(f"{n.lower()}:{port}" for n in names)


class HostCheck:
    def __init__(self, app: ASGIApp, host: str, port: int, extra: Iterable[str] = ()) -> None:
        self._app = app
        # extra: Host values of a URL the listener is published under (PROXY_UI_URL).
        self._allowed = own_names(host, port) | frozenset(name.lower() for name in extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1").lower()
            if host not in self._allowed:
                response = error_response(421, "misdirected_request",
                                          f"Host {host!r} is not this control plane's (a page "
                                          f"resolving its own name to 127.0.0.1?); set a token "
                                          f"(PROXY_CP_TOKEN_FILE) to accept any Host")
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)
