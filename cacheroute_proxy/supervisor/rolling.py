"""Rolling restart (SIGHUP to `cacheroute-proxy run`), after gunicorn: one worker at a time,
SIGTERM the old process (it drains: see proxy_workers/drain.py), start its replacement, wait
until the replacement answers /healthz on its private port, then the next.

The old process is *retired*, not waited for: it keeps its worker row and its connections until
its drain ends, while the replacement claims another free row and (once the old listener is
closed) the same private port. The arbiter reaps retired processes as they exit.

Everything here is stepped from the arbiter's loop (`step()` every tick), so crashes of other
children are still handled while a restart rolls.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass

from cacheroute_proxy.config import Settings

from .children import Child
from ..probe import get_json

log = logging.getLogger("cacheroute.supervisor")

REPLACEMENT_READY_TIMEOUT_S = 30.0


@dataclass
class Retired:
    """An old worker process draining after SIGTERM; its replacement already runs."""

    name: str
    process: subprocess.Popen[bytes]
    signalled_at: float


class RollingRestart:
    def __init__(self, settings: Settings, workers: list[Child], retired: list[Retired]) -> None:
        self._settings = settings
        self._workers = workers
        self._pending = list(enumerate(workers))
        self._retired = retired  # the arbiter's list: it reaps them and stops them at exit
        self._current: tuple[int, Child] | None = None
        self._started = False  # has the current worker's replacement been started?
        self._deadline = 0.0
        self._waiting_for_row = False
        self.replaced = 0
        log.info("rolling restart of %d workers (SIGHUP)", len(workers))

    def step(self, now: float) -> bool:
        """Advance; False once every worker has been replaced (or the restart gave up)."""
        if self._current is None:
            if not self._pending:
                log.info("rolling restart done: %d workers replaced", self.replaced)
                return False
            index, child = self._pending.pop(0)
            if child.process is None or child.exited() is not None:
                return True  # down already; ordinary supervision restarts it
            self._retire(child, now)
            self._current, self._started = (index, child), False
        if not self._started:
            self._start_replacement(now)
        elif self._done_waiting(now):
            self._current = None
        return True

    def replacing(self, child: Child) -> bool:
        """Is `child` the worker whose replacement is starting right now?"""
        return self._current is not None and self._current[1] is child

    def _retire(self, child: Child, now: float) -> None:
        old = child.process
        assert old is not None
        old.send_signal(signal.SIGTERM)
        self._retired.append(Retired(child.name, old, now))
        # The slot no longer names the old process: its exit is the retired list's business,
        # not a crash for the arbiter to restart (the replacement is started here).
        child.process = None
        log.info("%s (pid %d) draining; starting its replacement", child.name, old.pid)

    def _start_replacement(self, now: float) -> None:
        """Start it once a worker row is free (the retired one holds its own until it exits)."""
        assert self._current is not None
        if self._rows_in_use() >= self._settings.shm_worker_capacity:
            if not self._waiting_for_row:
                log.info("all %d worker rows in use (PROXY_SHM_WORKER_CAPACITY): the replacement "
                         "waits for a retired worker to exit", self._settings.shm_worker_capacity)
            self._waiting_for_row = True
            return
        self._waiting_for_row = False
        self._current[1].start()
        self._started, self._deadline = True, now + REPLACEMENT_READY_TIMEOUT_S

    def _done_waiting(self, now: float) -> bool:
        """True once the replacement answers /healthz, or (giving up the restart) on a timeout."""
        assert self._current is not None
        index, child = self._current
        pid = _healthz_pid(self._settings, index)
        if pid is not None and pid == child.pid:
            log.info("%s replaced: pid %d answers on its private port", child.name, pid)
            self.replaced += 1
            return True
        if now >= self._deadline:
            log.error("%s: the replacement (pid %s) did not answer /healthz within %.0fs; rolling "
                      "restart stopped, %d workers not replaced", child.name, child.pid,
                      REPLACEMENT_READY_TIMEOUT_S, len(self._pending))
            self._pending.clear()
            return True
        return False

    def _rows_in_use(self) -> int:
        """Live worker processes, current and retired: each holds one row until it exits."""
        live = {c.process.pid for c in self._workers if c.process is not None and c.process.poll() is None}
        live |= {r.process.pid for r in self._retired if r.process.poll() is None}
        return len(live)


def _healthz_pid(settings: Settings, index: int) -> int | None:
    body = get_json(f"http://{settings.worker_private_host}:{settings.worker_private_port(index)}/healthz")
    return body.get("pid") if isinstance(body, dict) else None


def reap_retired(retired: list[Retired], stop_timeout_s: float) -> None:
    """Forget retired processes that exited; SIGKILL one that outlived
    its drain by far (its own deadline should have ended it)."""
    now = time.monotonic()
    for item in list(retired):
        code = item.process.poll()
        if code is None:
            if now - item.signalled_at > stop_timeout_s:
                log.warning("retired %s (pid %d) still running %.0fs after SIGTERM: SIGKILL",
                            item.name, item.process.pid, now - item.signalled_at)
                item.process.kill()
            continue
        retired.remove(item)
        log.info("retired %s (pid %d) exited with code %d after draining %.1fs", item.name,
                 item.process.pid, code, now - item.signalled_at)


def stop_retired(retired: list[Retired], timeout_s: float) -> None:
    """At exit: wait for the retired workers (SIGTERMed already) to end their drain."""
    for item in retired:
        try:
            item.process.wait(timeout=max(0.0, timeout_s - (time.monotonic() - item.signalled_at)))
        except subprocess.TimeoutExpired:
            log.warning("retired %s (pid %d) did not stop: SIGKILL", item.name, item.process.pid)
            item.process.kill()
            item.process.wait(5.0)
    retired.clear()
