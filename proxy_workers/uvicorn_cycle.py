"""Two hot-path shortcuts through uvicorn's `RequestResponseCycle` (httptools protocol).

The app is given the cycle's bound `send`, so `send.__self__` is the cycle. Through it:

- :func:`send_whole` writes a complete response (head and body) in one `transport.write` and
  does the bookkeeping uvicorn's `send` does when a response completes. Through `send` it is
  two writes (two loopback segments, two wake-ups of the client) and a regex per header:
  measured at about a tenth of a worker's CPU per JSON answer.
- :func:`watch_disconnect` registers a callback that our protocol
  (`drain.draining_protocol`) calls from `connection_lost`, instead of a task per request
  blocked in `receive()` to notice the client leaving.

Both read and set uvicorn internals, which is why pyproject pins uvicorn to 0.54.x; the
pinned version's tests (tests/test_uvicorn_cycle.py) fail if those internals move. Anything
that is not that cycle (another server, a test transport) gets plain ASGI: `send_whole`
returns False and `watch_disconnect` returns None, and the caller does it the generic way.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

# The attribute a cycle carries while somebody waits for its client to leave.
DISCONNECT_HOOK = "cacheroute_on_disconnect"

# Control characters other than tab: what uvicorn refuses in a header value.
_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0A-\x1F\x7F]")
_CRLF = b"\r\n"
_SEP = b": "


def cycle_of(send: Callable[..., Any]) -> RequestResponseCycle | None:
    cycle = getattr(send, "__self__", None)
    return cycle if isinstance(cycle, RequestResponseCycle) else None


def send_whole(send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]],
               body: bytes) -> bool:
    """Write `status`, `headers` (lower-case names, no content-length) and `body` as one
    response in one write. False, with nothing written, when the fast path does not apply
    (not uvicorn's cycle, already started, client gone, writes paused, HEAD, access log on):
    then the caller sends it through `send`."""
    cycle = cycle_of(send)
    if (cycle is None or cycle.response_started or cycle.disconnected or cycle.access_log
            or cycle.flow.write_paused or cycle.scope["method"] == "HEAD"):
        return False
    for _, value in headers:
        if _UNSAFE_VALUE.search(value):
            raise RuntimeError("Invalid HTTP header value.")  # as uvicorn's send would
    parts = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers):
        parts += (name, _SEP, value, _CRLF)
    keep_alive = cycle.keep_alive
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"content-length: %d\r\n\r\n" % len(body), body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.transport.write(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def watch_disconnect(send: Callable[..., Any], callback: Callable[[], None]) -> RequestResponseCycle | None:
    """Have `callback` called once if the client disconnects before the response completes.
    Returns the cycle to pass to :func:`unwatch_disconnect`, or None if this is not uvicorn's
    cycle (nothing registered: watch `receive()` instead)."""
    cycle = cycle_of(send)
    if cycle is None:
        return None
    setattr(cycle, DISCONNECT_HOOK, callback)
    return cycle


def unwatch_disconnect(cycle: RequestResponseCycle) -> None:
    setattr(cycle, DISCONNECT_HOOK, None)


def notify_disconnect(cycle: RequestResponseCycle | None) -> None:
    """From the protocol's `connection_lost`, after uvicorn's: call the callback if the client
    left before the response completed."""
    if cycle is None or not cycle.disconnected:
        return
    callback = getattr(cycle, DISCONNECT_HOOK, None)
    if callback is not None:
        setattr(cycle, DISCONNECT_HOOK, None)
        callback()
