"""The proxy's registration with the Scheduler control plane (docs/protocol.md, "Scheduler
control plane"), from the sidecar.

The proxy as a whole (every worker behind the one data-plane port) registers once, from the
sidecar; workers never talk to the Scheduler. A background task registers, heartbeats with the
`pool_resource` snapshot and unregisters on a clean stop. Unlike the original it
registers again whenever the Scheduler may have forgotten us: a
heartbeat answered 404, or any failed call (the Scheduler may have restarted meanwhile;
register is an upsert, so a spurious one is harmless). Nothing here can stop the sidecar from
starting or serving: every call has a timeout, failures back off exponentially up to a cap,
and warnings are rate-limited. The HTTP underneath (sidecar/scheduler_http.py) keeps
connections alive no longer than the Scheduler does, and sends a call once more on a new
connection when a kept-alive one was closed before any byte of the answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http1.client import ConnectFailed

from .scheduler_http import ReplyTooLarge, SchedulerHttp
from .scheduler_wire import (
    ENDPOINTS,
    PROXY_VERSION,
    HeartbeatBody,
    MetaPatch,
    PoolResource,
    ProxyMeta,
    RegisterBody,
    RegisterReply,
    UnregisterBody,
)

log = logging.getLogger("cacheroute.sidecar.scheduler")

UNREGISTER_TIMEOUT_S = 2.0   # shutdown must not wait long for a slow Scheduler
MIN_INTERVAL_S = 0.05        # a Scheduler answering interval 0 must not make us spin
BACKOFF_BASE_S = 0.5
WARN_EVERY_S = 30.0          # at most one "still failing" warning this often
WORKER_POLL_S = 0.1
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class CallFailed(Exception):
    """A call to the Scheduler failed (no answer, or an unexpected status)."""


@dataclass(frozen=True)
class Identity:
    proxy_id: str
    host: str
    port: int

    @classmethod
    def from_settings(cls, settings: Settings) -> "Identity":
        host = settings.advertise_host or settings.dp_host
        if host in WILDCARDS:  # a bind-all address is no address to send requests to
            host = socket.gethostname()  # no DNS lookup: a closed network must not stall start
        port = settings.advertise_port or settings.dp_port
        return cls(settings.proxy_id or f"hp_{host}:{port}", host, port)


@dataclass
class LinkStatus:
    """What `/debug/status` shows under `scheduler`."""

    enabled: bool
    url: str | None = None
    proxy_id: str | None = None
    advertised: str | None = None
    registered: bool = False
    waiting_for_workers: bool = False
    registrations: int = 0
    re_registrations: int = 0
    heartbeats_ok: int = 0
    # Calls sent again because the Scheduler closed a kept-alive connection unanswered
    # (sidecar/scheduler_http.py): the keep-alive race, met and not a failure.
    resent_after_idle_close: int = 0
    consecutive_failures: int = 0
    failures_total: int = 0
    last_success_at: float | None = None
    last_error: str | None = None
    heartbeat_interval_s: float | None = None
    scheduler_ttl_s: float | None = None
    unregistered: bool = False

    def describe(self) -> dict[str, Any]:
        shown = asdict(self)
        shown["last_success_age_s"] = (None if self.last_success_at is None
                                       else round(time.time() - self.last_success_at, 3))
        return shown


class FailureLog:
    """First failure of a streak: one warning. Then at most one summary per WARN_EVERY_S,
    and one line when the Scheduler answers again: bounded however long it stays down."""

    def __init__(self, every_s: float = WARN_EVERY_S) -> None:
        self._every_s = every_s
        self._streak = 0
        self._last_warned = 0.0

    def failed(self, what: str, error: str) -> None:
        self._streak += 1
        now = time.monotonic()
        if self._streak == 1 or now - self._last_warned >= self._every_s:
            self._last_warned = now
            suffix = "" if self._streak == 1 else f" ({self._streak} failures in a row)"
            log.warning("Scheduler %s failed: %s%s; the proxy serves on, retrying with backoff",
                        what, error, suffix)

    def recovered(self, what: str) -> None:
        if self._streak:
            log.info("Scheduler reachable again: %s succeeded after %d failures", what, self._streak)
        self._streak = 0


class SchedulerLink:
    def __init__(self, settings: Settings, snapshot: Callable[[str], PoolResource],
                 instance_count: Callable[[], int], serving: Callable[[], bool],
                 kdn_links: Callable[[], dict[str, Any]] | None = None) -> None:
        assert settings.scheduler_cp_url is not None
        self._base = settings.scheduler_cp_url.rstrip("/")
        self._settings = settings
        self._snapshot = snapshot
        self._instance_count = instance_count
        self._serving = serving
        self.identity = Identity.from_settings(settings)
        self._proxy_id = self.identity.proxy_id  # the Scheduler may rename us in its reply
        self._interval_s = settings.scheduler_heartbeat_s
        # PROXY_KDN_LINKS_JSON overlaid by the instances' topology reports (the sidecar's
        # state.kdn_links); sent in the register meta, and in a heartbeat's meta_patch whenever
        # it differs from what the Scheduler last accepted.
        self._kdn_links = kdn_links or (lambda: dict(settings.kdn_links))
        self._links_sent: dict[str, Any] | None = None
        self._http: SchedulerHttp | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._failures = FailureLog()
        self.status = LinkStatus(enabled=True, url=_safe_url(self._base), proxy_id=self._proxy_id,
                                 advertised=f"{self.identity.host}:{self.identity.port}")

    # --- lifecycle (the sidecar's lifespan) --------------------------------------------------------
    def start(self) -> None:
        self._http = SchedulerHttp(self._base, self._settings.scheduler_timeout_s)
        self._task = asyncio.create_task(self._run(), name="scheduler-link")
        log.info("registering with the Scheduler at %s as %s (advertised %s)",
                 self.status.url, self._proxy_id, self.status.advertised)

    async def stop(self, unregister: bool = True) -> None:
        """Stop heartbeating; unregister (briefly) if asked and the Scheduler may know us. Runs
        once: the supervisor's SIGUSR1 (the whole proxy is stopping) starts it before the
        lifespan's end, which then waits for the same unregister instead of cutting it short."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_once(unregister))
        await asyncio.shield(self._stopping)

    async def _stop_once(self, unregister: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if unregister and self.status.registrations:
                await self._unregister()
            elif self.status.registered:
                log.info("stopping with workers still serving: staying registered with the Scheduler")
        finally:
            if self._http is not None:
                self._http.close()

    # --- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        # Advertise the data plane only once a worker is up: the Scheduler would otherwise
        # send requests to a port nobody listens on yet.
        while not self._serving():
            self.status.waiting_for_workers = True
            await asyncio.sleep(WORKER_POLL_S)
        self.status.waiting_for_workers = False
        while True:
            what = "heartbeat" if self.status.registered else "registration"
            try:
                await (self._heartbeat() if self.status.registered else self._register())
            except CallFailed as exc:
                self._failed(what, str(exc))
                await asyncio.sleep(self._backoff_s())
                continue
            except Exception as exc:  # a bug must not end registration for the sidecar's lifetime
                if not self.status.consecutive_failures:  # one traceback per streak, not per try
                    log.exception("Scheduler %s step failed", what)
                self._failed(what, f"internal error: {exc!r}")
                await asyncio.sleep(self._backoff_s())
                continue
            if self.status.registered:  # a 404 heartbeat left it False: register at once
                await asyncio.sleep(self._interval_s)

    async def _register(self) -> None:
        links = self._kdn_links()
        body = RegisterBody(
            proxy_id=self._proxy_id, host=self.identity.host, port=self.identity.port,
            endpoints=list(ENDPOINTS), tags=[], weight=1.0,
            meta=ProxyMeta(PROXY_VERSION, kdn_links=links or None),
            max_capacity=self._settings.max_capacity, instance_count=self._instance_count(),
            kv_mem_per_instance_gb=self._settings.kv_mem_per_instance_gb,
            kv_cache_update_policy=self._settings.kv_cache_update_policy,
            pool_resource=self._snapshot(self._proxy_id))
        status, payload = await self._post("/v1/proxy/register", body)
        if status != 200:
            raise CallFailed(f"register answered HTTP {status}: {_excerpt(payload)}")
        try:
            reply = msgspec.json.decode(payload, type=RegisterReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CallFailed(f"register reply not understood: {exc}") from None
        self._links_sent = links
        self._registered(reply)

    def _registered(self, reply: RegisterReply) -> None:
        st = self.status
        if reply.proxy_id and reply.proxy_id != self._proxy_id:
            log.info("the Scheduler calls this proxy %s (asked for %s)", reply.proxy_id, self._proxy_id)
            self._proxy_id = st.proxy_id = reply.proxy_id
        self._interval_s = max(MIN_INTERVAL_S, reply.heartbeat_interval_s or self._settings.scheduler_heartbeat_s)
        st.heartbeat_interval_s, st.scheduler_ttl_s = self._interval_s, reply.ttl_s
        st.re_registrations += 1 if st.registrations else 0
        st.registrations += 1
        st.registered = True
        self._succeeded("registration")
        log.info("%s with the Scheduler as %s (heartbeat every %.3gs)",
                 "registered again" if st.re_registrations else "registered", self._proxy_id,
                 self._interval_s)

    async def _heartbeat(self) -> None:
        links = self._kdn_links()
        changed = links != self._links_sent  # to {} too: the Scheduler must forget gone links
        body = HeartbeatBody(proxy_id=self._proxy_id, pool_resource=self._snapshot(self._proxy_id),
                             meta_patch=MetaPatch(links) if changed else None)
        status, payload = await self._post("/v1/proxy/heartbeat", body)
        if status == 404:  # the Scheduler forgot us (restarted, or expired us): register again
            log.warning("the Scheduler does not know %s (heartbeat 404): registering again", self._proxy_id)
            self.status.registered = False
            return
        if status != 200:
            raise CallFailed(f"heartbeat answered HTTP {status}: {_excerpt(payload)}")
        self._links_sent = links
        self.status.heartbeats_ok += 1
        self._succeeded("heartbeat")

    async def _unregister(self) -> None:
        try:
            status, payload = await asyncio.wait_for(
                self._post("/v1/proxy/unregister", UnregisterBody(self._proxy_id)), UNREGISTER_TIMEOUT_S)
        except (CallFailed, asyncio.TimeoutError) as exc:
            log.warning("Scheduler unregister failed: %s (it will expire us after its TTL)",
                        str(exc) or "timed out")
            return
        self.status.registered = False
        self.status.unregistered = status == 200
        log.info("unregistered %s from the Scheduler (HTTP %d)", self._proxy_id, status)

    # --- HTTP ----------------------------------------------------------------------------------------
    async def _post(self, path: str, body: msgspec.Struct) -> tuple[int, bytes]:
        assert self._http is not None
        try:
            return await self._http.post(path, msgspec.json.encode(body))
        except TimeoutError:
            raise CallFailed(f"no answer within {self._settings.scheduler_timeout_s:g}s") from None
        except ConnectFailed as exc:
            raise CallFailed(f"cannot connect: {_describe(exc)}") from None
        except (OSError, ReplyTooLarge) as exc:
            raise CallFailed(_describe(exc)) from None
        finally:
            self.status.resent_after_idle_close = self._http.resent

    # --- bookkeeping -----------------------------------------------------------------------------------
    def _succeeded(self, what: str) -> None:
        self.status.consecutive_failures = 0
        self.status.last_success_at = time.time()
        self.status.last_error = None
        self._failures.recovered(what)

    def _failed(self, what: str, error: str) -> None:
        st = self.status
        # Whatever failed, the next call that gets through registers (an upsert): the Scheduler
        # may have restarted while we could not reach it.
        st.registered = False
        st.consecutive_failures += 1
        st.failures_total += 1
        st.last_error = f"{what}: {error}"
        self._failures.failed(what, error)

    def _backoff_s(self) -> float:
        cap = self._settings.scheduler_backoff_max_s
        exponent = min(self.status.consecutive_failures, 30)
        delay = min(cap, BACKOFF_BASE_S * 2 ** max(0, exponent - 1))
        return min(cap, delay * random.uniform(0.8, 1.2))  # jitter: proxies do not retry in step


class DisabledLink:
    """SCHEDULER_CP_URL unset: said once at start, and in /debug/status."""

    def __init__(self) -> None:
        self.status = LinkStatus(enabled=False)
        log.info("Scheduler registration is off (SCHEDULER_CP_URL is not set)")

    def start(self) -> None:
        pass

    async def stop(self, unregister: bool = True) -> None:
        pass


def make_link(settings: Settings, snapshot: Callable[[str], PoolResource],
              instance_count: Callable[[], int], serving: Callable[[], bool],
              kdn_links: Callable[[], dict[str, Any]] | None = None) -> SchedulerLink | DisabledLink:
    if settings.scheduler_cp_url is None:
        return DisabledLink()
    return SchedulerLink(settings, snapshot, instance_count, serving, kdn_links)


def _safe_url(url: str) -> str:
    """scheme://host:port only: a URL with credentials must not reach logs or /debug/status."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "") + parts.path


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _excerpt(payload: bytes) -> str:
    text = payload[:200].decode("utf-8", "replace")
    return text + ("..." if len(payload) > 200 else "")
