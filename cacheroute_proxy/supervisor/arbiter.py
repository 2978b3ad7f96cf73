"""The launcher's master loop, after gunicorn's arbiter: start the sidecar first, then N
workers; restart whatever crashes (with backoff if it crash-loops); on SIGHUP replace the
workers one at a time (rolling.py); on SIGINT/SIGTERM stop the workers, then the sidecar, and
remove the segment. Instances are not its business: they register themselves.

Between passes the loop sleeps on a pipe that every signal writes to (`signal.set_wakeup_fd`):
a child's exit (SIGCHLD), a stop or a restart request wakes it at once, and with nothing
scheduled it sleeps IDLE_NAP_S, so an idle launcher costs next to no CPU.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import time

from cacheroute_proxy.auth import load_token
from cacheroute_proxy.config import Settings
from shm_schema import Segment

from .. import exits
from .children import Child, describe_exit
from ..probe import get_json
from .rolling import Retired, RollingRestart, reap_retired, stop_retired

log = logging.getLogger("cacheroute.supervisor")

READY_TIMEOUT_S = 20.0
MAX_BACKOFF_S = 10.0
STABLE_AFTER_S = 5.0  # a child that ran this long before dying is restarted without delay growth
# A worker's stop may take its whole drain (PROXY_DRAIN_TIMEOUT_S); SIGKILL only this much later.
STOP_MARGIN_S = 10.0
# At a stop, how long the workers wait for the sidecar to unregister (its own bound is 2 s).
LEAVE_WAIT_S = 3.0
# The loop's sleep between passes when a restart, a rolling step or a retired worker's stop
# deadline may be due; otherwise only a signal has work for it, and the sleep is a safety net.
BUSY_NAP_S = 0.1
IDLE_NAP_S = 5.0


class Arbiter:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Workers' request metrics live in per-process files here; a scrape sums them all.
        self.metrics_dir = settings.resolved_metrics_dir
        env = settings.to_env()
        self.sidecar = Child("sidecar", ["-m", "sidecar"], env)
        self.workers = [Child(f"worker{i}", ["-m", "proxy_workers", "--index", str(i)], env)
                        for i in range(settings.workers)]
        self._stopping = False
        self.failed = False
        self.stop_timeout_s = settings.drain_timeout_s + STOP_MARGIN_S
        self._restart_requested = False
        self._rolling: RollingRestart | None = None
        self.retired: list[Retired] = []  # old workers draining after a rolling restart

    # --- lifecycle -----------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_restart_signal)
        wakeup = _SignalWakeup()
        try:
            _fresh_directory(self.metrics_dir)
        except OSError as exc:
            log.error("cannot prepare the metrics directory %s (PROXY_METRICS_DIR): %s; stopping "
                      "(nothing was started)", self.metrics_dir, exc.strerror or exc)
            return 1
        try:
            self.sidecar.start()
            if not self._wait_healthy(f"{self.settings.cp_url}/healthz", self.sidecar):
                code = self.sidecar.exited()
                log.error("the sidecar did not become healthy (%s); stopping",
                          "its log above says why" if code is None else
                          f"exit {code}, {self._why_not_started(self.sidecar, code)}")
                return 1
            for child in self.workers:
                child.start()
            self._announce_when_ready()
            while not self._stopping:
                self._supervise_once()
                self._roll_once()
                wakeup.nap(BUSY_NAP_S if self._something_scheduled() else IDLE_NAP_S)
            return 1 if self.failed else 0
        finally:
            wakeup.close()
            self._stop_all()

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        if not self._stopping:
            log.info("%s received: stopping", signal.Signals(signum).name)
        self._stopping = True

    def _on_restart_signal(self, signum: int, frame: object) -> None:
        self._restart_requested = True

    def _something_scheduled(self) -> bool:
        """A pass may have work that no signal announces: a restart after its backoff, a rolling
        restart's next step, a retired worker to kill at its deadline."""
        return (self._rolling is not None or self._restart_requested or bool(self.retired)
                or any(child.next_start_at for child in self.children()))

    def _roll_once(self) -> None:
        """Start, advance or finish a rolling restart; reap retired workers that exited."""
        reap_retired(self.retired, self.stop_timeout_s)
        if self._restart_requested:
            self._restart_requested = False
            if self._rolling is not None:
                log.warning("SIGHUP ignored: a rolling restart is already in progress")
            else:
                self._rolling = RollingRestart(self.settings, self.workers, self.retired)
        if self._rolling is not None and not self._rolling.step(time.monotonic()):
            self._rolling = None

    def _supervise_once(self) -> None:
        """Children that exited: restarted with backoff, or, if they cannot start at all
        (exits.NOT_RESTARTED: restarting would only loop), the whole proxy stops with why."""
        now = time.monotonic()
        for child in self.children():
            code = child.exited()
            if code is None or self._stopping:
                continue
            if child.next_start_at == 0.0:
                child.exit_codes.append(code)
                ran_for = now - child.started_at
                if code in exits.NOT_RESTARTED and self._rolling is not None and self._rolling.replacing(child):
                    # e.g. its predecessor still holds the private port: the rest of the proxy
                    # serves, so retry with backoff instead of stopping everything.
                    log.warning("%s: the replacement cannot start yet (exit %d); retrying", child.name, code)
                elif code in exits.NOT_RESTARTED:
                    log.error("%s cannot start (exit %d, %s); stopping", child.name, code,
                              self._why_not_started(child, code))
                    self._stopping = True
                    self.failed = True
                    return
                child.backoff_s = self.settings.worker_restart_backoff_s if ran_for >= STABLE_AFTER_S \
                    else min(MAX_BACKOFF_S, child.backoff_s * 2)
                child.next_start_at = now + child.backoff_s
                log.warning("%s (pid %s) %s after %.1fs; restarting in %.1fs", child.name, child.pid,
                            describe_exit(code), ran_for, child.backoff_s)
            elif now >= child.next_start_at:
                child.next_start_at = 0.0
                child.restarts += 1
                child.start()

    def _why_not_started(self, child: Child, code: int) -> str:
        s = self.settings
        if code == exits.SERVICE_ADDRESS_IN_USE:
            return f"the service address {exits.host_port(s.dp_host, s.dp_port)} is taken"
        if code == exits.CONTROL_ADDRESS_IN_USE:
            return f"the control plane {exits.host_port(s.cp_host, s.cp_port)} is taken"
        if code == exits.PRIVATE_ADDRESS_IN_USE and child in self.workers:
            port = s.worker_private_port(self.workers.index(child))
            return f"its private address {exits.host_port(s.worker_private_host, port)} is taken"
        return "its log above says why"

    def _stop_all(self) -> None:
        self._stopping = True
        self._leave_scheduler()
        for group in (self.workers, [self.sidecar]):
            for child in group:
                child.signal(signal.SIGTERM)
            for child in group:  # one SIGTERM each: a second tells a worker to cut its drain short
                child.wait_or_kill(self.stop_timeout_s)
            if group is self.workers:  # and the old ones still draining from a rolling restart
                stop_retired(self.retired, self.stop_timeout_s)
        if Segment.unlink(self.settings.shm_name):
            log.info("removed shared table %s", self.settings.shm_name)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        log.info("all stopped")

    def _leave_scheduler(self) -> None:
        """First the sidecar leaves the Scheduler (SIGUSR1), and the workers close their
        listeners only once it has (or after LEAVE_WAIT_S): a request the Scheduler sends
        meanwhile still finds a worker."""
        if self.settings.scheduler_cp_url is None or self.sidecar.exited() is not None:
            return
        self.sidecar.signal(signal.SIGUSR1)
        token = load_token(self.settings.cp_token, self.settings.cp_token_file) \
            if self.settings.debug_requires_token else None
        deadline = time.monotonic() + LEAVE_WAIT_S
        while time.monotonic() < deadline:
            status = get_json(f"{self.settings.cp_url}/debug/status", token=token)
            link = status.get("scheduler") if isinstance(status, dict) else None
            if isinstance(link, dict) and not link.get("registered"):
                return
            time.sleep(0.05)
        log.warning("the sidecar had not left the Scheduler after %.1fs; stopping anyway", LEAVE_WAIT_S)

    def children(self) -> list[Child]:
        return [self.sidecar, *self.workers]

    # --- readiness -------------------------------------------------------------------------
    def _wait_healthy(self, url: str, child: Child) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            if child.exited() is not None:
                return False
            if get_json(url) is not None:
                return True
            time.sleep(0.1)
        return False

    def _announce_when_ready(self) -> None:
        s = self.settings
        urls = [f"http://{s.worker_private_host}:{s.worker_private_port(i)}/healthz" for i in range(s.workers)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            self._supervise_once()  # a worker that cannot start stops the launch now, not at the deadline
            if self._stopping:
                return
            if all(get_json(url) is not None for url in urls):
                log.info("ready: %d workers on http://%s:%d (strategy %s), control plane %s, dashboard %s",
                         s.workers, s.dp_host, s.dp_port, s.strategy_name, s.cp_url, s.dashboard_url)
                return
            time.sleep(0.2)
        log.warning("not every worker answered /healthz within %.0fs", READY_TIMEOUT_S)


class _SignalWakeup:
    """A pipe the interpreter writes each arriving signal's number to, so a sleep on it ends
    when a signal comes. SIGCHLD gets a handler of its own (its default is to be ignored, which
    would write nothing); the handlers themselves run in the main thread as usual."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous_chld = signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def nap(self, timeout_s: float) -> None:
        if select.select([self._read], [], [], timeout_s)[0]:
            try:
                while os.read(self._read, 512):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._previous_chld)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


def _fresh_directory(path: str) -> None:
    """An empty directory only the service user can read (metrics of a previous run would
    otherwise be summed into this one's)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
