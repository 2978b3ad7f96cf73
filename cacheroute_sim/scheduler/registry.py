"""The proxies the simulated Scheduler knows, with TTL expiry and what each last reported."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cacheroute_sim.scheduler.wire import HeartbeatRequest, RegisterRequest

log = logging.getLogger(__name__)


@dataclass
class ProxyRecord:
    proxy_id: str
    registration: dict[str, Any]   # the last register body, as sent (minus pool_resource)
    registered_at: float
    last_seen_at: float
    registrations: int = 1
    heartbeats: int = 0
    meta_patches: int = 0  # heartbeats that carried a meta_patch
    meta: dict[str, Any] = field(default_factory=dict)
    last_pool_resource: dict[str, Any] | None = None

    def row(self, now: float, ttl_s: float) -> dict[str, Any]:
        return {"proxy_id": self.proxy_id, "host": self.registration["host"],
                "port": self.registration["port"], "endpoints": self.registration["endpoints"],
                "tags": self.registration["tags"], "weight": self.registration["weight"],
                "meta": self.meta, "registration": self.registration,
                "registered_at": self.registered_at, "last_seen_at": self.last_seen_at,
                "is_alive": now - self.last_seen_at <= ttl_s, "registrations": self.registrations,
                "heartbeats": self.heartbeats, "meta_patches": self.meta_patches,
                "last_pool_resource": self.last_pool_resource}


class ProxyRegistry:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._proxies: dict[str, ProxyRecord] = {}
        self.expired = 0

    def register(self, req: RegisterRequest) -> ProxyRecord:
        """Upsert; a known id keeps its counters (the original replaces the fields)."""
        now = self._clock()
        proxy_id = req.proxy_id or f"pxy_{uuid.uuid4().hex[:12]}"
        registration = msgspec.to_builtins(req)
        pool = registration.pop("pool_resource", None)
        record = self._proxies.get(proxy_id)
        if record is None:
            record = ProxyRecord(proxy_id, registration, now, now)
            self._proxies[proxy_id] = record
            log.info("proxy %s registered at %s:%d", proxy_id, req.host, req.port)
        else:
            record.registration, record.last_seen_at = registration, now
            record.registrations += 1
            log.info("proxy %s registered again (%d times)", proxy_id, record.registrations)
        record.meta = dict(req.meta)
        record.last_pool_resource = pool or record.last_pool_resource
        return record

    def heartbeat(self, req: HeartbeatRequest) -> bool:
        record = self._proxies.get(req.proxy_id)
        if record is None:
            return False
        record.last_seen_at = self._clock()
        record.heartbeats += 1
        if req.meta_patch:
            record.meta_patches += 1
            record.meta.update(req.meta_patch)
        if req.pool_resource is not None:
            record.last_pool_resource = msgspec.to_builtins(req.pool_resource)
        return True

    def unregister(self, proxy_id: str) -> bool:
        existed = self._proxies.pop(proxy_id, None) is not None
        if existed:
            log.info("proxy %s unregistered", proxy_id)
        return existed

    def forget_all(self) -> int:
        """A Scheduler restart: every proxy is unknown from now on."""
        forgotten = len(self._proxies)
        self._proxies.clear()
        return forgotten

    def expire(self, ttl_s: float) -> None:
        """Proxies silent for longer than the TTL are dropped: their next heartbeat gets 404."""
        now = self._clock()
        for record in list(self._proxies.values()):
            if now - record.last_seen_at > ttl_s:
                del self._proxies[record.proxy_id]
                self.expired += 1
                log.warning("proxy %s expired (silent for %.1fs, ttl %.1fs)",
                            record.proxy_id, now - record.last_seen_at, ttl_s)

    def rows(self, ttl_s: float) -> list[dict[str, Any]]:
        now = self._clock()
        return [r.row(now, ttl_s) for r in self._proxies.values()]
