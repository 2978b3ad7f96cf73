"""The one typed place for configuration.

Each setting is defined once, here: a field of `Settings` whose `Env(...)` gives its environment
variable (the original Proxy's name where one existed: `PROXY_INSTANCE_STRATEGY`,
`PROXY_INSTANCE_TTL_S`, `PROXY_CP_PORT`, ...), its topic, one line of help and the rule its value
keeps (cacheroute_proxy/setting.py). Reading the environment, the errors, `cacheroute-proxy
config` and the tables of docs/configuration.md (`make config-doc`) all come from it. Command-line
flags override the environment through :meth:`Settings.with_overrides`. A bad value fails at
start with a message naming the variable, the value and the rule, never later on a request.
"""

# No `from __future__ import annotations`: the Env(...) of each field is built once, where the
# class is, so its rules see this module.
import os
from pathlib import Path
from typing import Annotated, Any, Mapping

import msgspec

from .routing.registry import ALIASES as STRATEGY_ALIASES
from .setting import ConfigError, Env, Rule, Topic, check, convert, fields_of, read, to_text
from .static_instances import StaticInstance, parse_static_instances
from .value_rules import (check_kdn_links, host_port, http_url, is_loopback, kv_event_endpoints,
                          read_token_file)

LOAD_VIEWS = ("shared", "per_worker")
SIDECAR_WAKES = ("reservation", "heartbeat")
AFFINITY_VIEWS = ("shared", "per_worker")
LOG_FORMATS = ("text", "json")
RELEASE_POLICIES = ("ordered", "text_bypass")
INJECTION_STRATEGIES = ("default", "iws")

# Settings an earlier release read, refused at start rather than silently ignored.
_PREDICTED_TTFT = ("kv_aware weighs each instance by its predicted time to first token, queue "
                   "wait plus the prefill and KV transfer of what it does not hold "
                   "(docs/architecture.md §4.4), with no credit to scale")
RETIRED = {"PROXY_KV_AWARE_CREDIT_PER_MS": _PREDICTED_TTFT, "PROXY_KV_AWARE_MAX_CREDIT": _PREDICTED_TTFT}

# The topics, in the order of docs/configuration.md §1 (one table each).
PROCESSES = Topic("processes", "Addresses and processes")
SELECTION = Topic("selection", "Instance selection")
INSTANCES = Topic("instances", "Instances and the upstream")
PIPELINE = Topic("pipeline", "The prepare/ready pipeline")
KNOWLEDGE = Topic("knowledge", "Knowledge and predictions")
SHARED_MEMORY = Topic("shm", "Shared memory, events, metrics")
SECURITY = Topic("security", "Security")
SCHEDULER = Topic("scheduler", "Registration with the Scheduler")
TRACING = Topic("tracing", "Tracing (OpenTelemetry)")

