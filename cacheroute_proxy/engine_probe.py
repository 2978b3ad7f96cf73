"""What an inference engine (vLLM's OpenAI server, or anything that answers like it) says about
itself: `GET /health`, `GET /v1/models`, `GET /version`.

Used by the sidecar for static instances and by an agent beside an engine. Every call has a
timeout and never raises for what the engine does: a dead, slow or odd engine gives a
not-ok health result or unknown (None) fields, never an exception.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from .instance_wire import Capabilities, ModelCapability, RuntimeCapability


class Health(msgspec.Struct, frozen=True):
    ok: bool
    status: int | None = None  # the HTTP status, None when nothing answered
    detail: str = ""           # why not ok, for the log


class EngineInfo(msgspec.Struct, frozen=True):
    """Unknown fields are None; `models` lists every model id the engine serves."""

    model_id: str | None = None
    max_model_len: int | None = None
    version: str | None = None
    models: tuple[str, ...] = ()

    def capabilities(self, cache_features: list[str] | None = None) -> Capabilities | None:
        """The registration's capabilities (docs/protocol.md §3.4), or None if the engine said
        nothing. `cache_features` is what the caller knows the instance can do besides serving
        (the engine cannot say): `[]` for a plain engine, whose knowledge then goes in as text."""
        if self.model_id is None and self.version is None:
            return None
        runtime = None if self.version is None and cache_features is None else \
            RuntimeCapability(vllm_version=self.version, supported_cache_features=cache_features)
        return Capabilities(
            model=None if self.model_id is None else ModelCapability(identifier=self.model_id),
            runtime=runtime)

    def meta(self) -> dict[str, Any]:
        return {} if self.max_model_len is None else {"max_model_len": self.max_model_len}


class _Model(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[_Model] = []


class _Version(msgspec.Struct):
    version: str | None = None


async def probe_health(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> Health:
    """`GET {base_url}/health`: ok on any 2xx within the timeout (vLLM answers 200 with an empty
    body once it serves, an error status or nothing while it loads or after it died)."""
    try:
        async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as response:
            await response.read()
            ok = 200 <= response.status < 300
            return Health(ok=ok, status=response.status, detail="" if ok else f"HTTP {response.status}")
    except asyncio.TimeoutError:
        return Health(ok=False, detail=f"no answer within {timeout_s:g}s")
    except (aiohttp.ClientError, OSError) as exc:
        return Health(ok=False, detail=_describe(exc))


async def read_engine(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> EngineInfo:
    """The served model (the first of `/v1/models`), its context length and the engine version;
    each None when its route does not answer in time or answers something else."""
    models, version = await asyncio.gather(
        _get_json(session, f"{base_url}/v1/models", _ModelList, timeout_s),
        _get_json(session, f"{base_url}/version", _Version, timeout_s))
    served = models.data if models is not None else []
    first = served[0] if served else None
    return EngineInfo(model_id=first.id if first else None,
                      max_model_len=first.max_model_len if first else None,
                      version=version.version if version is not None else None,
                      models=tuple(model.id for model in served))


async def _get_json(session: aiohttp.ClientSession, url: str, schema: type[Any], timeout_s: float) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as response:
            if response.status != 200:
                return None
            return msgspec.json.decode(await response.read(), type=schema)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
