"""The agent's options: command-line flags, each with an environment variable, validated once."""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Sequence
from urllib.parse import urlsplit

import msgspec

from cacheroute_proxy.auth import load_token
from cacheroute_proxy.config import LOG_FORMATS, ConfigError

# flag destination -> environment variable (PROXY_CP_URL and the token as the simulated
# instance and the original Instances read them)
ENV_NAMES = {
    "instance_url": "INSTANCE_URL",
    "proxy_cp_url": "PROXY_CP_URL",
    "instance_id": "INSTANCE_ID",
    "cp_token": "PROXY_CP_TOKEN",
    "cp_token_file": "PROXY_CP_TOKEN_FILE",
    "kdn_targets": "INSTANCE_KDN_TARGETS",
    "max_num_seqs": "INSTANCE_MAX_NUM_SEQS",
    "health_interval_s": "INSTANCE_HEALTH_INTERVAL_S",
    "heartbeat_interval_s": "INSTANCE_HEARTBEAT_INTERVAL_S",
    "resource_interval_s": "INSTANCE_RESOURCE_INTERVAL_S",
    "topology_interval_s": "INSTANCE_TOPOLOGY_INTERVAL_S",
    "default_link_mbps": "INSTANCE_DEFAULT_LINK_BW_MBPS",
    "log_level": "PROXY_LOG_LEVEL",
    "log_format": "PROXY_LOG_FORMAT",
}


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    instance_url: str                      # the engine, e.g. http://127.0.0.1:8000
    proxy_cp_url: str = "http://127.0.0.1:8002"
    instance_id: str | None = None         # default hp_{host}:{port}, as the proxy names it
    cp_token: str | None = None
    kdn_targets: tuple[str, ...] = ()      # host:port of each KDN server to measure
    max_num_seqs: int | None = None        # the engine's --max-num-seqs, when the operator knows it
    health_interval_s: float = 0.5         # how often the engine's /health is asked
    heartbeat_interval_s: float | None = None  # None: what the proxy's register reply says
    resource_interval_s: float = 10.0
    topology_interval_s: float = 30.0
    default_link_mbps: float = 1000.0      # a link whose interface reports no speed
    log_level: str = "info"
    log_format: str = "text"               # or json, as the proxy's processes (cacheroute_proxy/logs.py)

    @property
    def engine_host(self) -> str:
        return urlsplit(self.instance_url).hostname or ""

    @property
    def engine_port(self) -> int:
        url = urlsplit(self.instance_url)
        return url.port or (443 if url.scheme == "https" else 80)

    @property
    def resolved_instance_id(self) -> str:
        return self.instance_id or f"hp_{self.engine_host}:{self.engine_port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheroute-proxy instance-agent",
                                description="Register an OpenAI-compatible engine with the proxy "
                                            "and keep the proxy told about it.")
    env = os.environ.get

    def option(flag: str, dest: str, **kw: object) -> None:
        name = ENV_NAMES[dest]
        p.add_argument(flag, dest=dest, default=env(name) or None,
                       help=f"{kw.pop('help')} (env {name})", **kw)  # type: ignore[arg-type]

    option("--instance-url", "instance_url", help="the engine's base URL, e.g. http://127.0.0.1:8000")
    option("--proxy-cp-url", "proxy_cp_url", help="the proxy's control plane (default http://127.0.0.1:8002)")
    option("--instance-id", "instance_id", help="default hp_{host}:{port}")
    option("--cp-token", "cp_token", help="bearer token of the proxy's control plane")
    option("--cp-token-file", "cp_token_file", help="file holding that token (preferred)")
    option("--kdn-targets", "kdn_targets", help="comma-separated host:port of KDN servers to measure")
    option("--max-num-seqs", "max_num_seqs", help="the engine's --max-num-seqs (sent as meta.max_num_seqs)")
    option("--health-interval", "health_interval_s", help="seconds between /health probes (default 0.5)")
    option("--heartbeat-interval", "heartbeat_interval_s", help="seconds; default: the proxy's")
    option("--resource-interval", "resource_interval_s", help="seconds between resource snapshots (default 10)")
    option("--topology-interval", "topology_interval_s", help="seconds between topology reports (default 30)")
    option("--default-link-mbps", "default_link_mbps", help="bandwidth of a link whose NIC reports none (default 1000)")
    option("--log-level", "log_level", help="default info")
    option("--log-format", "log_format", help="text (default) or json: one JSON object per line")
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """The options, or ConfigError naming the flag and its variable."""
    args = vars(build_parser().parse_args(argv))
    token_file = args.pop("cp_token_file")
    args["cp_token"] = load_token(args["cp_token"], token_file)
    raw = {k: v for k, v in args.items() if v is not None}
    if "kdn_targets" in raw:
        raw["kdn_targets"] = tuple(t.strip() for t in str(raw["kdn_targets"]).split(",") if t.strip())
    if "instance_url" not in raw:
        raise ConfigError("--instance-url (INSTANCE_URL) is required")
    try:
        config = msgspec.convert(raw, AgentConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_name_the_option(str(exc))) from None
    _check(config)
    return config


def _check(config: AgentConfig) -> None:
    for name in ("instance_url", "proxy_cp_url"):
        url = urlsplit(getattr(config, name))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"--{name.replace('_', '-')} ({ENV_NAMES[name]}): an http(s) URL "
                              f"such as http://127.0.0.1:8000, got {getattr(config, name)!r}")
    for target in config.kdn_targets:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--kdn-targets ({ENV_NAMES['kdn_targets']}): host:port, got {target!r}")
    for name in ("health_interval_s", "resource_interval_s", "topology_interval_s", "default_link_mbps"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{ENV_NAMES[name]}: must be > 0")
    if config.heartbeat_interval_s is not None and config.heartbeat_interval_s <= 0:
        raise ConfigError(f"{ENV_NAMES['heartbeat_interval_s']}: must be > 0")
    if config.log_format not in LOG_FORMATS:
        raise ConfigError(f"--log-format ({ENV_NAMES['log_format']}): one of {LOG_FORMATS}, got {config.log_format!r}")
    if config.max_num_seqs is not None and not 0 < config.max_num_seqs <= 65536:
        raise ConfigError(f"{ENV_NAMES['max_num_seqs']}: must be 1..65536")


def _name_the_option(message: str) -> str:
    for field, var in ENV_NAMES.items():
        if f"`$.{field}`" in message:
            return f"--{field.removesuffix('_s').replace('_', '-')} ({var}): {message}"
    return message
