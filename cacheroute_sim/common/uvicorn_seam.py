"""The one module that knows uvicorn beyond `uvicorn.Config` and `uvicorn.Server(...).serve()`:
the simulators run on uvicorn (the product serves on cacheroute_proxy/http1/). What
it reads or sets is not documented by uvicorn, so tests/test_uvicorn_seam.py runs each piece
against a real uvicorn server on 127.0.0.1, and tests/test_layout.py checks that no other
module reaches for uvicorn's internals: whether a server listens or was asked to exit, asking
it to, and a server whose signals its caller handles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn



def has_started(server: uvicorn.Server) -> bool:
    """Every listener is open: a client connecting now is served."""
    return server.started


def exit_requested(server: uvicorn.Server) -> bool:
    """Shutdown has been asked for (uvicorn's signal handler sets it, then drains)."""
    return server.should_exit


def request_exit(server: uvicorn.Server, *, force: bool = False) -> None:
    """Begin a graceful shutdown; `force`: stop waiting for what is in flight."""
    server.should_exit = True
    if force:
        server.force_exit = True


class SignalFreeServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to its caller (the simulators): uvicorn's
    own handler would re-raise the signal once serve() returns, so the process would end by
    signal instead of exit status 0, and it would start draining before the caller did what
    must come first (a simulated instance unregisters from the proxy, then asks to drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
