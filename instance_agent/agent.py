"""The agent's lifecycle beside one engine.

    wait until the engine answers /health
    -> register it (what it says of itself: model, max_model_len, version; meta.max_num_seqs)
    -> heartbeat at the proxy's interval, with `healthy` as the last probe saw it; every change
       of health is sent at once (the proxy takes an unhealthy engine out of the candidate set
       without forgetting it), and an engine that comes back is described and registered again
       (an upsert: a restarted engine may serve another model)
    -> resource snapshots and topology reports on their own intervals
    -> on stop: unregister, whenever a registration was ever sent (even one cut short by the
       stop, or an upsert still due: the proxy may hold the instance either way). A register
       still on its way is waited for first (at most LEAVE_WAIT_S): the proxy applies one it has
       read whether or not we wait for the answer, and one applied after our unregister would
       leave the instance behind until its TTL.

The proxy may forget the instance (restarted without its segment, purged): a heartbeat answered
"unknown" registers again at once; asked for capabilities (a restarted sidecar adopts the slot
but not the capabilities), the next heartbeat carries them. An unreachable proxy is retried with
a capped backoff, and each state change is logged once, not each attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

import aiohttp

from cacheroute_proxy.engine_probe import EngineInfo, probe_health, read_engine
from cacheroute_proxy.instance_wire import (
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    TopologyReportRequest,
    resource_snapshot_request,
    stamped_metadata,
)

from .config import AgentConfig
from .proxy_client import Heartbeat, ProxyClient, Refused, Unreachable
from .resources import Sampler
from .topology import LinkProbe

log = logging.getLogger("cacheroute.agent")

HEARTBEAT_FALLBACK_S = 10.0
HEALTH_TIMEOUT_S = 1.0    # an engine slower than this to answer /health is not answering
DESCRIBE_TIMEOUT_S = 5.0  # /v1/models, /version
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0
LEAVE_WAIT_S = 3.0  # for a register on its way at the stop: longer than the client's call timeout
ENDPOINTS = ["chat/completions", "completions"]


def register_request(config: AgentConfig, info: EngineInfo) -> RegisterRequest:
    """What the proxy is told about the engine. No KV cache feature: this agent serves no KV
    inject, so the proxy injects knowledge into such an instance as text."""
    meta: dict[str, object] = {"version": "instance_v1", "agent": "cacheroute-instance-agent", **info.meta()}
    if config.max_num_seqs is not None:
        meta["max_num_seqs"] = config.max_num_seqs
    return RegisterRequest(host=config.engine_host, port=config.engine_port,
                           instance_id=config.resolved_instance_id, endpoints=ENDPOINTS,
                           meta=meta, capabilities=info.capabilities(cache_features=[]))


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.instance_id = config.resolved_instance_id
        self.registered = False  # the proxy accepted the registration and has not forgotten it
        self.healthy = False
        self._upsert_due = False  # the engine was described anew: register it again
        # The last register sent, not cut by a stop; once set, the proxy may hold this instance:
        # unregister on the way out.
        self._register_call: asyncio.Future[RegisterReply] | None = None
        self._request: RegisterRequest | None = None
        self._fingerprint: str | None = None
        self._interval_s = config.heartbeat_interval_s or HEARTBEAT_FALLBACK_S
        self._wake = asyncio.Event()  # a heartbeat is due now (health changed, forgotten)
        self._state = ""
        self._sampler = Sampler()
        self._engine_url = config.instance_url.rstrip("/")

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            self._session = session
            self._proxy = ProxyClient(self.config.proxy_cp_url, session, self.config.cp_token)
            self._links = LinkProbe(session, self.config.default_link_mbps)
            if not await self._wait_for_engine(stop):
                return
            loops = [self._heartbeats(), self._watch_health(),
                     self._every(self.config.resource_interval_s, self._report_resources)]
            if self.config.kdn_targets:
                loops.append(self._every(self.config.topology_interval_s, self._report_topology))
            tasks = [asyncio.create_task(loop) for loop in loops]
            try:
                await stop.wait()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._leave()

    # --- the engine ---------------------------------------------------------------------------
    async def _wait_for_engine(self, stop: asyncio.Event) -> bool:
        self._set_state("waiting", f"waiting for the engine at {self.config.instance_url}/health")
        while not stop.is_set():
            if await self._engine_healthy():
                self.healthy = True
                await self._describe()
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.health_interval_s)
        return False

    async def _engine_healthy(self) -> bool:
        return (await probe_health(self._session, self._engine_url, HEALTH_TIMEOUT_S)).ok

    async def _describe(self) -> None:
        info = await read_engine(self._session, self._engine_url, DESCRIBE_TIMEOUT_S)
        self._request = register_request(self.config, info)
        log.info("engine %s: model %s, max_model_len %s, version %s", self.config.instance_url,
                 info.model_id, info.max_model_len, info.version)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            healthy = await self._engine_healthy()
            if healthy == self.healthy:
                continue
            self.healthy = healthy
            if healthy:
                log.info("the engine answers again: describing it and registering it again")
                await self._describe()
                self._upsert_due = True  # with what the engine says now; still registered meanwhile
            else:
                log.warning("the engine stopped answering %s/health: telling the proxy",
                            self.config.instance_url)
            self._wake.set()

    # --- the proxy ----------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            try:
                if not self.registered or self._upsert_due:
                    await self._register()
                else:
                    await self._heartbeat()
                delay, wait = BACKOFF_FIRST_S, self._interval_s
            except (Unreachable, Refused) as exc:
                self._set_state("failing", f"proxy control plane {self.config.proxy_cp_url}: {exc}; retrying")
                wait, delay = delay, min(delay * 2, BACKOFF_MAX_S)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _register(self) -> None:
        request = self._request
        assert request is not None
        self._register_call = asyncio.ensure_future(self._proxy.register(request))
        reply = await asyncio.shield(self._register_call)
        if self._request is request:  # not described anew while this one was on its way
            self._upsert_due = False
        self._fingerprint = reply.capability_fingerprint
        if self.config.heartbeat_interval_s is None and reply.heartbeat_interval_s > 0:
            self._interval_s = float(reply.heartbeat_interval_s)
        self.registered = True
        self._set_state("registered", f"registered {reply.instance_id} with {self.config.proxy_cp_url}, "
                                      f"heartbeat every {self._interval_s:g}s")
        await self._heartbeat()  # the engine's health now, not at the next interval
        await self._report_resources()
        if self.config.kdn_targets:
            await self._report_topology()

    async def _heartbeat(self, with_capabilities: bool = False) -> None:
        assert self._request is not None
        outcome = await self._proxy.heartbeat(HeartbeatRequest(
            instance_id=self.instance_id, capability_fingerprint=self._fingerprint,
            capabilities=self._request.capabilities if with_capabilities else None,
            healthy=self.healthy))
        if outcome is Heartbeat.FORGOTTEN:
            self.registered = False
            self._set_state("forgotten", "the proxy does not know this instance (restarted or purged): "
                                         "registering again")
            self._wake.set()
        elif outcome is Heartbeat.CAPABILITIES_WANTED and not with_capabilities:
            log.info("the proxy asked for the capabilities again: resending them")
            await self._heartbeat(with_capabilities=True)
        else:
            self._set_state("registered" if self.healthy else "unhealthy",
                            "heartbeats accepted" if self.healthy else
                            "heartbeats accepted; the engine is out of the candidate set until it answers")

    async def _report_resources(self) -> None:
        if not self.registered:
            return
        snapshot = self._sampler.snapshot(self.instance_id)
        await self._proxy.report("/v1/instance/resource_snapshot", resource_snapshot_request(
            self.instance_id, snapshot, stamped_metadata(self.instance_id, snapshot)))

    async def _report_topology(self) -> None:
        if not self.registered:
            return
        links = await self._links.links(self.config.kdn_targets, self.instance_id)
        await self._proxy.report("/v1/topology/report", TopologyReportRequest(self.instance_id, links))

    async def _every(self, interval_s: float, report: Callable[[], Awaitable[None]]) -> None:
        """A report on its interval; a failure is logged (by state) and the next one tried."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await report()
            except (Unreachable, Refused) as exc:
                self._set_state("failing", f"proxy control plane {self.config.proxy_cp_url}: {exc}; retrying")

    async def _leave(self) -> None:
        call = self._register_call
        if call is None:
            return
        if not call.done():
            log.info("waiting for the register on its way before unregistering")
        with contextlib.suppress(Exception):  # its outcome does not matter, only that it is over
            await asyncio.wait_for(call, LEAVE_WAIT_S)
        try:
            left = await self._proxy.unregister(self.instance_id)
            log.info("unregistered %s%s", self.instance_id, "" if left else " (the proxy did not know it)")
        except (Unreachable, Refused) as exc:
            log.warning("unregister failed (best effort): %s", exc)

    def _set_state(self, state: str, message: str) -> None:
        if state != self._state:  # once per change: an hour of a down proxy is one line
            self._state = state
            log.log(logging.INFO if state in ("registered", "waiting") else logging.WARNING, "%s", message)
