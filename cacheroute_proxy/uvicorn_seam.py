"""The one module that knows uvicorn beyond `uvicorn.Config` and `uvicorn.Server(...).serve()`:
the sidecar's control plane and the simulators run on uvicorn (the workers' data plane runs on
proxy_workers/http1_server.py). What it reads or sets is not documented by uvicorn, so
tests/test_uvicorn_seam.py runs each piece against a real uvicorn server on 127.0.0.1, and
tests/test_layout.py checks that no other module reaches for uvicorn's internals: how many
requests and connections a server has, whether it listens or was asked to exit, running it
on its configured event loop, and a server whose signals its caller handles.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, Callable

import uvicorn


# --- a server ----------------------------------------------------------------------------------
def requests_in_flight(server: uvicorn.Server) -> int:
    """Requests the server runs right now (one task per request cycle, streams included)."""
    return len(server.server_state.tasks)


def open_connections(server: uvicorn.Server) -> int:
    return len(server.server_state.connections)


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


def run_with(server: uvicorn.Server, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `main()` to completion on the event loop `server.run()` would use (uvloop when the
    config asks for it), so other tasks can share the server's loop."""
    factory = getattr(server.config, "get_loop_factory", None)
    if factory is None:  # older uvicorn installs an event loop policy instead
        server.config.setup_event_loop()
    with asyncio.Runner(loop_factory=factory() if factory else None) as runner:
        runner.run(main())


class SignalFreeServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to its caller (the simulators): uvicorn's
    own handler would re-raise the signal once serve() returns, so the process would end by
    signal instead of exit status 0, and it would start draining before the caller did what
    must come first (a simulated instance unregisters from the proxy, then asks to drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
