"""One log format for every process: time, role[pid], level, logger, message."""

from __future__ import annotations

import logging
import os
import sys


def configure(role: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's access log is per request: noise at info on a data plane.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def keep_control_after_signals() -> None:
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with the default handler
    that kills the process before our `finally` blocks release shared-memory state. A no-op
    handler makes the re-raise harmless, so cleanup always runs."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
