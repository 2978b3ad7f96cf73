"""What the server asks of a role's drain, and the plain drain (the sidecar's)."""

from __future__ import annotations

from typing import Protocol

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

    def enter(self, cycle: Cycle) -> None:
        """`cycle`'s request is being handled, in its task (`cycle.task`)."""

    def cut_off(self, cycle: Cycle) -> bool:
        """Asked of a CancelledError in `cycle`'s task: True if the drain's deadline cut the
        request, which is then answered and ended here (and the task's cancellation taken
        back); False for any other cancellation."""

    def leave(self, cycle: Cycle, cut: bool) -> None:
        """`cycle`'s handling is over (`cut`: by the deadline)."""


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

    def enter(self, cycle: Cycle) -> None:
        pass

    def cut_off(self, cycle: Cycle) -> bool:
        return False

    def leave(self, cycle: Cycle, cut: bool) -> None:
        pass