PORT: dict[str, Any] = {"ge": 1, "le": 65535, "what": "a TCP port"}
QUEUE_BOUND: dict[str, Any] = {"ge": 1, "le": 100_000}


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    # --- addresses and processes ---
    dp_host: Annotated[str, Env("PROXY_DP_HOST", PROCESSES, (
        "the shared service address every worker binds (`SO_REUSEPORT`); `0.0.0.0` to serve other "
        "hosts"))] = "127.0.0.1"
    dp_port: Annotated[int, Env("PROXY_DP_PORT", PROCESSES, "the shared service port", **PORT)] = 8001
    cp_host: Annotated[str, Env("PROXY_CP_HOST", PROCESSES, (
        "the sidecar's control plane, where instances register; beyond loopback only with a token "
        "(`PROXY_CP_TOKEN_FILE` or `PROXY_CP_TOKEN`)"))] = "127.0.0.1"
    cp_port: Annotated[int, Env("PROXY_CP_PORT", PROCESSES, "the control plane's port", **PORT)] = 8002
    worker_private_host: Annotated[str, Env("PROXY_WORKER_PRIVATE_HOST", PROCESSES,
                                            "each worker's private listener")] = "127.0.0.1"
    worker_private_port_base: Annotated[int, Env("PROXY_WORKER_PRIVATE_PORT_BASE", PROCESSES, (
        "worker *i* also answers on base + *i* (what a rolling restart waits for)"), **PORT)] = 8100
    workers: Annotated[int, Env("PROXY_WORKERS", PROCESSES, (
        "workers started by `cacheroute-proxy run`, at most `PROXY_SHM_WORKER_CAPACITY` (under "
        "systemd: the enabled worker units)"), ge=1, le=256)] = 4
    worker_restart_backoff_s: Annotated[float, Env("PROXY_WORKER_RESTART_BACKOFF_S", PROCESSES, (
        "restart delay of a crashed child that had run for 5 s or more; one dying sooner waits "
        "twice as long each time, up to 10 s"))] = 0.2
    drain_timeout_s: Annotated[float, Env("PROXY_DRAIN_TIMEOUT_S", PROCESSES, (
        "after SIGTERM a worker lets requests finish this long, then cuts the rest cleanly "
        "(docs/operations.md §4); the supervisor SIGKILLs after this + 10 s"),
        gt=0)] = 30.0
    keepalive_timeout_s: Annotated[float, Env("PROXY_KEEPALIVE_TIMEOUT_S", PROCESSES, (
        "a worker closes a keep-alive connection idle this long; clients and load balancers in "
        "front must use a shorter idle timeout"), gt=0)] = 5.0
    # What every listener (the workers', the sidecar's, the dashboard's) accepts of a request
    # head, as nginx does.
    max_url_bytes: Annotated[int, Env("PROXY_MAX_URL_BYTES", PROCESSES, (
        "the longest request target (path and query), on every listener; longer: 414 and close "
        "(docs/protocol.md §1.1)"),
        ge=256, le=1 << 20)] = 8 * 1024
    max_head_bytes: Annotated[int, Env("PROXY_MAX_HEAD_BYTES", PROCESSES, (
        "the largest request head (request line and headers; nginx allows 4 × 8 KiB); larger: "
        "431 and close"),
        ge=256, le=1 << 20)] = 32 * 1024
    max_headers: Annotated[int, Env("PROXY_MAX_HEADERS", PROCESSES,
                                    "more header lines than this: 431 and close; every listener",
                                    ge=1, le=10_000)] = 100
    head_timeout_s: Annotated[float, Env("PROXY_HEAD_TIMEOUT_S", PROCESSES, (
        "a request head not complete this long after its first byte: 408 and close (nginx's "
        "`client_header_timeout`; a pipelined one once the answer before it is out)"),
        gt=0)] = 60.0
    log_level: Annotated[str, Env("PROXY_LOG_LEVEL", PROCESSES, "every process")] = "info"
    ui_listen: Annotated[str, Env("PROXY_UI_LISTEN", PROCESSES, (
        "`HOST:PORT` (the original's `127.0.0.1:8202`) of the sidecar's own listener for the "
        "dashboard alone (docs/operations.md §3.2); beyond loopback only with a token. Unset: "
        "the control plane's `/dashboard` only"),
        rule=Rule.holds("HOST:PORT such as 127.0.0.1:8202",
                        lambda v: not v or host_port(v) is not None))] = ""
    ui_url: Annotated[str, Env("PROXY_UI_URL", PROCESSES, (
        "the dashboard's URL as a browser opens it (a tunnel, a reverse proxy), printed in the "
        "ready line; its host is accepted as `Host` on the UI listener. Unset: "
        "`PROXY_UI_LISTEN`'s URL, else the control plane's `/dashboard`"),
        rule=http_url("http://127.0.0.1:8202/", empty=True))] = ""
    log_format: Annotated[str, Env("PROXY_LOG_FORMAT", PROCESSES, (
        "`text`: `time role[pid] level logger: message`; `json`: one object per line "
        "(docs/operations.md §8)"), choices=LOG_FORMATS, what="log format")] = "text"
    log_each_request: Annotated[bool, Env("PROXY_ACCESS_LOG", PROCESSES, (
        "one line per proxied request, at its end, at any `PROXY_LOG_LEVEL` (docs/operations.md "
        "§8)"))] = False

    # --- instance selection ---
    instance_strategy: Annotated[str, Env("PROXY_INSTANCE_STRATEGY", SELECTION, (
        "how a worker chooses an instance (docs/architecture.md §4)"),
        choices=STRATEGY_ALIASES, what="strategy")] = "round_robin"
    least_load_weights: Annotated[dict[str, float], Env("PROXY_LEAST_LOAD_WEIGHTS", SELECTION, (
        "weight overrides of least_load's score, e.g. `{\"predicted_total_backlog_ms\": 0.01}`; "
        "unset: the defaults of docs/architecture.md §4.1. An unknown component or a negative "
        "weight fails at start"))] = {}
    load_view: Annotated[str, Env("PROXY_LOAD_VIEW", SELECTION, (
        "`shared`: the host-wide table; `per_worker`, a benchmark ablation: each worker sees only "
        "its own share (docs/architecture.md §4.3)"),
        choices=LOAD_VIEWS, what="load view")] = "shared"
    snapshot_stale_ms: Annotated[float, Env("PROXY_SNAPSHOT_STALE_MS", SELECTION, (
        "an older pressure snapshot of the sidecar's is `stale` and not used for scoring"),
        gt=0)] = 2000.0
    sidecar_wake: Annotated[str, Env("PROXY_SIDECAR_WAKE", SELECTION, (
        "what, besides its heartbeat, engine KV events and acknowledged knowledge, wakes a "
        "sleeping sidecar: `reservation`, a request's events too; `heartbeat`, nothing more "
        "(docs/architecture.md §2)"),
        choices=SIDECAR_WAKES, what="sidecar wake")] = "reservation"
    pace_step: Annotated[float, Env("PROXY_PACE_STEP", SELECTION, (
        "how fast an instance's pace (and a KDN link's), observed / predicted time, is learned "
        "(0 = trust the profile, 1 = the last request decides)"),
        ge=0, le=1)] = 0.05
    kv_aware_balance_abs: Annotated[float, Env("PROXY_KV_AWARE_BALANCE_ABS", SELECTION, (
        "`kv_aware`'s balance guard: it chooses as least_load does when the candidates' requests "
        "in flight spread by more than this ... (docs/architecture.md §4.4)"),
        ge=0, finite=True)] = 16.0
    kv_aware_balance_rel: Annotated[float, Env("PROXY_KV_AWARE_BALANCE_REL", SELECTION, (
        "... **and** the busiest holds more than this × the idlest's. Lower both to let load win "
        "sooner"), ge=1, finite=True)] = 1.5
    kv_aware_prompt_balance_abs: Annotated[float, Env("PROXY_KV_AWARE_PROMPT_BALANCE_ABS", SELECTION, (
        "the same bound for a plain request whose prompt has a home"),
        ge=0, finite=True)] = 16.0
    kv_aware_work_weight: Annotated[float, Env("PROXY_KV_AWARE_WORK_WEIGHT", SELECTION, (
        "`kv_aware` counts the engine work a choice adds (prefill of what the instance lacks, "
        "displacement away from a prompt's home) this many times: once for the request's own "
        "wait, the rest for those queued behind it"),
        ge=1, le=20, finite=True)] = 2.0
    kv_aware_prompt_work_weight: Annotated[float, Env("PROXY_KV_AWARE_PROMPT_WORK_WEIGHT", SELECTION, (
        "the same for a plain request whose prompt has a home"), ge=1, le=20, finite=True)] = 6.0
    kv_aware_slot_guard: Annotated[bool, Env("PROXY_KV_AWARE_SLOT_GUARD", SELECTION, (
        "`kv_aware` chooses as least_load also when its choice's engine has no free slot "
        "(max_num_seqs) and another's has (docs/architecture.md §4.4)"))] = False
    affinity_pending_s: Annotated[float, Env("PROXY_AFFINITY_PENDING_S", SELECTION, (
        "the longest a kv_aware choice counts as pending residency on its instance (docs/"
        "architecture.md, \"Claims\")"), gt=0, le=3600, finite=True)] = 30.0
    affinity_home_halflife_s: Annotated[float, Env("PROXY_AFFINITY_HOME_HALFLIFE_S", SELECTION, (
        "the half-life of the prompts' request rates by which the sidecar places their homes "
        "(docs/architecture.md, \"Homes\")"), gt=0, le=3600, finite=True)] = 20.0
    affinity_home_tolerance: Annotated[float, Env("PROXY_AFFINITY_HOME_TOLERANCE", SELECTION, (
        "the sidecar moves a prompt's home off an instance whose prompts bring it more than "
        "(1 + this) × its share of their work"), ge=0, le=10, finite=True)] = 0.5
    affinity_view: Annotated[str, Env("PROXY_AFFINITY_VIEW", SELECTION, (
        "`shared`: the host-wide affinity index; `per_worker`, a benchmark ablation: each worker "
        "routes on only what it sent itself"),
        choices=AFFINITY_VIEWS, what="affinity view")] = "shared"
    affinity_block_tokens: Annotated[int, Env("PROXY_AFFINITY_BLOCK_TOKENS", SELECTION, (
        "prompt-prefix blocks of this many tokens (× 4 characters) are hashed for plain OpenAI "
        "requests; with `PROXY_AFFINITY_TOKENIZER`, the engine's block size (128 on vLLM's CPU "
        "build, 16 on GPUs)"), ge=1, le=4096)] = 64
    affinity_max_blocks: Annotated[int, Env("PROXY_AFFINITY_MAX_BLOCKS", SELECTION, (
        "at most this many leading blocks a request (0 = no prefix affinity)"), ge=0, le=256)] = 32
    affinity_tokenizer: Annotated[str, Env("PROXY_AFFINITY_TOKENIZER", SELECTION, (
        "a model directory (`tokenizer.json`, chat template) to name blocks as the engine does, "
        "matching its KV cache events; needs the `engine-kv` extra (docs/architecture.md §4.4)"),
        rule=Rule.holds("a model directory (with tokenizer.json)", lambda v: not v or Path(v).is_dir()))] = ""
    affinity_engine_hash_seed: Annotated[str, Env("PROXY_AFFINITY_ENGINE_HASH_SEED", SELECTION, (
        "the engines' `PYTHONHASHSEED`, if they run with one (it seeds vLLM's block hashes); "
        "unset = vLLM's fixed seed"))] = ""
    kv_events: Annotated[str, Env("PROXY_KV_EVENTS", SELECTION, (
        "vLLM KV cache event publishers to follow (`tcp://` or `ipc://`) besides those found in "
        "an engine's `/kv_event_sources`; needs `PROXY_AFFINITY_TOKENIZER`"),
        rule=Rule.raises("instance_id=tcp://host:port,...", kv_event_endpoints))] = ""
    affinity_kv_mb_per_token: Annotated[float, Env("PROXY_AFFINITY_KV_MB_PER_TOKEN", SELECTION, (
        "MB of KV a token takes: turns a capacity in GB (`meta.kv_mem_gb`, else "
        "`PROXY_KV_MEM_PER_INSTANCE_GB`) into tokens where no `meta.kv_capacity_tokens` is "
        "registered; default: the profiles' `kv.transfer_mb_per_token`"),
        gt=0, finite=True)] = 0.096
    retry_attempts: Annotated[int, Env("PROXY_RETRY_ATTEMPTS", SELECTION, (
        "tries on another instance when one fails before anything reached the client"),
        ge=0, le=5)] = 1
    eject_after_failures: Annotated[int, Env("PROXY_EJECT_AFTER_FAILURES", SELECTION, (
        "a worker leaves an instance out for `PROXY_EJECT_S` after this many failures in a row "
        "(0 = never)"), ge=0, le=1000)] = 3
    eject_s: Annotated[float, Env("PROXY_EJECT_S", SELECTION, "for this long", gt=0)] = 10.0

    # --- instances and the upstream ---
    instance_ttl_s: Annotated[float, Env("PROXY_INSTANCE_TTL_S", INSTANCES, (
        "alive while the last heartbeat (or resource snapshot) is at most this old; instances are "
        "told to heartbeat every min(10, max(1, TTL ÷ 3)) s"), gt=0)] = 30.0
    instance_purge_grace_s: Annotated[float, Env("PROXY_INSTANCE_PURGE_GRACE_S", INSTANCES, (
        "dead this much longer → purged: slot freed, generation bumped"), ge=0)] = 60.0
    static_instances: Annotated[str, Env("PROXY_STATIC_INSTANCES", INSTANCES, (
        "engines the sidecar registers and probes itself (no agent): comma-separated "
        "`http://host:port[=id]`, no path ([operations.md](operations.md) §9)"),
        rule=Rule.raises("url[=id],...", parse_static_instances))] = ""
    static_probe_s: Annotated[float, Env("PROXY_STATIC_PROBE_S", INSTANCES, (
        "how often the sidecar probes each static instance's `GET /health`; each probe gives up "
        "after min(1 s, this)"), ge=0.1, le=3600)] = 2.0
    instance_cp_port_offset: Annotated[int, Env("PROXY_INSTANCE_CP_PORT_OFFSET", INSTANCES, (
        "an instance's control plane (KV inject) is at port + offset, unless it registers "
        "`meta.cp_port`"))] = 1
    upstream_connect_timeout_s: Annotated[float, Env("PROXY_UPSTREAM_CONNECT_TIMEOUT_S", INSTANCES,
                                                     "connecting to an instance", gt=0)] = 5.0
    upstream_first_byte_timeout_s: Annotated[float, Env("PROXY_UPSTREAM_FIRST_BYTE_TIMEOUT_S", INSTANCES,
                                                        "until the instance's response head (504 after)",
                                                        gt=0)] = 600.0
    upstream_idle_timeout_s: Annotated[float, Env("PROXY_UPSTREAM_IDLE_TIMEOUT_S", INSTANCES, (
        "the longest silence inside a response (the answer is cut after)"), gt=0)] = 120.0
    upstream_pool_size: Annotated[int, Env("PROXY_UPSTREAM_POOL_SIZE", INSTANCES, (
        "idle keep-alive connections a worker keeps per instance; also the aiohttp limit for KDN "
        "and instance control-plane calls"))] = 256
    max_body_bytes: Annotated[int, Env("PROXY_MAX_BODY_BYTES", INSTANCES,
                                       "larger request bodies get 413 (the default is 8 MiB)",
                                       gt=0)] = 8 * 1024 * 1024
    openai_api_key: Annotated[str | None, Env("OPENAI_API_KEY", INSTANCES, (
        "sent to instances as `Authorization: Bearer ...`, replacing the client's; unset: the "
        "client's is forwarded (docs/protocol.md §2.4)"))] = None

    # --- the prepare/ready pipeline ---
    prepare_concurrency: Annotated[int, Env("PREPARE_CONCURRENCY", PIPELINE, (
        "knowledge preparations at once per instance, per worker"), **QUEUE_BOUND)] = 8
    ready_concurrency: Annotated[int, Env("READY_CONCURRENCY", PIPELINE, (
        "requests forwarded to one instance at once, **host-wide** (all workers together); also "
        "the timelines' slots per instance; above an engine's own limit where it queues the rest"),
        **QUEUE_BOUND)] = 8
    ready_release_policy: Annotated[str, Env("PROXY_READY_RELEASE_POLICY", PIPELINE, (
        "`text_bypass`: text requests may pass a head still preparing (docs/architecture.md "
        "§5.2)"), choices=RELEASE_POLICIES, what="release policy")] = "ordered"
    text_bypass_max_per_flush: Annotated[int, Env("PROXY_TEXT_BYPASS_MAX_PER_FLUSH", PIPELINE,
                                                  "how many may pass per release round",
                                                  **QUEUE_BOUND)] = 1
    max_queue_per_instance: Annotated[int, Env("PROXY_MAX_QUEUE_PER_INSTANCE", PIPELINE, (
        "requests one worker lets wait per instance (prepare + ready) before answering 429"),
        **QUEUE_BOUND)] = 256
    queue_timeout_s: Annotated[float, Env("PROXY_QUEUE_TIMEOUT_S", PIPELINE, (
        "longest wait for preparation and admission before 503"), gt=0)] = 60.0

    # --- knowledge and predictions ---
    injection_strategy: Annotated[str, Env("PROXY_INJECTION_STRATEGY", KNOWLEDGE, (
        "`default` uses the Scheduler's `Injection_type`; `iws` decides text or kvcache per "
        "request (docs/architecture.md §5.4)"), choices=INJECTION_STRATEGIES,
        what="injection strategy")] = "default"
    iws_kdn_queue_penalty_alpha: Annotated[float, Env("IWS_KDN_QUEUE_PENALTY_ALPHA", KNOWLEDGE, (
        "IWS: weight of the KV link's queue wait against kvcache"))] = 0.5
    iws_decision_margin_ms: Annotated[float, Env("IWS_DECISION_MARGIN_MS", KNOWLEDGE,
                                                 "IWS: kvcache must win by this much")] = 100.0
    kdn_default_bandwidth_mbps: Annotated[float, Env("KDN_DEFAULT_BANDWIDTH_MBPS", KNOWLEDGE, (
        "a KDN → instance link neither measured nor in `PROXY_KDN_LINKS_JSON` (docs/protocol.md "
        "§5.5)"), gt=0)] = 1000.0
    kdn_links_refresh_s: Annotated[float, Env("PROXY_KDN_LINKS_REFRESH_S", KNOWLEDGE, (
        "how often each worker copies the links instances measured from the sidecar"), gt=0)] = 5.0
    kdn_timeout_s: Annotated[float, Env("PROXY_KDN_TIMEOUT_S", KNOWLEDGE, "the KDN search call", gt=0)] = 10.0
    kv_inject_timeout_s: Annotated[float, Env("PROXY_KV_INJECT_TIMEOUT_S", KNOWLEDGE,
                                              "the instance's KV inject call", gt=0)] = 60.0
    predictor_profile: Annotated[str, Env("PROXY_PREDICTOR_PROFILE", KNOWLEDGE, (
        "a profile in `proxy_workers/predictors/profiles/` by name, or a path to a JSON file "
        "([predictors.md](predictors.md))"))] = "llama3-70b-8x5090"

    # --- shared memory, events, metrics ---
    shm_name: Annotated[str, Env("PROXY_SHM_NAME", SHARED_MEMORY, (
        "the segment's name (`/dev/shm/cacheroute_proxy`)"),
        rule=Rule.holds("/name (one leading slash, no other)",
                        lambda v: v.startswith("/") and "/" not in v[1:]))] = "/cacheroute_proxy"
    shm_instance_capacity: Annotated[int, Env("PROXY_SHM_INSTANCE_CAPACITY", SHARED_MEMORY, (
        "instance slots; past it, registration answers 507"), ge=1, le=4096)] = 256
    shm_worker_capacity: Annotated[int, Env("PROXY_SHM_WORKER_CAPACITY", SHARED_MEMORY, (
        "worker rows; at least the workers (one more lets a rolling restart start a replacement "
        "before its predecessor exits)"), ge=1, le=1024)] = 64
    event_ring_capacity: Annotated[int, Env("PROXY_EVENT_RING_CAPACITY", SHARED_MEMORY,
                                            "events per worker ring", ge=64, le=1 << 20)] = 1024
    event_poll_ms: Annotated[float, Env("PROXY_EVENT_POLL_MS", SHARED_MEMORY,
                                        "how often the sidecar drains the rings", gt=0)] = 5.0
    reaper_interval_s: Annotated[float, Env("PROXY_REAPER_INTERVAL_S", SHARED_MEMORY, (
        "how often the sidecar looks for dead workers; one it watches (pidfd) is reaped as it "
        "exits"), gt=0)] = 1.0
    metrics_dir: Annotated[str, Env("PROXY_METRICS_DIR", SHARED_MEMORY, (
        "the workers' metrics files, summed at each scrape (docs/operations.md §3.3); made if "
        "missing (0700), else the worker exits 2 or the launch 1. Unset: "
        "`/tmp/cacheroute-metrics-<segment name>`"))] = ""

    # --- security ---
    cp_token_file: Annotated[str | None, Env("PROXY_CP_TOKEN_FILE", SECURITY, (
        "file holding the control-plane bearer token (preferred: not in the environment)"),
        rule=Rule.raises("a readable file, not empty", read_token_file))] = None
    cp_token: Annotated[str | None, Env("PROXY_CP_TOKEN", SECURITY,
                                        "the token itself, if no file is given")] = None
    debug_requires_token: Annotated[bool, Env("PROXY_DEBUG_REQUIRES_TOKEN", SECURITY, (
        "also require it for `/debug/*`, the instance list and `/metrics`, on the control plane "
        "and every worker"))] = False

    # --- registration with the Scheduler control plane (docs/protocol.md §6), from the sidecar ---
    scheduler_cp_url: Annotated[str | None, Env("SCHEDULER_CP_URL", SCHEDULER, (
        "the Scheduler's control plane; unset = no registration (logged once)"),
        rule=http_url("http://127.0.0.1:7002"))] = None
    proxy_id: Annotated[str | None, Env("PROXY_ID", SCHEDULER, (
        "the id the proxy registers under; unset: `hp_<advertised host>:<port>`, the original's"))] = None
    advertise_host: Annotated[str | None, Env("PROXY_ADVERTISE_HOST", SCHEDULER, (
        "where the Scheduler sends requests; unset: `PROXY_DP_HOST` (the machine's name if a "
        "wildcard)"))] = None
    advertise_port: Annotated[int | None, Env("PROXY_ADVERTISE_PORT", SCHEDULER, (
        "unset: `PROXY_DP_PORT`, the port every worker shares"), **PORT)] = None
    scheduler_heartbeat_s: Annotated[float, Env("PROXY_HEARTBEAT_S", SCHEDULER, (
        "heartbeat interval when the register reply names none"), gt=0)] = 5.0
    scheduler_timeout_s: Annotated[float, Env("PROXY_SCHEDULER_TIMEOUT_S", SCHEDULER,
                                              "every Scheduler call's timeout", gt=0)] = 5.0
    scheduler_backoff_max_s: Annotated[float, Env("PROXY_SCHEDULER_BACKOFF_MAX_S", SCHEDULER, (
        "retry backoff cap (from 0.5 s, doubling)"), gt=0)] = 30.0
    max_capacity: Annotated[int, Env("PROXY_MAX_CAPACITY", SCHEDULER, (
        "advertised as `max_capacity`; also `pool_resource.load.capacity` (for `load_ratio` and "
        "`queue_pressure`)"), ge=0)] = 8
    instance_count: Annotated[int | None, Env("PROXY_INSTANCE_COUNT", SCHEDULER, (
        "advertised `instance_count`; unset = instances alive when registering"), ge=0)] = None
    kv_mem_per_instance_gb: Annotated[float, Env("PROXY_KV_MEM_PER_INSTANCE_GB", SCHEDULER, (
        "advertised; also the KV capacity modelled for an instance registering neither "
        "`meta.kv_capacity_tokens` nor `meta.kv_mem_gb`"), ge=0)] = 128.0
    kv_cache_update_policy: Annotated[str, Env("PROXY_KV_CACHE_UPDATE_POLICY", SCHEDULER,
                                               "advertised")] = "lru"
    kdn_links: Annotated[dict[str, dict[str, Any]], Env("PROXY_KDN_LINKS_JSON", SCHEDULER, (
        "static `{\"kdn://host:port\": {metrics}}`: the links KV transfers are estimated over "
        "when unmeasured and, overlaid by the links instances report, what the Scheduler is told "
        "(docs/protocol.md §5.5, §6.2)"),
        rule=Rule.raises("a bandwidth_mbps > 0, a latency_ms or rtt_ms >= 0", check_kdn_links))] = {}

    # --- OpenTelemetry spans (docs/operations.md, tracing): the SDK's standard names; the SDK
    # itself reads the others (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...) ---
    otel_exporter_otlp_endpoint: Annotated[str | None, Env("OTEL_EXPORTER_OTLP_ENDPOINT", TRACING, (
        "set, every worker exports spans to `<URL>/v1/traces`; unset (and the next one too), no "
        "span is built and the client's `traceparent` passes untouched"),
        rule=http_url("http://127.0.0.1:4318"))] = None
    otel_exporter_otlp_traces_endpoint: Annotated[str | None, Env(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", TRACING,
        "the same for traces only, as a full URL; wins over the one above",
        rule=http_url("http://127.0.0.1:4318/v1/traces"))] = None
    otel_sdk_disabled: Annotated[bool, Env("OTEL_SDK_DISABLED", TRACING,
                                           "`true`: no spans whatever the endpoints say")] = False

    def __post_init__(self) -> None:
        for field in FIELDS:
            check(field, getattr(self, field.name))
        _check_across(self)

    @property
    def otel_traces_on(self) -> bool:
        """Spans are built and exported: an OTLP endpoint is set and the SDK is not disabled."""
        return bool(self.otel_exporter_otlp_endpoint or self.otel_exporter_otlp_traces_endpoint) \
            and not self.otel_sdk_disabled

    @property
    def kv_event_endpoints(self) -> dict[str, str]:
        """PROXY_KV_EVENTS as {instance id: ZMQ endpoint}."""
        return kv_event_endpoints(self.kv_events)

    @property
    def static_targets(self) -> tuple[StaticInstance, ...]:
        return parse_static_instances(self.static_instances)

    @property
    def ui_address(self) -> tuple[str, int] | None:
        """(host, port) of the dashboard's own listener, None when there is none."""
        return host_port(self.ui_listen) if self.ui_listen else None

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
    def snapshot_heartbeat_s(self) -> float:
        """How often a quiet sidecar republishes its (unchanged) snapshot: a quarter of the
        staleness bound, so a live sidecar is never read as stale, and an idle one wakes for it
        a few times a second, not a hundred."""
        return self.snapshot_stale_ms / 4000

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
        given = {name: convert(FIELD[name], value) for name, value in overrides.items() if value is not None}
        if not given:
            return self
        return msgspec.structs.replace(self, **given)

    def to_env(self) -> dict[str, str]:
        """Environment that reproduces these settings in a child process."""
        values = {f.env.var: getattr(self, f.name) for f in FIELDS}
        return {var: to_text(value) for var, value in values.items() if value is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from the environment; an empty variable is the same as an unset one."""
        environ = os.environ if environ is None else environ
        for var, why in RETIRED.items():
            if environ.get(var, "") != "":
                raise ConfigError(f"{var} is no longer read: {why}; unset it")
        given = {f.name: environ[f.env.var] for f in FIELDS if environ.get(f.env.var, "") != ""}
        return cls(**{name: read(FIELD[name], text) for name, text in given.items()})


FIELDS = fields_of(Settings)
FIELD = {f.name: f for f in FIELDS}
ENV_NAMES: dict[str, str] = {f.name: f.env.var for f in FIELDS}


# --- rules that join two settings -------------------------------------------------------------------
def _check_across(s: Settings) -> None:
    _refuse(s.workers <= s.shm_worker_capacity, "workers",
            f"{s.workers} exceeds the shared table's worker capacity (PROXY_SHM_WORKER_CAPACITY "
            f"{s.shm_worker_capacity})")
    tokened = bool(s.cp_token or s.cp_token_file)
    _refuse(is_loopback(s.cp_host) or tokened, "cp_host",
            f"{s.cp_host} is not a loopback address: anyone who reaches it could register an "
            f"instance or remove one, so a control plane bound beyond loopback needs a token "
            f"(PROXY_CP_TOKEN_FILE or PROXY_CP_TOKEN)")
    if s.ui_address is not None:
        host, port = s.ui_address
        _refuse(port not in (s.cp_port, s.dp_port), "ui_listen",
                f"port {port} is already the control plane's or the data plane's")
        _refuse(is_loopback(host) or tokened, "ui_listen",
                f"{host} is not a loopback address: like the control plane, a dashboard bound "
                f"beyond loopback needs a token (PROXY_CP_TOKEN_FILE or PROXY_CP_TOKEN)")
    _refuse(not s.kv_event_endpoints or bool(s.affinity_tokenizer), "kv_events",
            "needs PROXY_AFFINITY_TOKENIZER: without the engine's tokenizer the workers' prefix "
            "keys are not the engine's blocks")


def _refuse(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{ENV_NAMES[field]}: {message}")
