"""Graceful drain of one worker on SIGTERM: stop accepting, let what is in flight finish up to
`PROXY_DRAIN_TIMEOUT_S`, then cut what is left cleanly, and say what happened.

The mechanics that reach into uvicorn (a protocol that never closes a connection under a request
that may be on its way, a server that says when its shutdown begins and acts at the deadline)
are in cacheroute_proxy/uvicorn_seam.py; this module decides what they do:

- :class:`Drain` is the worker's state of leaving: whether it drains, the requests in flight,
  what finished and what was cut; the seam's `DrainingServer` calls `begin` when the listeners
  close, `cut_remaining` at the deadline and `report` at the end.
- :class:`DrainGate` (ASGI) knows every request in flight. At the deadline it cancels them (their
  leases end in the exchange's `finally`) and finishes each response itself: a stream gets a
  `cacheroute_meta` event whose `error` is `worker_drain_deadline` and no `[DONE]`, a request
  not yet answered gets 503 `worker_draining`, so no client hangs on a worker that is leaving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from cacheroute_proxy.uvicorn_seam import response_progress

from .sse import cut_meta_event
from .trace import Trace

log = logging.getLogger("cacheroute.worker")

DRAIN_CUT_ERROR = "worker_drain_deadline"
# uvicorn's own deadline comes this long after ours: cut streams get to send their last event.
CUT_FLUSH_S = 2.0

_CUT_BODY = (b'{"error": "worker_draining", "detail": "the worker stopped at its drain deadline '
             b'before answering; retry"}')


def _under_way(send: Send) -> bool:
    # A JSON answer goes out in one go (head and body back to back), so a response that has
    # started and not ended is, in practice, a stream.
    started, complete = response_progress(send)
    return started and not complete


class Drain:
    """What the worker is doing about its exit: draining or not, the requests in flight, counts."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active: dict[asyncio.Task[Any], Send] = {}  # request task -> uvicorn's send
        self.cutting: set[asyncio.Task[Any]] = set()
        self.in_flight_at_start = 0
        self.streams_at_start = 0
        self.finished = 0  # requests that ended normally after the drain began
        self.cut = 0
        self.cut_streams = 0

    def begin(self, connections: int) -> None:
        self.draining = True
        self.in_flight_at_start = len(self.active)
        self.streams_at_start = sum(map(_under_way, self.active.values()))
        log.info("draining: stopped accepting; %d requests in flight (%d streams) on %d connections; "
                 "deadline %.0fs", self.in_flight_at_start, self.streams_at_start, connections,
                 self.timeout_s)

    def cut_remaining(self) -> None:
        """The deadline: cancel every request still running; DrainGate ends each response."""
        for task, send in list(self.active.items()):
            started, complete = response_progress(send)
            if complete:
                continue
            self.cutting.add(task)
            self.cut += 1
            self.cut_streams += started
            task.cancel(msg=DRAIN_CUT_ERROR)
        if self.cut:
            log.warning("drain deadline (%.0fs) reached: cutting %d requests (%d streams)",
                        self.timeout_s, self.cut, self.cut_streams)

    def report(self) -> None:
        log.info("drained: %d requests finished during the drain (%d were in flight at SIGTERM, "
                 "%d streams); %d cut at the deadline (%d streams)", self.finished,
                 self.in_flight_at_start, self.streams_at_start, self.cut, self.cut_streams)


async def finish_cut(send: Send) -> None:
    """End a response the deadline cut: a stream gets its error event and no [DONE]; a request
    not yet answered gets 503."""
    started, complete = response_progress(send)
    if complete:
        return
    if started:
        body = cut_meta_event(Trace(), DRAIN_CUT_ERROR)
    else:
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", b"1")]})
        body = _CUT_BODY
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainGate:
    """ASGI middleware: registers each HTTP request with the Drain, finishes it if it is cut."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self._app = app
        self._drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        drain = self._drain
        task = asyncio.current_task()
        assert task is not None
        drain.active[task] = send
        cut = False
        try:
            await self._app(scope, receive, send)
        except asyncio.CancelledError:
            if task not in drain.cutting:
                raise
            # Our own cancellation, handled once (a second one, from uvicorn's backstop or the
            # loop's shutdown, goes through): answer the client, then end normally.
            drain.cutting.discard(task)
            cut = True
            task.uncancel()
            await finish_cut(send)
        finally:
            del drain.active[task]
            if drain.draining and not cut:
                drain.finished += 1


def uvicorn_graceful_timeout(drain_timeout_s: float) -> float:
    """uvicorn's own backstop, after our deadline and the flush of the cut responses."""
    return drain_timeout_s + CUT_FLUSH_S

