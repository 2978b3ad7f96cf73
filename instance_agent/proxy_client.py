"""The agent's calls to the proxy's control plane (docs/protocol.md, "Instance control plane"), in
its wire types.

Every call has a timeout and a bearer token when one is configured. A call that could not be
made raises `Unreachable`; an answer the agent cannot use raises `Refused` (both are retried
by the agent with a capped backoff). Outcomes the protocol defines are values: a heartbeat
answers `Accepted`, `Forgotten` (register again) or `CapabilitiesWanted` (resend them).
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import aiohttp
import msgspec

from cacheroute_proxy.instance_wire import (
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    UnregisterRequest,
)

CALL_TIMEOUT_S = 2.0
UNREGISTER_TIMEOUT_S = 2.0

_encoder = msgspec.json.Encoder()
_CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class Unreachable(Exception):
    """No answer from the control plane (down, refused, timed out)."""


class Refused(Exception):
    """The control plane answered, but not with something the agent can use."""


class Heartbeat(enum.Enum):
    ACCEPTED = "accepted"
    FORGOTTEN = "forgotten"                    # unknown instance: register again
    CAPABILITIES_WANTED = "capabilities_wanted"  # the proxy lost them (it restarted): resend


class ProxyClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"

    async def register(self, request: RegisterRequest) -> RegisterReply:
        status, raw = await self._post("/v1/instance/register", request)
        if status != 200:
            raise Refused(f"register answered HTTP {status}: {raw[:300]!r}")
        try:
            return msgspec.json.decode(raw, type=RegisterReply)
        except msgspec.DecodeError as exc:
            raise Refused(f"register answered something else: {exc}") from None

    async def heartbeat(self, request: HeartbeatRequest) -> Heartbeat:
        status, raw = await self._post("/v1/instance/heartbeat", request)
        if status == 404:
            return Heartbeat.FORGOTTEN
        reply = _object(status, raw, "heartbeat")
        if reply.get("ok") is True:
            return Heartbeat.ACCEPTED
        return Heartbeat.CAPABILITIES_WANTED if reply.get("requires_capabilities") else Heartbeat.FORGOTTEN

    async def unregister(self, instance_id: str) -> bool:
        status, raw = await self._post("/v1/instance/unregister", UnregisterRequest(instance_id),
                                       timeout_s=UNREGISTER_TIMEOUT_S)
        return _object(status, raw, "unregister").get("ok") is True

    async def report(self, path: str, body: Any) -> bool:
        """A resource snapshot or a topology report; False if the proxy does not know us."""
        status, raw = await self._post(path, body)
        if status == 404:  # an older proxy without the route, or an unknown instance
            return False
        return _object(status, raw, path).get("ok") is True

    async def _post(self, path: str, body: Any, timeout_s: float = CALL_TIMEOUT_S) -> tuple[int, bytes]:
        try:
            async with self._session.post(self.base_url + path, data=_encoder.encode(body),
                                          headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except _CONNECTION_ERRORS as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None


def _object(status: int, raw: bytes, what: str) -> dict[str, Any]:
    if status != 200:
        raise Refused(f"{what} answered HTTP {status}: {raw[:300]!r}")
    try:
        reply = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        reply = None
    if not isinstance(reply, dict):
        raise Refused(f"{what} answered something else: {raw[:300]!r}")
    return reply

