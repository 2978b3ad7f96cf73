"""The one typed place for configuration.

Every knob has a default here and an environment variable, named as in the original Proxy
where one existed (`PROXY_INSTANCE_STRATEGY`, `PROXY_INSTANCE_TTL_S`, `PROXY_CP_PORT`, ...).
Command-line flags override the environment by calling :meth:`Settings.with_overrides`.
A bad value fails at start with a message naming the variable, never later on a request.
"""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import msgspec

from . import static_instances

# (field name, environment variable); docs/configuration.md §1 lists every one by topic.
ENV_NAMES: dict[str, str] = {
    "dp_host": "PROXY_DP_HOST",
    "dp_port": "PROXY_DP_PORT",
    "cp_host": "PROXY_CP_HOST",
    "cp_port": "PROXY_CP_PORT",
    "workers": "PROXY_WORKERS",
    "worker_private_host": "PROXY_WORKER_PRIVATE_HOST",
    "worker_private_port_base": "PROXY_WORKER_PRIVATE_PORT_BASE",
    "instance_strategy": "PROXY_INSTANCE_STRATEGY",
    "load_view": "PROXY_LOAD_VIEW",
    "instance_ttl_s": "PROXY_INSTANCE_TTL_S",
    "instance_purge_grace_s": "PROXY_INSTANCE_PURGE_GRACE_S",
    "shm_name": "PROXY_SHM_NAME",
    "shm_instance_capacity": "PROXY_SHM_INSTANCE_CAPACITY",
    "shm_worker_capacity": "PROXY_SHM_WORKER_CAPACITY",
    "upstream_connect_timeout_s": "PROXY_UPSTREAM_CONNECT_TIMEOUT_S",
    "upstream_first_byte_timeout_s": "PROXY_UPSTREAM_FIRST_BYTE_TIMEOUT_S",
    "upstream_idle_timeout_s": "PROXY_UPSTREAM_IDLE_TIMEOUT_S",
    "upstream_pool_size": "PROXY_UPSTREAM_POOL_SIZE",
    "max_body_bytes": "PROXY_MAX_BODY_BYTES",
    "openai_api_key": "OPENAI_API_KEY",
    "least_load_weights": "PROXY_LEAST_LOAD_WEIGHTS",
    "worker_restart_backoff_s": "PROXY_WORKER_RESTART_BACKOFF_S",
    "reaper_interval_s": "PROXY_REAPER_INTERVAL_S",
    "drain_timeout_s": "PROXY_DRAIN_TIMEOUT_S",
    "keepalive_timeout_s": "PROXY_KEEPALIVE_TIMEOUT_S",
    "max_url_bytes": "PROXY_MAX_URL_BYTES",
    "max_head_bytes": "PROXY_MAX_HEAD_BYTES",
    "max_headers": "PROXY_MAX_HEADERS",
    "head_timeout_s": "PROXY_HEAD_TIMEOUT_S",
    "log_level": "PROXY_LOG_LEVEL",
    "log_format": "PROXY_LOG_FORMAT",
    "log_each_request": "PROXY_ACCESS_LOG",
    # --- the prepare/ready pipeline and predicted pressure (docs/architecture.md §5, §6) ---
    "prepare_concurrency": "PREPARE_CONCURRENCY",
    "ready_concurrency": "READY_CONCURRENCY",
    "ready_release_policy": "PROXY_READY_RELEASE_POLICY",
    "text_bypass_max_per_flush": "PROXY_TEXT_BYPASS_MAX_PER_FLUSH",
    "max_queue_per_instance": "PROXY_MAX_QUEUE_PER_INSTANCE",
    "queue_timeout_s": "PROXY_QUEUE_TIMEOUT_S",
    "injection_strategy": "PROXY_INJECTION_STRATEGY",
    "iws_kdn_queue_penalty_alpha": "IWS_KDN_QUEUE_PENALTY_ALPHA",
    "iws_decision_margin_ms": "IWS_DECISION_MARGIN_MS",
    "kdn_default_bandwidth_mbps": "KDN_DEFAULT_BANDWIDTH_MBPS",
    "kdn_timeout_s": "PROXY_KDN_TIMEOUT_S",
    "kv_inject_timeout_s": "PROXY_KV_INJECT_TIMEOUT_S",
    "instance_cp_port_offset": "PROXY_INSTANCE_CP_PORT_OFFSET",
    "predictor_profile": "PROXY_PREDICTOR_PROFILE",
    "event_ring_capacity": "PROXY_EVENT_RING_CAPACITY",
    "event_poll_ms": "PROXY_EVENT_POLL_MS",
    "snapshot_stale_ms": "PROXY_SNAPSHOT_STALE_MS",
    "pace_step": "PROXY_PACE_STEP",
    # --- kv_aware and the affinity index (docs/architecture.md §4.4) ---
    "affinity_view": "PROXY_AFFINITY_VIEW",
    "kv_aware_balance_abs": "PROXY_KV_AWARE_BALANCE_ABS",
    "kv_aware_balance_rel": "PROXY_KV_AWARE_BALANCE_REL",
    "affinity_pending_s": "PROXY_AFFINITY_PENDING_S",
    "affinity_block_tokens": "PROXY_AFFINITY_BLOCK_TOKENS",
    "affinity_max_blocks": "PROXY_AFFINITY_MAX_BLOCKS",
    "affinity_kv_mb_per_token": "PROXY_AFFINITY_KV_MB_PER_TOKEN",
    "affinity_tokenizer": "PROXY_AFFINITY_TOKENIZER",
    "affinity_engine_hash_seed": "PROXY_AFFINITY_ENGINE_HASH_SEED",
    "kv_events": "PROXY_KV_EVENTS",
    # --- faults ---
    "eject_after_failures": "PROXY_EJECT_AFTER_FAILURES",
    "eject_s": "PROXY_EJECT_S",
    "retry_attempts": "PROXY_RETRY_ATTEMPTS",
    "metrics_dir": "PROXY_METRICS_DIR",
    # --- security ---
    "cp_token": "PROXY_CP_TOKEN",
    "cp_token_file": "PROXY_CP_TOKEN_FILE",
    "debug_requires_token": "PROXY_DEBUG_REQUIRES_TOKEN",
    # --- registration with the Scheduler control plane (docs/protocol.md §6), from the sidecar ---
    "scheduler_cp_url": "SCHEDULER_CP_URL",
    "proxy_id": "PROXY_ID",
    "advertise_host": "PROXY_ADVERTISE_HOST",
    "advertise_port": "PROXY_ADVERTISE_PORT",
    "scheduler_heartbeat_s": "PROXY_HEARTBEAT_S",
    "scheduler_timeout_s": "PROXY_SCHEDULER_TIMEOUT_S",
    "scheduler_backoff_max_s": "PROXY_SCHEDULER_BACKOFF_MAX_S",
    "max_capacity": "PROXY_MAX_CAPACITY",
    "instance_count": "PROXY_INSTANCE_COUNT",
    "kv_mem_per_instance_gb": "PROXY_KV_MEM_PER_INSTANCE_GB",
    "kv_cache_update_policy": "PROXY_KV_CACHE_UPDATE_POLICY",
    "kdn_links": "PROXY_KDN_LINKS_JSON",
    "kdn_links_refresh_s": "PROXY_KDN_LINKS_REFRESH_S",
    # --- engines without an agent, registered and probed by the sidecar (docs/operations.md §9) ---
    "static_instances": "PROXY_STATIC_INSTANCES",
    "static_probe_s": "PROXY_STATIC_PROBE_S",
    # --- the browser dashboard (docs/operations.md, dashboard section) ---
    "ui_listen": "PROXY_UI_LISTEN",
    "ui_url": "PROXY_UI_URL",
    # --- OpenTelemetry spans (docs/operations.md, tracing): the SDK's standard names; the SDK
    # itself reads the others (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...) ---
    "otel_exporter_otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "otel_exporter_otlp_traces_endpoint": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "otel_sdk_disabled": "OTEL_SDK_DISABLED",
}

