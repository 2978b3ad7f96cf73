"""Typed configuration of one simulated Instance.

Two parts with different lifetimes:
- :class:`SimConfig` is fixed at start (address, registration, time scale, concurrency);
- :class:`Knobs` are the fault and workload knobs, set by CLI flags at start and replaced at
  run time through ``POST /sim/config`` (held in a :class:`cacheroute_sim.common.knobs.KnobStore`).
A bad value fails at once with a message naming the field, never later on a request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from cacheroute_sim.common.knobs import KnobsBase
from cacheroute_sim.common.validation import ConfigError, require, struct_from_mapping

# ConfigError is re-exported: callers and tests catch cacheroute_sim.instance.config.ConfigError.
__all__ = ["MAX_TOKENS_LIMIT", "ConfigError", "Knobs", "SimConfig",
           "sim_config_from_mapping"]

MAX_TOKENS_LIMIT = 8192
# RFC 9110 token characters for a header name; a value must not hold CR, LF or NUL.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")


class Knobs(KnobsBase, frozen=True):
    # Multiplies every simulated duration: makes one instance slow without touching others.
    slow_factor: float = 1.0
    # Accept requests and never answer until released or the client goes away.
    hang: bool = False
    # Answer immediately with this status (with probability fail_rate) instead of generating.
    fail_status: int | None = None
    fail_rate: float = 1.0
    # Streams: cut the connection after N content chunks. Non-streams: send half the body, cut.
    drop_after_chunks: int | None = None
    # Streams: after N content chunks stop sending, connection open, until released.
    stall_after_chunks: int | None = None
    # Streams: send the first token, then hold until released (keeps a slot busy on demand).
    hold_streams: bool = False
    # Tokens generated when the request gives no max_tokens.
    default_max_tokens: int = 16
    # Added to every answer of the generation routes (stream, JSON, fail_status): what a test
    # needs to see an instance's headers reach the client, hop-by-hop ones included.
    response_headers: dict[str, str] = {}
    # Like vLLM's --enable-request-id-headers: every generation answer carries X-Request-Id,
    # the request's own, else a new one.
    request_id_headers: bool = False
    # The KV kept (residency.py): knowledge tokens held at most; None = the registered
    # kv_mem_gb over the KV per token (timing.KV_GB_PER_TOKEN).
    kv_capacity_tokens: int | None = None
    # Automatic prefix caching of prompt blocks (vLLM's; off unless asked for, so repeated
    # prompts keep their full prefill cost in the tests that do not measure caching).
    prefix_caching: bool = False
    # Blocks the prefix cache holds at most; None = kv capacity / residency.PREFIX_BLOCK_TOKENS.
    prefix_cache_blocks: int | None = None
    # Cost of prefilling a cached token (resident knowledge, prefix hit) against computing it.
    cached_prefill_factor: float = 0.1

    def __post_init__(self) -> None:
        # Raised inside msgspec.convert, these become ValidationErrors naming the struct.
        require(self.slow_factor >= 0, "slow_factor must be >= 0")
        require(self.kv_capacity_tokens is None or self.kv_capacity_tokens >= 0,
                "kv_capacity_tokens must be >= 0 or null")
        require(self.prefix_cache_blocks is None or self.prefix_cache_blocks >= 0,
                "prefix_cache_blocks must be >= 0 or null")
        require(0.0 <= self.cached_prefill_factor <= 1.0, "cached_prefill_factor must be within 0..1")
        require(0.0 <= self.fail_rate <= 1.0, "fail_rate must be within 0..1")
        require(self.fail_status is None or 400 <= self.fail_status <= 599,
                "fail_status must be an HTTP error status (400..599) or null")
        require(self.drop_after_chunks is None or self.drop_after_chunks >= 0,
                "drop_after_chunks must be >= 0 or null")
        require(self.stall_after_chunks is None or self.stall_after_chunks >= 0,
                "stall_after_chunks must be >= 0 or null")
        require(1 <= self.default_max_tokens <= MAX_TOKENS_LIMIT,
                f"default_max_tokens must be within 1..{MAX_TOKENS_LIMIT}")
        for name, value in self.response_headers.items():
            require(bool(_HEADER_NAME.fullmatch(name)), f"response_headers: {name!r} is not a header name")
            require(not _BAD_VALUE.search(value), f"response_headers: the value of {name} holds CR, LF or NUL")


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 9001
    # None: the original Instance's default id, hp_{host}:{port}.
    instance_id: str | None = None
    proxy_cp_url: str = "http://127.0.0.1:8002"
    register: bool = True
    # Bearer token for control-plane calls; no Authorization header at all when None.
    register_token: str | None = None
    # None: use the register reply's heartbeat_interval_s (tests override to go fast).
    heartbeat_interval_s: float | None = None
    # Seconds between resource snapshots (resources.py); 0: none (tests
    # that post their own snapshots for an instance must not have it overwrite them).
    resource_interval_s: float = 0.0
    # Multiplies every simulated duration; 0.05 lets tests run 20x faster than a real GPU.
    time_scale: float = 1.0
    max_concurrency: int = 8
    model: str = "sim-model"
    # What GET /v1/models says the model's context length is, as vLLM does.
    max_model_len: int = 4096
    # Seed for fail_rate draws, so a flaky-instance scenario can be replayed.
    seed: int | None = None
    # How long in-flight (held, hung) requests may delay shutdown before they are cancelled.
    shutdown_grace_s: float = 2.0
    log_level: str = "info"
    log_format: str = "text"  # or "json", as the proxy's processes (cacheroute_proxy/logs.py)
    knobs: Knobs = msgspec.field(default_factory=Knobs)
    # Instance control plane (POST /v1/kv/inject_ready), a second listener.
    # None: data port + 1 (9001 -> 9002 like the original); 0: no control plane.
    cp_port: int | None = None
    # The Redis target this Instance hands to the KDN on a KV inject. Never connected to.
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    redis_db: int = 0
    redis_password: str | None = None
    # Bound on one KDN inject call (the original uses 60 s).
    kdn_timeout_s: float = 60.0
    # The KV memory it registers (meta.kv_mem_gb) and, unless the kv_capacity_tokens knob
    # says otherwise, sizes the KV it keeps by (the proxy's PROXY_KV_MEM_PER_INSTANCE_GB default).
    kv_mem_gb: float = 128.0
    # What the KDN's payload_bytes are counted in, to size each injected id's KV (the
    # simulated KDN's default kv_bytes_per_token).
    kdn_kv_bytes_per_token: int = 96_000
    # Heartbeats carry resident_keys: the knowledge ids whose KV it holds, least recent first.
    report_resident: bool = False

    def __post_init__(self) -> None:
        require(0 < self.port < 65536, "port must be a TCP port (1..65535)")
        require(self.cp_port is None or 0 <= self.cp_port < 65536,
                "cp_port must be a TCP port (1..65535), or 0 to disable the control plane")
        require(self.cp_port is None or self.cp_port == 0 or self.cp_port != self.port,
                "cp_port must differ from port")
        require(0 < self.redis_port < 65536, "redis_port must be a TCP port (1..65535)")
        require(self.redis_db >= 0, "redis_db must be >= 0")
        require(self.kdn_timeout_s > 0, "kdn_timeout must be > 0")
        require(self.kv_mem_gb >= 0, "kv_mem_gb must be >= 0")
        require(self.kdn_kv_bytes_per_token >= 1, "kdn_kv_bytes_per_token must be >= 1")
        require(self.time_scale >= 0, "time_scale must be >= 0")
        require(1 <= self.max_concurrency <= 4096, "max_concurrency must be within 1..4096")
        require(self.max_model_len >= 1, "max_model_len must be >= 1")
        require(self.heartbeat_interval_s is None or self.heartbeat_interval_s > 0,
                "heartbeat_interval must be > 0")
        require(self.resource_interval_s >= 0, "resource_interval must be >= 0")
        require(self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0")
        require(self.proxy_cp_url.startswith(("http://", "https://")),
                "proxy_cp_url must be an http(s) URL")

    @property
    def resolved_instance_id(self) -> str:
        return self.instance_id or f"hp_{self.host}:{self.port}"

    @property
    def resolved_cp_port(self) -> int:
        """The control-plane port to bind; 0 when there is none."""
        if self.cp_port is not None:
            return self.cp_port
        return self.port + 1 if self.port < 65535 else 0

    @property
    def cp_base_url(self) -> str:
        return self.proxy_cp_url.rstrip("/")


def sim_config_from_mapping(raw: Mapping[str, Any]) -> SimConfig:
    return struct_from_mapping(SimConfig, raw)
