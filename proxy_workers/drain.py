"""Graceful drain of one worker on SIGTERM: stop accepting, let what is in flight finish up to
`PROXY_DRAIN_TIMEOUT_S`, then cut what is left cleanly, and say what happened.

:class:`Drain` is the worker's state of leaving: whether it drains, the requests in flight,
what finished and what was cut. The worker's server (cacheroute_proxy/http1/) tells it of
every request it handles (`enter`, `leave`; `cut_off` for a cancellation), calls `begin` when
its listeners close, `cut_remaining` at the deadline and `report` at the end. At the deadline
every request still running is cancelled (its lease ends in the exchange's `finally`) and its
response finished here: a stream gets a `cacheroute_meta` event whose `error` is
`worker_drain_deadline` and no `[DONE]`, a request not yet answered gets 503
`worker_draining`, so no client hangs on a worker that is leaving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from .refusals import RETRY_AFTER_S
from .sse import cut_meta_event
from .trace import Trace

log = logging.getLogger("cacheroute.worker")

DRAIN_CUT_ERROR = "worker_drain_deadline"
# The server's backstop comes this long after our deadline: cut streams send their last event.
CUT_FLUSH_S = 2.0

_CUT_BODY = (b'{"error": "worker_draining", "detail": "the worker stopped at its drain deadline '
             b'before answering; retry"}')
_CUT_HEAD = [(b"content-type", b"application/json"),
             (b"retry-after", str(RETRY_AFTER_S["worker_draining"]).encode()),
             (b"content-length", b"%d" % len(_CUT_BODY))]


class Response(Protocol):
    """What the drain needs of a request's response (http1.Cycle)."""

    started: bool
    complete: bool
    task: asyncio.Task[None] | None  # the task that answers it (set by the server)

    def start(self, status: int, headers: Any) -> None: ...

    def end(self, body: bytes = b"") -> None: ...


def _under_way(response: Response) -> bool:
    # A JSON answer goes out in one go (head and body back to back), so a response that has
    # started and not ended is, in practice, a stream.
    return response.started and not response.complete


class Drain:
    """What the worker is doing about its exit: draining or not, the requests in flight, counts."""

    # A request may already be on its way on an idle keep-alive connection: it is answered
    # (with `Connection: close`), and the other workers on the port take the next one.
    keeps_idle_connections = True

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active: dict[asyncio.Task[Any], Response] = {}  # request task -> its response
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
        """The deadline: cancel every request still running; `cut_off` ends each response."""
        for task, response in list(self.active.items()):
            if response.complete:
                continue
            self.cutting.add(task)
            self.cut += 1
            self.cut_streams += response.started
            task.cancel(msg=DRAIN_CUT_ERROR)
        if self.cut:
            log.warning("drain deadline (%.0fs) reached: cutting %d requests (%d streams)",
                        self.timeout_s, self.cut, self.cut_streams)

    def report(self) -> None:
        log.info("drained: %d requests finished during the drain (%d were in flight at SIGTERM, "
                 "%d streams); %d cut at the deadline (%d streams)", self.finished,
                 self.in_flight_at_start, self.streams_at_start, self.cut, self.cut_streams)

    # The server's calls around each request's handling (cacheroute_proxy/http1/draining.py):
    # plain calls in its own frame, not a coroutine around the handling, which every
    # resumption of the request's task would pass through.
    def enter(self, response: Response) -> None:
        """`response`'s request is in flight, handled in its task."""
        assert response.task is not None
        self.active[response.task] = response

    def cut_off(self, response: Response) -> bool:
        """Asked of a CancelledError in the request's task: if it is our own (the deadline),
        handled once (a second one, from the server's backstop or the loop's shutdown, goes
        through): the client is answered, the task's cancellation taken back, and True."""
        task = response.task
        if task not in self.cutting:
            return False
        self.cutting.discard(task)
        task.uncancel()  # type: ignore[union-attr]
        finish_cut(response)
        return True

    def leave(self, response: Response, cut: bool) -> None:
        del self.active[response.task]  # type: ignore[arg-type]
        if self.draining and not cut:
            self.finished += 1


def finish_cut(response: Response) -> None:
    """End a response the deadline cut: a stream gets its error event and no [DONE]; a request
    not yet answered gets 503."""
    if response.complete:
        return
    if response.started:
        response.end(cut_meta_event(Trace(), DRAIN_CUT_ERROR))
        return
    response.start(503, _CUT_HEAD)
    response.end(_CUT_BODY)