STRATEGY_ALIASES: dict[str, str] = {
    "round_robin": "round_robin",
    "round-robin": "round_robin",
    "rr": "round_robin",
    "least_load": "least_load",
    "least-load": "least_load",
    "ll": "least_load",
    "kv_aware": "kv_aware",
    "kv-aware": "kv_aware",
    "kv": "kv_aware",
}

LOAD_VIEWS = ("shared", "per_worker")
AFFINITY_VIEWS = ("shared", "per_worker")
# Settings an earlier release read, refused at start rather than silently ignored.
_PREDICTED_TTFT = ("kv_aware weighs each instance by its predicted time to first token, queue "
                   "wait plus the prefill and KV transfer of what it does not hold "
                   "(docs/architecture.md §4.4), with no credit to scale")
RETIRED = {"PROXY_KV_AWARE_CREDIT_PER_MS": _PREDICTED_TTFT, "PROXY_KV_AWARE_MAX_CREDIT": _PREDICTED_TTFT}
LOG_FORMATS = ("text", "json")
RELEASE_POLICIES = ("ordered", "text_bypass")
INJECTION_STRATEGIES = ("default", "iws")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    dp_host: str = "127.0.0.1"
    dp_port: int = 8001
    cp_host: str = "127.0.0.1"
    cp_port: int = 8002
    workers: int = 4
    worker_private_host: str = "127.0.0.1"
    # Worker i is also reachable on worker_private_port_base + i (to ask one specific worker).
    worker_private_port_base: int = 8100
    instance_strategy: str = "round_robin"
    # "shared": least_load reads the host-wide table. "per_worker": each worker sees only its
    # own contributions, like N copies of the original Proxy (an ablation for benchmarks).
    load_view: str = "shared"
    instance_ttl_s: float = 30.0
    instance_purge_grace_s: float = 60.0
    shm_name: str = "/cacheroute_proxy"
    shm_instance_capacity: int = 256
    shm_worker_capacity: int = 64
    upstream_connect_timeout_s: float = 5.0
    upstream_first_byte_timeout_s: float = 600.0
    upstream_idle_timeout_s: float = 120.0
    upstream_pool_size: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    openai_api_key: str | None = None
    least_load_weights: dict[str, float] = {}
    worker_restart_backoff_s: float = 0.2
    reaper_interval_s: float = 0.25
    # On SIGTERM a worker lets requests and streams finish this long, then cuts the rest cleanly.
    drain_timeout_s: float = 30.0
    # A worker closes a keep-alive connection idle this long (clients must use a shorter idle
    # timeout, or they may send on a connection the worker is closing).
    keepalive_timeout_s: float = 5.0
    # What every listener (the workers', the sidecar's, the dashboard's) accepts of a request
    # head, as nginx does: a longer request target is 414, a larger head or more headers 431,
    # a head not complete this long after its first byte 408; then the connection is closed.
    max_url_bytes: int = 8 * 1024
    max_head_bytes: int = 32 * 1024
    max_headers: int = 100
    head_timeout_s: float = 60.0
    log_level: str = "info"
    # "text": time role[pid] level logger: message; "json": one object per line (cacheroute_proxy/logs.py).
    log_format: str = "text"
    # One line per proxied request from the worker that served it, at its end (off: nothing per request).
    log_each_request: bool = False
    prepare_concurrency: int = 8
    # Host-wide: N workers together never forward more than this to one instance at once.
    ready_concurrency: int = 8
    ready_release_policy: str = "ordered"
    text_bypass_max_per_flush: int = 1
    # Requests one worker lets wait per instance (prepare + ready) before answering 429.
    max_queue_per_instance: int = 256
    queue_timeout_s: float = 60.0
    injection_strategy: str = "default"
    iws_kdn_queue_penalty_alpha: float = 0.5
    iws_decision_margin_ms: float = 100.0
    kdn_default_bandwidth_mbps: float = 1000.0
    kdn_timeout_s: float = 10.0
    kv_inject_timeout_s: float = 60.0
    # Where an instance's control plane (KV inject) listens when it does not say (meta.cp_port).
    instance_cp_port_offset: int = 1
    predictor_profile: str = "llama3-70b-8x5090"
    event_ring_capacity: int = 1024
    event_poll_ms: float = 5.0
    # Older than this, the sidecar's pressure snapshot is "stale" and not used for scoring.
    snapshot_stale_ms: float = 2000.0
    # How fast the sidecar learns each instance's pace (observed / predicted first-token time,
    # cacheroute_proxy/pace.py): 0 trusts the predictor profile as is, 1 follows the last request.
    pace_step: float = 0.05
    # kv_aware (docs/architecture.md §4.4). "shared": every worker reads the host-wide affinity
    # index the sidecar keeps; "per_worker": each worker remembers only what it itself sent (an
    # ablation for benchmarks, like N proxies that each keep their own index).
    affinity_view: str = "shared"
    # The balance guard: kv_aware chooses as least_load does when the candidates' requests in
    # flight spread by more than `abs` AND the busiest holds more than `rel` x the idlest's.
    kv_aware_balance_abs: float = 4.0
    kv_aware_balance_rel: float = 1.5
    # How long a routing decision counts as pending residency on the instance it chose, unless
    # the affinity index confirms it sooner or the request withdraws it (it failed).
    affinity_pending_s: float = 30.0
    # Prompt prefixes are hashed in blocks of this many tokens (x4 characters), chained, at
    # most `max_blocks` of them (longer prompts: only the leading blocks count).
    affinity_block_tokens: int = 64
    affinity_max_blocks: int = 32
    # KV bytes a token occupies on an instance, to turn a KV capacity in GB
    # (PROXY_KV_MEM_PER_INSTANCE_GB or the instance's meta.kv_mem_gb) into tokens when the
    # instance does not register meta.kv_capacity_tokens (the default: the profiles'
    # kv.transfer_mb_per_token).
    affinity_kv_mb_per_token: float = 0.096
    # A model directory (tokenizer.json, chat template) to hash prompt prefixes as the engine
    # does, in its own tokens and blocks (cacheroute_proxy/engine_prefix.py; set
    # PROXY_AFFINITY_BLOCK_TOKENS to the engine's block size, 128 on vLLM's CPU build); "" =
    # the proxy's own character blocks. Needs the engine-kv extra.
    affinity_tokenizer: str = ""
    # The engines' PYTHONHASHSEED, if they run with one (it seeds vLLM's block hashes).
    affinity_engine_hash_seed: str = ""
    # vLLM KV cache event publishers the sidecar subscribes to, "instance_id=tcp://host:port,..."
    # (sidecar/kv_events.py), besides those an agent or the static prober found in an engine's
    # /kv_event_sources (meta.kv_events_endpoint). Followed only with affinity_tokenizer.
    kv_events: str = ""
    # prometheus_client multiprocess files; "" = a private directory named after the segment.
    metrics_dir: str = ""
    # A worker leaves an instance out for eject_s after this many failures in a row (0: never).
    eject_after_failures: int = 3
    eject_s: float = 10.0
    # Tries on other instances when one fails before anything reached the client.
    retry_attempts: int = 1
    # Bearer token required for register/heartbeat/unregister when set (the file is preferred:
    # it keeps the secret out of the environment and the process table).
    cp_token: str | None = None
    cp_token_file: str | None = None
    # Also require it for /debug/* and the instance list, on the control plane and the workers.
    debug_requires_token: bool = False
    # Scheduler control plane (e.g. http://127.0.0.1:7002); None: registration is off.
    scheduler_cp_url: str | None = None
    # None: hp_{advertise_host}:{advertise_port}, the original's default.
    proxy_id: str | None = None
    # What the Scheduler is told to send requests to; None: dp_host (the machine's name if
    # that is a wildcard) and dp_port, the port every worker shares.
    advertise_host: str | None = None
    advertise_port: int | None = None
    # Heartbeat interval when the register reply names none.
    scheduler_heartbeat_s: float = 5.0
    # Every call to the Scheduler gives up after this; retries back off up to the cap.
    scheduler_timeout_s: float = 5.0
    scheduler_backoff_max_s: float = 30.0
    # Advertised in the register body; max_capacity is also pool_resource's `capacity`.
    max_capacity: int = 8
    # None: the number of instances registered when the proxy registers.
    instance_count: int | None = None
    kv_mem_per_instance_gb: float = 128.0
    kv_cache_update_policy: str = "lru"
    # Static KDN links {kdn_key: {metrics}}, sent in the register meta as `kdn_links`, and what
    # IWS estimates a KV transfer over when no instance measured that link.
    kdn_links: dict[str, dict[str, Any]] = {}
    # How often each worker copies the links instances measured from the sidecar.
    kdn_links_refresh_s: float = 5.0
    # Engines the sidecar registers itself: "url[=id],..." (cacheroute_proxy/static_instances.py).
    static_instances: str = ""
    # How often the sidecar probes each one's GET /health.
    static_probe_s: float = 2.0
    # A second listener of the sidecar for the dashboard alone, "host:port" (the original's
    # 127.0.0.1:8202); "": only http://<control plane>/dashboard.
    ui_listen: str = ""
    # The dashboard's URL as a browser should open it (a tunnel, a reverse proxy), printed in
    # the ready line; "": the listener's own URL.
    ui_url: str = ""
    # Spans are exported over OTLP/HTTP when one of the endpoints is set, unless disabled;
    # the traceparent header passes through untouched either way.
    otel_exporter_otlp_endpoint: str | None = None
    otel_exporter_otlp_traces_endpoint: str | None = None
    otel_sdk_disabled: bool = False

    def __post_init__(self) -> None:
        _check(self.instance_strategy in STRATEGY_ALIASES, "instance_strategy",
               f"unknown strategy {self.instance_strategy!r}; choose one of {sorted(STRATEGY_ALIASES)}")
        _check(self.load_view in LOAD_VIEWS, "load_view", f"must be one of {LOAD_VIEWS}")
        _check(self.log_format in LOG_FORMATS, "log_format", f"must be one of {LOG_FORMATS}")
        for name in ("dp_port", "cp_port", "worker_private_port_base"):
            _check(0 < getattr(self, name) < 65536, name, "must be a TCP port (1..65535)")
        _check(1 <= self.workers <= 256, "workers", "must be between 1 and 256")
        _check(self.workers <= self.shm_worker_capacity, "workers",
               f"exceeds the shared table's worker capacity ({self.shm_worker_capacity})")
        _check(1 <= self.shm_instance_capacity <= 4096, "shm_instance_capacity", "must be 1..4096")
        _check(1 <= self.shm_worker_capacity <= 1024, "shm_worker_capacity", "must be 1..1024")
        _check(self.shm_name.startswith("/") and "/" not in self.shm_name[1:], "shm_name",
               "must look like /name (one leading slash, no other)")
        for name in ("instance_ttl_s", "upstream_connect_timeout_s", "upstream_first_byte_timeout_s",
                     "upstream_idle_timeout_s", "reaper_interval_s", "drain_timeout_s",
                     "keepalive_timeout_s", "head_timeout_s"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        self._check_head_limits()
        _check(self.instance_purge_grace_s >= 0, "instance_purge_grace_s", "must be >= 0")
        _check(self.max_body_bytes > 0, "max_body_bytes", "must be > 0")
        _check(self.ready_release_policy in RELEASE_POLICIES, "ready_release_policy",
               f"must be one of {RELEASE_POLICIES}")
        _check(self.injection_strategy in INJECTION_STRATEGIES, "injection_strategy",
               f"must be one of {INJECTION_STRATEGIES}")
        for name in ("prepare_concurrency", "ready_concurrency", "max_queue_per_instance",
                     "text_bypass_max_per_flush"):
            _check(1 <= getattr(self, name) <= 100_000, name, "must be 1..100000")
        for name in ("queue_timeout_s", "kdn_timeout_s", "kv_inject_timeout_s", "event_poll_ms",
                     "snapshot_stale_ms", "kdn_default_bandwidth_mbps"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(self.kdn_links_refresh_s > 0, "kdn_links_refresh_s", "must be > 0")
        self._check_kdn_links()
        _check(0 <= self.pace_step <= 1, "pace_step", "must be 0..1")
        self._check_kv_aware()
        _check(64 <= self.event_ring_capacity <= 1 << 20, "event_ring_capacity", "must be 64..1048576")
        _check(0 <= self.eject_after_failures <= 1000, "eject_after_failures", "must be 0..1000")
        _check(self.eject_s > 0, "eject_s", "must be > 0")
        _check(0 <= self.retry_attempts <= 5, "retry_attempts", "must be 0..5")
        if self.cp_token_file:
            try:
                readable = bool(open(self.cp_token_file).read().strip())
            except OSError as exc:
                raise ValueError(f"PROXY_CP_TOKEN_FILE: cannot read {self.cp_token_file}: {exc.strerror}") from None
            _check(readable, "cp_token_file", f"{self.cp_token_file} is empty")
        _check(is_loopback(self.cp_host) or bool(self.cp_token or self.cp_token_file), "cp_host",
               f"{self.cp_host} is not a loopback address: anyone who reaches it could register an "
               f"instance or remove one, so a control plane bound beyond loopback needs a token "
               f"(PROXY_CP_TOKEN_FILE or PROXY_CP_TOKEN)")
        self._check_scheduler_link()
        static_instances.parse(self.static_instances)  # raises naming PROXY_STATIC_INSTANCES
        _check(0.1 <= self.static_probe_s <= 3600, "static_probe_s", "must be 0.1..3600 seconds")
        self._check_ui()
        for name in ("otel_exporter_otlp_endpoint", "otel_exporter_otlp_traces_endpoint"):
            _check(_is_http_url(getattr(self, name)), name,
                   f"must be an http(s) URL such as http://127.0.0.1:4318, got {getattr(self, name)!r}")

    @property
    def otel_traces_on(self) -> bool:
        """Spans are built and exported: an OTLP endpoint is set and the SDK is not disabled."""
        return bool(self.otel_exporter_otlp_endpoint or self.otel_exporter_otlp_traces_endpoint) \
            and not self.otel_sdk_disabled

    @property
    def kv_event_endpoints(self) -> dict[str, str]:
        """PROXY_KV_EVENTS as {instance id: ZMQ endpoint}."""
        endpoints: dict[str, str] = {}
        for entry in filter(None, (e.strip() for e in self.kv_events.split(","))):
            instance_id, _, endpoint = (part.strip() for part in entry.partition("="))
            _check(bool(instance_id) and endpoint.startswith(("tcp://", "ipc://")), "kv_events",
                   f"{entry!r} is not instance_id=tcp://host:port (or ipc://path)")
            _check("://*" not in endpoint, "kv_events",
                   f"{entry!r}: name the engine's host (as 127.0.0.1), not the * it binds")
            _check(instance_id not in endpoints, "kv_events", f"instance {instance_id!r} is given twice")
            endpoints[instance_id] = endpoint
        return endpoints

    @property
    def static_targets(self) -> tuple[static_instances.StaticInstance, ...]:
        return static_instances.parse(self.static_instances)

    def _check_kdn_links(self) -> None:
        """The numbers IWS reads from a static link: a bandwidth > 0 and an RTT >= 0, when given."""
        for key, metrics in self.kdn_links.items():
            for name, low in (("bandwidth_mbps", 0.0), ("latency_ms", None), ("rtt_ms", None)):
                value = metrics.get(name)
                if value is None:
                    continue
                number = isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value)
                _check(number and (value > low if low is not None else value >= 0), "kdn_links",
                       f"{key}: {name} must be a number {'> 0' if low is not None else '>= 0'}, "
                       f"got {value!r}")

    def _check_head_limits(self) -> None:
        for name in ("max_url_bytes", "max_head_bytes"):
            _check(256 <= getattr(self, name) <= 1 << 20, name, "must be 256..1048576")
        _check(1 <= self.max_headers <= 10_000, "max_headers", "must be 1..10000")

    def _check_kv_aware(self) -> None:
        _check(self.affinity_view in AFFINITY_VIEWS, "affinity_view", f"must be one of {AFFINITY_VIEWS}")
        _check(math.isfinite(self.kv_aware_balance_abs) and self.kv_aware_balance_abs >= 0,
               "kv_aware_balance_abs", "must be a finite number >= 0")
        _check(math.isfinite(self.affinity_pending_s) and 0 < self.affinity_pending_s <= 3600,
               "affinity_pending_s", "must be a number of seconds in (0, 3600]")
        _check(math.isfinite(self.kv_aware_balance_rel) and self.kv_aware_balance_rel >= 1,
               "kv_aware_balance_rel", "must be a finite number >= 1")
        _check(1 <= self.affinity_block_tokens <= 4096, "affinity_block_tokens", "must be 1..4096")
        _check(0 <= self.affinity_max_blocks <= 256, "affinity_max_blocks", "must be 0..256")
        _check(math.isfinite(self.affinity_kv_mb_per_token) and self.affinity_kv_mb_per_token > 0,
               "affinity_kv_mb_per_token", "must be a finite number > 0")
        _check(not self.affinity_tokenizer or Path(self.affinity_tokenizer).is_dir(),
               "affinity_tokenizer", "must be a model directory (with tokenizer.json)")
        _check(not self.kv_event_endpoints or bool(self.affinity_tokenizer), "kv_events",
               "needs PROXY_AFFINITY_TOKENIZER: without the engine's tokenizer the workers' "
               "prefix keys are not the engine's blocks")

    def _check_scheduler_link(self) -> None:
        if self.scheduler_cp_url is not None:
            url = urlsplit(self.scheduler_cp_url)
            try:
                url.port  # noqa: B018 - raises ValueError for a port that is not a number
            except ValueError:
                url = urlsplit("")
            _check(url.scheme in ("http", "https") and bool(url.hostname), "scheduler_cp_url",
                   f"must be an http(s) URL such as http://127.0.0.1:7002, got {self.scheduler_cp_url!r}")
        _check(self.advertise_port is None or 0 < self.advertise_port < 65536, "advertise_port",
               "must be a TCP port (1..65535)")
        for name in ("scheduler_heartbeat_s", "scheduler_timeout_s", "scheduler_backoff_max_s"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(self.max_capacity >= 0, "max_capacity", "must be >= 0")
        _check(self.instance_count is None or self.instance_count >= 0, "instance_count", "must be >= 0")
        _check(self.kv_mem_per_instance_gb >= 0, "kv_mem_per_instance_gb", "must be >= 0")

    def _check_ui(self) -> None:
        if self.ui_listen:
            address = _host_port(self.ui_listen)
            _check(address is not None, "ui_listen",
                   f"must be HOST:PORT such as 127.0.0.1:8202, got {self.ui_listen!r}")
            assert address is not None
            _check(address[1] not in (self.cp_port, self.dp_port), "ui_listen",
                   f"port {address[1]} is already the control plane's or the data plane's")
            _check(is_loopback(address[0]) or bool(self.cp_token or self.cp_token_file), "ui_listen",
                   f"{address[0]} is not a loopback address: like the control plane, a dashboard "
                   f"bound beyond loopback needs a token (PROXY_CP_TOKEN_FILE or PROXY_CP_TOKEN)")
        if self.ui_url:
            url = urlsplit(self.ui_url)
            _check(url.scheme in ("http", "https") and bool(url.hostname), "ui_url",
                   f"must be an http(s) URL such as http://127.0.0.1:8202/, got {self.ui_url!r}")

    @property
    def ui_address(self) -> tuple[str, int] | None:
        """(host, port) of the dashboard's own listener, None when there is none."""
        return _host_port(self.ui_listen) if self.ui_listen else None

    @property
    def dashboard_url(self) -> str:
        """Where a browser finds the dashboard: PROXY_UI_URL, else the UI listener, else the
        control plane's /dashboard."""
        if self.ui_url:
            return self.ui_url
        if self.ui_address is not None:
            host, port = self.ui_address
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        return f"{self.cp_url}/dashboard"

    def __repr__(self) -> str:  # never print the token
        shown = {k: ("***" if k == "cp_token" and v else v)
                 for k, v in msgspec.structs.asdict(self).items()}
        return f"Settings({shown})"

    @property
    def strategy_name(self) -> str:
        """The canonical strategy name behind an alias."""
        return STRATEGY_ALIASES[self.instance_strategy]

    @property
    def heartbeat_interval_s(self) -> int:
        # The original's formula, so Instances keep their heartbeat cadence.
        return int(min(10, max(1, self.instance_ttl_s // 3)))

    @property
    def cp_url(self) -> str:
        return f"http://{self.cp_host}:{self.cp_port}"

    @property
    def resolved_metrics_dir(self) -> str:
        return self.metrics_dir or f"/tmp/cacheroute-metrics-{self.shm_name.strip('/')}"

    def worker_private_port(self, index: int) -> int:
        return self.worker_private_port_base + index

    def with_overrides(self, **overrides: Any) -> "Settings":
        """A copy with the non-None overrides applied (for CLI flags), validated again."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if not given:
            return self
        return _convert({**msgspec.structs.asdict(self), **given})

    def to_env(self) -> dict[str, str]:
        """Environment that reproduces these settings in a child process."""
        env: dict[str, str] = {}
        for field, var in ENV_NAMES.items():
            value = getattr(self, field)
            if value is None:
                continue
            env[var] = msgspec.json.encode(value).decode() if isinstance(value, dict) else str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        for var, why in RETIRED.items():
            if environ.get(var, "") != "":
                raise ConfigError(f"{var} is no longer read: {why}; unset it")
        raw: dict[str, Any] = {}
        for field, var in ENV_NAMES.items():
            if var in environ and environ[var] != "":
                raw[field] = _parse_env_value(field, var, environ[var])
        return _convert(raw)


def _parse_env_value(field: str, var: str, text: str) -> Any:
    if field in ("least_load_weights", "kdn_links"):
        try:
            return msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{var}: not valid JSON ({exc})") from None
    return text


def _convert(raw: dict[str, Any]) -> Settings:
    try:
        return msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_name_the_variable(str(exc))) from None


def _name_the_variable(message: str) -> str:
    # msgspec says "... - at `$.dp_port`"; operators set PROXY_DP_PORT, so say that.
    for field, var in ENV_NAMES.items():
        if f"`$.{field}`" in message or f"`$.{field}[" in message:
            return f"{var}: {message}"
    return message


def _is_http_url(value: str | None) -> bool:
    """None (not set) or an http(s) URL with a host and, if any, a numeric port."""
    if value is None:
        return True
    url = urlsplit(value)
    try:
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name localhost."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{ENV_NAMES.get(field, field)}: {message}")


def _host_port(value: str) -> tuple[str, int] | None:
    """"host:port" or "[v6]:port" -> (host, port); None if it is not one."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)
