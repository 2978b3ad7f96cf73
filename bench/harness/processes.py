"""What starting and stopping a benchmark's processes shares: the address, small HTTP calls,
waiting for a process to be ready, scratch directories, and `Started` (a context manager that
stops what did start when a start fails). bench/harness/backends.py starts the instances,
bench/harness/contenders.py what is measured over them."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Self

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0


class StartError(RuntimeError):
    """A contender did not come up; the message carries the end of its log."""


# --- small HTTP helpers ------------------------------------------------------------------------
def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, decoded JSON or None); never raises for an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             alive: Callable[[], bool] = lambda: True, log: Callable[[], str] = lambda: "") -> None:
    """Poll until `predicate()` is true; StartError on timeout or when `alive()` turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise StartError(f"{what}: the process ended\n{log()}")
        try:
            if predicate():
                return
        except (OSError, ValueError, KeyError):
            pass  # not listening yet, or not answering in full yet
        time.sleep(0.1)
    raise StartError(f"{what}: not ready after {timeout:.0f} s\n{log()}")


def answers_ok(url: str) -> bool:
    return http_json("GET", url, timeout=2.0)[0] == 200


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))


def remove_dir(path: Path) -> None:
    """A stopped contender's temp dir goes (a failed start already put its log tail in the
    StartError)."""
    shutil.rmtree(path, ignore_errors=True)


class Started:
    """A context manager that starts in __enter__ (stopping what did start if that fails) and
    stops, by pid, in __exit__."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
