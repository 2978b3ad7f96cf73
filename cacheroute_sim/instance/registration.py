"""Registration with the Proxy control plane, as a real Instance does.

Fixes over the original Instance: a heartbeat answered ``{"ok": false}``
(Proxy restarted, instance purged) re-registers at once instead of being ignored; an
unreachable control plane is retried with a capped backoff forever, in the background, and
logged once per state change rather than per attempt.

With ``--resource-interval``: a resource snapshot (resources.py) right after each
register and then on that interval, in the product's wire types, as the instance agent sends
them; a failed one is logged once until one goes through again (a forgotten instance is the
heartbeats' to notice: they register again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from cacheroute_proxy.instance_wire import (
    KV_INJECT_FEATURE,
    ResourceSnapshotV1,
    resource_snapshot_request,
    stamped_metadata,
)
from cacheroute_sim.instance.config import SimConfig

log = logging.getLogger(__name__)

HEARTBEAT_FALLBACK_S = 10.0
CALL_TIMEOUT_S = 2.0
UNREGISTER_TIMEOUT_S = 1.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0
ENDPOINTS = ["chat/completions", "completions"]

_CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ControlPlaneError(Exception):
    """The control plane answered, but not with something we can use (HTTP error, not JSON)."""


def capabilities(config: SimConfig, cp_port: int | None) -> dict[str, Any]:
    """The runtime lists the KV pull only with a control plane (`cp_port`) to take it: an
    instance running without one (`--cp-port 0`, or its default port was taken) says so, and
    the Proxy sends its knowledge as text instead of sending pulls to whatever holds that port."""
    return {"schema_version": "1", "model": {"identifier": config.model, "revision": None},
            "runtime": {"supported_cache_features": [KV_INJECT_FEATURE] if cp_port else []}}


def register_meta(max_num_seqs: int | None, cp_port: int | None = None,
                  kv_mem_gb: float | None = None,
                  kv_capacity_tokens: int | None = None) -> dict[str, Any]:
    """max_num_seqs: vLLM's name for how many sequences run at once; the Proxy's sidecar models
    that many slots for this instance (when below READY_CONCURRENCY). cp_port: where the Proxy
    reaches POST /v1/kv/inject_ready (the original hard-coded 9002). kv_mem_gb: the KV memory
    it keeps knowledge in (residency.py), for a model of its evictions; kv_capacity_tokens: the
    tokens of it, when given at start (--kv-capacity-tokens), so the model need not convert.
    Each is left out when None."""
    meta: dict[str, Any] = {"version": "instance_v1", "simulated": True}
    if max_num_seqs is not None:
        meta["max_num_seqs"] = max_num_seqs
    if cp_port:
        meta["cp_port"] = cp_port
    if kv_mem_gb is not None:
        meta["kv_mem_gb"] = kv_mem_gb
    if kv_capacity_tokens is not None:
        meta["kv_capacity_tokens"] = kv_capacity_tokens
    return meta


def register_body(config: SimConfig, cp_port: int | None = None) -> dict[str, Any]:
    meta = register_meta(config.max_concurrency, cp_port, config.kv_mem_gb,
                         config.knobs.kv_capacity_tokens)
    return {
        "instance_id": config.resolved_instance_id,
        "host": config.host,
        "port": config.port,
        "endpoints": ENDPOINTS,
        "tags": [],
        "weight": 1.0,
        "meta": meta,
        "capabilities": capabilities(config, cp_port),
    }


def heartbeat_body(instance_id: str, fingerprint: str | None,
                   caps: dict[str, Any] | None = None,
                   resident_keys: list[str] | None = None) -> dict[str, Any]:
    # Like the original Instance: no inflight/qps/gpu_util, the Proxy owns those numbers.
    body: dict[str, Any] = {"instance_id": instance_id, "capability_fingerprint": fingerprint}
    if caps is not None:
        body["capabilities"] = caps
    if resident_keys is not None:  # --report-resident: the knowledge ids held, least recent first
        body["resident_keys"] = resident_keys
    return body


class Backoff:
    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.first_s


class Registrar:
    """Runs register + heartbeat in a background task (and, given ``resources``, resource
    snapshots in another); ``close()`` unregisters."""

    def __init__(self, config: SimConfig, cp_port: int | None = None,
                 resident_keys: Callable[[], list[str]] | None = None,
                 resources: Callable[[str], ResourceSnapshotV1] | None = None) -> None:
        self.config = config
        self.cp_port = cp_port
        self._resident_keys = resident_keys  # with --report-resident: what heartbeats carry
        self._resources = resources  # with --resource-interval: the snapshot of the moment
        self._snapshots_failing = False
        self.instance_id = config.resolved_instance_id
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._registered = False
        self._register_sent = False
        self._fingerprint: str | None = None
        self._interval_s = HEARTBEAT_FALLBACK_S
        self._state = "starting"

    def start(self) -> None:
        headers = {"content-type": "application/json"}
        if self.config.register_token:
            headers["authorization"] = f"Bearer {self.config.register_token}"
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        self._tasks = [asyncio.create_task(self._loop(), name="sim-registration")]
        if self._resources is not None:
            self._tasks.append(asyncio.create_task(self._snapshots(), name="sim-resource-snapshots"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is None:
            return
        # Also after a register whose reply we never saw: it may have been applied.
        if self._register_sent:
            await self._unregister()
        await self._session.close()

    async def _loop(self) -> None:
        backoff = Backoff()
        while True:
            try:
                if not self._registered:
                    await self._register()
                elif not await self._heartbeat():
                    self._registered = False
                    self._set_state("forgotten", "control plane forgot us; re-registering")
                    continue  # at once, not after another interval
                delay = self._interval_s
                backoff.reset()
            except _CONNECTION_ERRORS as exc:
                self._set_state("unreachable",
                                f"control plane unreachable ({_describe(exc)}); retrying")
                delay = backoff.next()
            except ControlPlaneError as exc:
                self._set_state("rejected", f"control plane error: {exc}; retrying")
                delay = backoff.next()
            await asyncio.sleep(delay)

    async def _register(self) -> None:
        self._register_sent = True
        body = register_body(self.config, self.cp_port)
        status, reply = await self._post("/v1/instance/register", body)
        if not 200 <= status < 300 or not isinstance(reply, dict):
            raise ControlPlaneError(f"register answered HTTP {status}: {reply!r}")
        fingerprint = reply.get("capability_fingerprint")
        self._fingerprint = fingerprint if isinstance(fingerprint, str) else None
        self._interval_s = self._pick_interval(reply.get("heartbeat_interval_s"))
        self._registered = True
        self._set_state("registered", f"registered as {self.instance_id} at "
                        f"{self.config.cp_base_url}, heartbeat every {self._interval_s:g} s")
        await self._send_snapshot()  # the proxy knows the machine from the start, not an interval later

    def _pick_interval(self, offered: Any) -> float:
        if self.config.heartbeat_interval_s is not None:
            return self.config.heartbeat_interval_s
        if isinstance(offered, (int, float)) and not isinstance(offered, bool) and offered > 0:
            return float(offered)
        return HEARTBEAT_FALLBACK_S

    async def _heartbeat(self) -> bool:
        """True while the control plane still knows us; False means re-register."""
        reply = await self._heartbeat_call(None)
        if reply.get("ok") is True:
            self._set_state("registered", "heartbeats accepted again")
            return True
        if reply.get("requires_capabilities"):
            log.info("control plane asked for capabilities (%s); resending", reply.get("error"))
            reply = await self._heartbeat_call(capabilities(self.config, self.cp_port))
            return reply.get("ok") is True
        return False

    async def _heartbeat_call(self, caps: dict[str, Any] | None) -> dict[str, Any]:
        body = heartbeat_body(self.instance_id, self._fingerprint, caps,
                              self._resident_keys() if self._resident_keys is not None else None)
        status, reply = await self._post("/v1/instance/heartbeat", body)
        if status == 404:
            return {"ok": False}  # an unknown-instance 404 means the same as {"ok": false}
        if not 200 <= status < 300 or not isinstance(reply, dict):
            raise ControlPlaneError(f"heartbeat answered HTTP {status}: {reply!r}")
        return reply

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(self.config.resource_interval_s)
            await self._send_snapshot()

    async def _send_snapshot(self) -> None:
        if self._resources is None or not self._registered:
            return
        snapshot = self._resources(self.instance_id)
        body = resource_snapshot_request(self.instance_id, snapshot, stamped_metadata(self.instance_id, snapshot))
        try:
            status, reply = await self._post("/v1/instance/resource_snapshot", body)
            problem = None if status == 200 and isinstance(reply, dict) and reply.get("ok") is True \
                else f"HTTP {status}: {reply!r}"
        except _CONNECTION_ERRORS as exc:
            problem = _describe(exc)
        if (problem is not None) != self._snapshots_failing:  # once per change, as the states
            self._snapshots_failing = problem is not None
            if problem is None:
                log.info("resource snapshots accepted again")
            else:
                log.warning("resource snapshot not accepted (%s); trying again in %g s",
                            problem, self.config.resource_interval_s)

    async def _unregister(self) -> None:
        try:
            await self._post("/v1/instance/unregister", {"instance_id": self.instance_id},
                             timeout=UNREGISTER_TIMEOUT_S)
            log.info("unregistered %s", self.instance_id)
        except (*_CONNECTION_ERRORS, ControlPlaneError) as exc:
            log.warning("unregister failed (best effort): %s", _describe(exc))

    async def _post(self, path: str, body: object, timeout: float | None = None) -> tuple[int, Any]:
        assert self._session is not None
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        async with self._session.post(self.config.cp_base_url + path,
                                      data=msgspec.json.encode(body), **kwargs) as resp:
            raw = await resp.read()
        try:
            return resp.status, msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            return resp.status, raw[:200].decode(errors="replace")

    def _set_state(self, state: str, message: str) -> None:
        # Once per change: a control plane down for an hour must not log every retry.
        if state == self._state:
            return
        self._state = state
        log.log(logging.INFO if state == "registered" else logging.WARNING, "%s", message)


def _describe(exc: BaseException) -> str:
    # str() of a TimeoutError is empty; repr() of aiohttp errors is a screenful.
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
