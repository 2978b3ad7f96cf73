"""What every benchmark's command line shares: repeated NAME=VALUE options, SIGTERM stopping a
run the way Ctrl-C does (so every `with` stops what it started), the exit code of a run that
could not start or was stopped, and progress lines stamped with the seconds since the run
began."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any, Callable, TypeVar

from bench.harness.processes import StartError

T = TypeVar("T")


def name_values(items: list[str]) -> dict[str, str]:
    """A command line's repeated NAME=VALUE options (proxy settings) as a dict; a malformed one
    stops the benchmark naming it."""
    found = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        found[name] = value
    return found


def stop_on_sigterm() -> None:
    """The first SIGTERM raises KeyboardInterrupt, as Ctrl-C does: it unwinds through every
    `with`, so every process the benchmark started is stopped. Later ones are ignored: a SIGTERM
    sent to the benchmark's process group reaches it twice when a `timeout` in that group passes
    its own on, and a second KeyboardInterrupt would cut the stopping short."""
    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def measured(work: Callable[[], T], what: str = "a contender") -> tuple[T | None, int]:
    """Run a benchmark's measuring part, whose `with`s stop what it started: (its result, 0);
    or, said on stderr, (None, 1) when `what` did not start, (None, 130) when the run was
    interrupted (Ctrl-C, or SIGTERM through stop_on_sigterm)."""
    try:
        return work(), 0
    except StartError as exc:
        print(f"{what} did not start: {exc}", file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        return None, 130


class Progress:
    """Progress lines on stdout, each stamped with the seconds since this was made."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)
