"""The fast paths of a response, whichever server the worker runs (PROXY_DP_SERVER): its own
(proxy_workers/http1_server.py, plain methods of its Cycle) or uvicorn (through
cacheroute_proxy/uvicorn_seam.py). Each takes the `send` an app was given; for any other
server it answers "not here" and the caller does it the plain ASGI way."""

from __future__ import annotations

from typing import Any, Callable

from cacheroute_proxy import uvicorn_seam as seam

from .http1_server import Cycle

Header = tuple[bytes, bytes]


def _native(send: Callable[..., Any]) -> Cycle | None:
    cycle = getattr(send, "__self__", None)
    return cycle if type(cycle) is Cycle else None


def send_whole(send: Callable[..., Any], status: int, headers: list[Header], body: bytes) -> bool:
    """Status, headers (lower-case names, no content-length) and body in one write; False with
    nothing written when that does not apply."""
    cycle = _native(send)
    if cycle is not None:
        return cycle.send_whole(status, headers, body)
    return seam.send_whole(send, status, headers, body)


def response_progress(send: Callable[..., Any]) -> tuple[bool, bool]:
    """(started, complete); (True, False) for a server we cannot look into."""
    cycle = _native(send)
    if cycle is not None:
        return cycle.started, cycle.complete
    return seam.response_progress(send)


class Watch:
    """A disconnect callback registered on one request (`unwatch` ends it)."""

    __slots__ = ("_native", "_uvicorn")

    def __init__(self, native: Cycle | None, uvicorn_cycle: Any) -> None:
        self._native = native
        self._uvicorn = uvicorn_cycle

    def client_gone(self) -> bool:
        if self._native is not None:
            return self._native.disconnected
        return seam.client_gone(self._uvicorn)

    def unwatch(self) -> None:
        if self._native is not None:
            self._native.on_disconnect = None
        else:
            seam.unwatch_disconnect(self._uvicorn)


def watch_disconnect(send: Callable[..., Any], callback: Callable[[], None]) -> Watch | None:
    """Have `callback` called once if the client leaves before the response completes; None
    when the server cannot say (then watch `receive()`)."""
    cycle = _native(send)
    if cycle is not None:
        cycle.on_disconnect = callback
        return Watch(cycle, None)
    uvicorn_cycle = seam.watch_disconnect(send, callback)
    return None if uvicorn_cycle is None else Watch(None, uvicorn_cycle)
