"""The dashboard's own listener (PROXY_UI_LISTEN, the original's 127.0.0.1:8202).

The same uvicorn server serves both sockets; requests are told apart by the local port they
arrived on. The UI listener answers the dashboard, its files and its read-only data routes
(sidecar/dashboard_routes.py) and nothing else: no register, no heartbeat, no /debug/* beyond
what the page reads. The control plane's rules hold on it too: its data routes take the debug
token when PROXY_DEBUG_REQUIRES_TOKEN is set, and without a token configured only requests
naming it (or PROXY_UI_URL's host) as Host are served (DNS rebinding, sidecar/host_header_check.py).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import ERROR_HANDLERS

from .host_header_check import DASHBOARD, HostHeaderCheck


def ui_app(dashboard: list[BaseRoute], settings: Settings, with_host_header_check: bool) -> ASGIApp:
    async def root(request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    app: ASGIApp = Starlette(routes=[Route("/", root, methods=["GET"]), *dashboard],
                             exception_handlers=ERROR_HANDLERS)
    if not with_host_header_check:
        return app
    assert settings.ui_address is not None
    host, port = settings.ui_address
    return HostHeaderCheck(app, host, port, extra=_url_names(settings.ui_url), listener=DASHBOARD)


def _url_names(url: str) -> tuple[str, ...]:
    """The Host a browser sends when it opens PROXY_UI_URL (a tunnel or a proxy in front)."""
    if not url:
        return ()
    parts = urlsplit(url)
    return (parts.netloc.rpartition("@")[2],) if parts.netloc else ()


class ByListener:
    """Send each HTTP request to the app of the socket it arrived on; lifespan to the control
    plane's app (it owns the sidecar's loops)."""

    def __init__(self, control: ASGIApp, ui: ASGIApp, ui_port: int) -> None:
        self._control = control
        self._ui = ui
        self._ui_port = ui_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == self._ui_port:
            await self._ui(scope, receive, send)
        else:
            await self._control(scope, receive, send)
