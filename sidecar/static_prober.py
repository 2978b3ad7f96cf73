"""Static instances (PROXY_STATIC_INSTANCES): engines without an agent, registered by the sidecar
itself and kept in or out of the candidate set by probing their `GET /health` (as vllm-router's
--worker-urls, or an nginx upstream block).

They are registered at start, out of the candidate set until their first probe succeeds (a
restarted sidecar adopts them from the shared table as they were, so they do not blink).
A probe that succeeds counts as seen (they never heartbeat, so no TTL expiry while healthy);
one that fails takes the instance out at once. When an engine answers after being out (or
for the first time since this sidecar started), its `/v1/models` and `/version` are read
again into the registration: a restarted engine may serve another model.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from cacheroute_proxy import instance_wire as wire
from cacheroute_proxy.engine_probe import EngineInfo, probe_health, read_engine
from cacheroute_proxy.health import HEALTHY
from cacheroute_proxy.static_instances import StaticInstance
from shm_schema import DirectoryFull

from .registry import InstanceRegistry

log = logging.getLogger("cacheroute.sidecar.static")

PROBE_TIMEOUT_CAP_S = 1.0  # a probe gives up after min(this, the probe interval)
ENDPOINTS = ["chat/completions", "completions"]


@dataclass
class ProbeStats:
    probes: int = 0
    failures: int = 0
    last_ok: bool | None = None
    last_detail: str = ""


class StaticProber:
    def __init__(self, registry: InstanceRegistry, targets: tuple[StaticInstance, ...], probe_s: float) -> None:
        self._registry = registry
        self._targets = targets
        self._probe_s = probe_s
        self._timeout_s = min(PROBE_TIMEOUT_CAP_S, probe_s)
        self._described: set[str] = set()  # engines read since they last came (back) in
        self._stats = {t.instance_id: ProbeStats() for t in targets}

    @property
    def targets(self) -> tuple[StaticInstance, ...]:
        return self._targets

    def adopt(self) -> None:
        """At start: each target is registered (out of the candidate set until probed), or, if
        a previous sidecar left it in the shared table, marked static as it is."""
        for target in self._targets:
            record = self._registry.get(target.instance_id)
            if record is not None:
                record.static = True
            else:
                self._register(target, EngineInfo(), healthy=False)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                results = await asyncio.gather(*(self._probe(session, t) for t in self._targets),
                                               return_exceptions=True)
                for target, result in zip(self._targets, results):
                    if isinstance(result, Exception):  # a bug must not end the probing
                        log.error("probing %s failed", target.instance_id, exc_info=result)
                await asyncio.sleep(self._probe_s)

    async def _probe(self, session: aiohttp.ClientSession, target: StaticInstance) -> None:
        health = await probe_health(session, target.url, self._timeout_s)
        stats = self._stats[target.instance_id]
        stats.probes += 1
        stats.failures += 0 if health.ok else 1
        stats.last_ok, stats.last_detail = health.ok, health.detail
        record = self._registry.get(target.instance_id)
        if not health.ok:
            self._described.discard(target.instance_id)
            if record is None:  # unregistered by hand, or never fitted: registered when it answers
                return
            self._registry.probe_result(target.instance_id, False, f"{target.url}/health: {health.detail}")
            return
        if record is None or record.health != HEALTHY or target.instance_id not in self._described:
            info = await read_engine(session, target.url, self._timeout_s)
            if self._register(target, info, healthy=True) and info.model_id is not None:
                self._described.add(target.instance_id)
            return
        self._registry.probe_result(target.instance_id, True)

    def _register(self, target: StaticInstance, info: EngineInfo, healthy: bool) -> bool:
        # An engine that answered /health but not (yet) /v1/models keeps what was read before:
        # registering without capabilities would clear them.
        known = self._registry.get(target.instance_id)
        # A plain engine serves no KV inject (nothing runs beside it to pull from a KDN): no cache
        # features, so its knowledge goes in as text instead of waiting for an inject.
        capabilities = info.capabilities(cache_features=[]) or (known.capabilities if known else None)
        request = wire.RegisterRequest(host=target.host, port=target.port, instance_id=target.instance_id,
                                       endpoints=ENDPOINTS, meta=info.meta(), capabilities=capabilities)
        try:
            self._registry.register(request, healthy=healthy, static=True)
        except (ValueError, DirectoryFull) as exc:
            log.error("static instance %s (%s) cannot be registered: %s", target.instance_id, target.url, exc)
            return False
        if info.model_id is not None:
            log.info("static instance %s at %s serves %s (max_model_len %s, version %s)",
                     target.instance_id, target.url, info.model_id, info.max_model_len, info.version)
        return True

    def describe(self) -> dict[str, Any]:
        """For `/debug/status`."""
        return {"probe_s": self._probe_s, "timeout_s": self._timeout_s, "instances": [
            {"instance_id": t.instance_id, "url": t.url, "probes": self._stats[t.instance_id].probes,
             "failures": self._stats[t.instance_id].failures, "last_ok": self._stats[t.instance_id].last_ok,
             "last_detail": self._stats[t.instance_id].last_detail} for t in self._targets]}
