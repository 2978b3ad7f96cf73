"""What the engine says of itself, over its own OpenAI-compatible HTTP API.

vLLM answers `GET /health` (200 once it serves), `GET /v1/models` (the served model id and its
`max_model_len`) and `GET /version`; other OpenAI-compatible servers answer some of these.
Everything here has a timeout and tolerates a missing route: what is not known stays None.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

PROBE_TIMEOUT_S = 1.0     # /health: an engine that takes longer is not answering
DESCRIBE_TIMEOUT_S = 5.0  # /v1/models, /version


class EngineInfo(msgspec.Struct, frozen=True):
    model_id: str | None = None
    max_model_len: int | None = None
    version: str | None = None


class _Model(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class _Models(msgspec.Struct):
    data: list[_Model] = []


class _Version(msgspec.Struct):
    version: str | None = None


class Engine:
    """The engine at `base_url`, asked through one pooled session."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session

    async def healthy(self) -> bool:
        """True if `GET /health` answers 2xx within PROBE_TIMEOUT_S."""
        try:
            async with self._session.get(f"{self.base_url}/health",
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def describe(self) -> EngineInfo:
        models = await self._get("/v1/models", _Models)
        version = await self._get("/version", _Version)
        model = models.data[0] if models is not None and models.data else None
        return EngineInfo(model_id=model.id if model else None,
                          max_model_len=model.max_model_len if model else None,
                          version=version.version if version is not None else None)

    async def _get(self, path: str, schema: type[Any]) -> Any:
        try:
            async with self._session.get(f"{self.base_url}{path}",
                                         timeout=aiohttp.ClientTimeout(total=DESCRIBE_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return None
                return msgspec.json.decode(await resp.read(), type=schema)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.DecodeError):
            return None
