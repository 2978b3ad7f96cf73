"""A supervised child process: how to start it, whether it runs, how to stop it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("cacheroute.supervisor")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies, so nothing outlives a killed launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    restart: bool = True
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.5
    next_start_at: float = 0.0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, *self.argv], env={**os.environ, **self.env},
            # Own session: Ctrl-C reaches only the supervisor, which stops children in order.
            start_new_session=True, preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def exited(self) -> int | None:
        """The exit code if the child has exited (and is reaped), else None."""
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
        self.signal(signal.SIGTERM)
        self.wait_or_kill(timeout_s)

    def wait_or_kill(self, timeout_s: float) -> None:
        """For a child already asked to stop (a second SIGTERM would tell it to stop waiting
        for what it has in flight): SIGKILL if it has not exited within `timeout_s`."""
        if not self.wait(timeout_s):
            log.warning("%s (pid %s) did not stop within %.0fs: SIGKILL", self.name, self.pid, timeout_s)
            self.signal(signal.SIGKILL)
            self.wait(5.0)


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
