"""What the server asks of a role's drain, and the plain drain (the sidecar's)."""

from __future__ import annotations

from typing import Any, Coroutine, Protocol

from .cycle import Cycle


class Draining(Protocol):
    """What the server asks of the role's drain: a worker's proxy_workers/drain.py Drain, or
    :class:`GracefulExit`."""

    timeout_s: float
    # True: an idle connection stays open through the drain (a request may be on its way,
    # and a peer on the same port takes the next one); False: it is closed at once.
    keeps_idle_connections: bool

    @property
    def draining(self) -> bool: ...

    def begin(self, connections: int) -> None: ...

    def cut_remaining(self) -> None: ...

    def report(self) -> None: ...

    async def run(self, cycle: Cycle, request: Coroutine[Any, Any, None]) -> None:
        """Run one request's handling, knowing it is in flight (and ending it if it is cut)."""


class GracefulExit:
    """The plain drain (the sidecar's): stop accepting, close idle connections (no peer takes
    over the port, so nothing is gained by waiting on them), give what is in flight
    `timeout_s`, then the server closes what is left; nothing to finish by hand or report."""

    keeps_idle_connections = False

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False

    def begin(self, connections: int) -> None:
        self.draining = True

    def cut_remaining(self) -> None:
        pass

    def report(self) -> None:
        pass

    async def run(self, cycle: Cycle, request: Coroutine[Any, Any, None]) -> None:
        await request
