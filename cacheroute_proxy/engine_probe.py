"""What an inference engine (vLLM's OpenAI server, or anything that answers like it) says about
itself: `GET /health`, `GET /v1/models`, `GET /version`, the KV capacity vLLM states in
`GET /metrics` (`vllm:cache_config_info`), and where it publishes its KV cache events
(`GET /kv_event_sources`).

Used by the sidecar for static instances and by an agent beside an engine. Every call has a
timeout and never raises for what the engine does: a dead, slow or odd engine gives a
not-ok health result or unknown (None) fields, never an exception.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

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
    kv_capacity_tokens: int | None = None  # vLLM's KV cache, in tokens (its prefix cache's room)
    kv_events_endpoint: str | None = None  # where to subscribe to its KV cache events

    def capabilities(self, cache_features: list[str] | None = None) -> Capabilities | None:
        """The registration's capabilities, or None if the engine said
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
        """Registration meta: every model id the engine serves (the proxy's `/v1/models` lists
        them), the context length, and the KV capacity that bounds the affinity index's model of
        what the engine's prefix cache still holds."""
        meta: dict[str, Any] = {}
        if self.models:  # sent whole each time: meta is merged, a stale list would stay
            meta["served_models"] = list(self.models)
        if self.max_model_len is not None:
            meta["max_model_len"] = self.max_model_len
        if self.kv_capacity_tokens is not None:
            meta["kv_capacity_tokens"] = self.kv_capacity_tokens
        if self.kv_events_endpoint is not None:
            meta["kv_events_endpoint"] = self.kv_events_endpoint
        return meta


class _Model(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[_Model] = []


class _Version(msgspec.Struct):
    version: str | None = None


class _KvEventsConfig(msgspec.Struct):
    """One data-parallel rank's publisher, as vLLM 0.32 states it (its defaults)."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"


def kv_events_endpoint(sources: dict[str, _KvEventsConfig] | None, base_url: str) -> str | None:
    """Where a subscriber reaches the engine's KV cache events: its first rank's ZMQ publisher,
    when that binds (`tcp://*:port`, reached on the engine's own host, or `ipc://path`); None
    when it publishes none, or connects out to a subscriber of its own (any other address)."""
    if not sources:
        return None
    source = sources[min(sources)]
    if not source.enable_kv_cache_events or source.publisher not in (None, "zmq"):
        return None
    if source.endpoint.startswith("ipc://"):
        return source.endpoint
    host = urlsplit(base_url).hostname or ""
    if not source.endpoint.startswith("tcp://*:") or not host:
        return None
    return f"tcp://{f'[{host}]' if ':' in host else host}:{source.endpoint[len('tcp://*:'):]}"


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
    """The served model (the first of `/v1/models`), its context length, the engine version, its
    KV capacity and its KV event publisher; each None when its route does not answer in time or
    answers something else."""
    models, version, metrics, sources = await asyncio.gather(
        _get_json(session, f"{base_url}/v1/models", _ModelList, timeout_s),
        _get_json(session, f"{base_url}/version", _Version, timeout_s),
        _get_text(session, f"{base_url}/metrics", timeout_s),
        _get_json(session, f"{base_url}/kv_event_sources", dict[str, _KvEventsConfig], timeout_s))
    served = models.data if models is not None else []
    first = served[0] if served else None
    return EngineInfo(model_id=first.id if first else None,
                      max_model_len=first.max_model_len if first else None,
                      version=version.version if version is not None else None,
                      models=tuple(model.id for model in served),
                      kv_capacity_tokens=kv_capacity_from_metrics(metrics or ""),
                      kv_events_endpoint=kv_events_endpoint(sources, base_url))


CACHE_CONFIG_INFO = "vllm:cache_config_info{"


def kv_capacity_from_metrics(text: str) -> int | None:
    """The KV capacity in tokens that vLLM's `vllm:cache_config_info` labels state:
    `kv_cache_size_tokens` where this version has it, else `num_gpu_blocks` x `block_size`;
    None without the series or with no usable number (a GPU engine reports it only once its
    blocks are allocated, which is before /health answers)."""
    for line in text.splitlines():
        if line.startswith(CACHE_CONFIG_INFO):
            labels = _labels(line[len(CACHE_CONFIG_INFO):line.rfind("}")])
            size = _positive_int(labels.get("kv_cache_size_tokens"))
            if size is not None:
                return size
            blocks, block = _positive_int(labels.get("num_gpu_blocks")), _positive_int(labels.get("block_size"))
            return blocks * block if blocks is not None and block is not None else None
    return None


def _labels(body: str) -> dict[str, str]:
    """`a="1",b="x"` -> {"a": "1", "b": "x"}; vLLM's config values hold no quote."""
    labels: dict[str, str] = {}
    for item in body.split('",'):
        name, sep, value = item.partition('="')
        if sep:
            labels[name.strip()] = value.rstrip('"')
    return labels


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if number > 0 else None


async def _get_text(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as response:
            return (await response.text(errors="replace")) if response.status == 200 else None
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        return None


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
