"""The Instance -> KDN (Knowledge Delivery Network, the knowledge server) call of a KV inject,
without any Redis.

The Instance adds its Redis target to the Proxy's request and posts it to the KDN's
``/knowledge/inject_ready_kv``. The KDN's answer is relayed verbatim (status and bytes) when it
is a JSON object with a 2xx or 4xx status; anything else (unreachable, timeout, 5xx, a body
that is not a JSON object) is a KDN failure, reported as :class:`KdnFailure`.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from cacheroute_sim.instance.config import SimConfig

INJECT_PATH = "/knowledge/inject_ready_kv"


class KdnFailure(Exception):
    """The KDN call did not produce a usable answer; the message is the reason."""


class KdnReply(msgspec.Struct, frozen=True):
    status: int
    body: bytes  # a JSON object, exactly as the KDN sent it


def kdn_base_url(kdn_addr: str) -> str:
    """``host:port`` (the Proxy's form) or a full http(s) URL, as the original accepts."""
    addr = kdn_addr.strip().rstrip("/")
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


def failure_ack(detail: str) -> dict[str, Any]:
    return {"ok": False, "injected_kids": [], "text_only_kids": [], "miss_kids": [],
            "keys_injected": 0, "payload_bytes": 0, "payload_files": 0,
            "network_sim_enabled": False, "detail": detail}


class KdnClient:
    """One pooled aiohttp session, created on first use inside the running loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    def inject_body(self, request_id: int, model: str, knowledge_ids: list[str]
                    ) -> dict[str, Any]:
        c = self.config
        return {"request_id": request_id, "model": model, "knowledge_ids": knowledge_ids,
                "redis_host": c.redis_host, "redis_port": c.redis_port, "redis_db": c.redis_db,
                "redis_password": c.redis_password}

    async def inject_ready_kv(self, kdn_addr: str, body: dict[str, Any]) -> KdnReply:
        url = kdn_base_url(kdn_addr) + INJECT_PATH
        try:
            async with self._get_session().post(url, data=msgspec.json.encode(body)) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise KdnFailure(f"kdn timeout after {self.config.kdn_timeout_s:g} s "
                             f"({url})") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise KdnFailure(f"kdn unreachable ({url}): {_describe(exc)}") from None
        try:
            decoded = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            decoded = None
        if not 200 <= status < 500 or not isinstance(decoded, dict):
            snippet = raw[:200].decode(errors="replace")
            raise KdnFailure(f"kdn answered HTTP {status}: {snippet}")
        return KdnReply(status, raw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.config.kdn_timeout_s))
        return self._session


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
