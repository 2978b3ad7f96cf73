"""Typed configuration of the simulated KDN.

Like the instance's: :class:`KdnConfig` is fixed at start (address, store, time scale);
:class:`Knobs` (network model and faults) are set by CLI flags at start and replaced at run
time through ``POST /sim/config`` (held in a :class:`cacheroute_sim.common.knobs.KnobStore`).
A bad value fails at once with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from cacheroute_sim.common.knobs import KnobsBase
from cacheroute_sim.common.validation import ConfigError, require, struct_from_mapping

# ConfigError is re-exported: callers and tests catch cacheroute_sim.kdn.config.ConfigError.
__all__ = ["ConfigError", "FaultOn", "KdnConfig", "Knobs", "kdn_config_from_mapping"]

FaultOn = Literal["all", "search", "inject"]

# Transfer model of the original Proxy's IWS: 0.096 MB of KV per
# token over a link used at 82.5 % of its nominal bandwidth. The defaults make the simulated
# transfer take exactly what the Proxy predicts.
DEFAULT_KV_BYTES_PER_TOKEN = 96_000
DEFAULT_LINK_EFFICIENCY = 0.825


class Knobs(KnobsBase, frozen=True):
    # Fixed cost of every search, inject and ping (request + reply propagation), in ms.
    rtt_ms: float = 1.0
    # Nominal link speed KDN -> instance/Redis; searches and KV transfers use it.
    bandwidth_mbps: float = 1000.0
    # Share of the nominal bandwidth a transfer really gets.
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    # KV bytes per knowledge token (tokens = ceil(chars / 4)).
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # Answer at once with this status instead of serving (on the routes fault_on selects).
    fail_status: int | None = None
    # Accept and never answer until POST /sim/release (on the routes fault_on selects).
    hang: bool = False
    fault_on: FaultOn = "all"

    def __post_init__(self) -> None:
        require(self.rtt_ms >= 0, "rtt_ms must be >= 0")
        require(self.bandwidth_mbps > 0, "bandwidth_mbps must be > 0")
        require(0 < self.link_efficiency <= 1, "link_efficiency must be within (0, 1]")
        require(self.kv_bytes_per_token >= 0, "kv_bytes_per_token must be >= 0")
        require(self.fail_status is None or 400 <= self.fail_status <= 599,
                "fail_status must be an HTTP error status (400..599) or null")

    def faults(self, route: Literal["search", "inject"]) -> bool:
        return self.fault_on in ("all", route)

    def transfer_ms(self, nbytes: int) -> float:
        """Real milliseconds to move ``nbytes`` over the link (before time_scale)."""
        bytes_per_ms = self.bandwidth_mbps * 1e6 / 8 * self.link_efficiency / 1000
        return nbytes / bytes_per_ms


class KdnConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 9101
    # None: kdn_{host}:{port}. Returned by POST /v1/topology/hello.
    kdn_id: str | None = None
    # JSON list of {"id", "content", "kv_ready"}; None: a generated store (store.py).
    knowledge: str | None = None
    knowledge_count: int = 200
    kv_ready_ratio: float = 0.5
    # Seed of the generated store (same seed, same store).
    seed: int = 0
    # Multiplies every simulated duration (0.05 = 20x faster).
    time_scale: float = 1.0
    shutdown_grace_s: float = 2.0
    log_level: str = "info"
    log_format: str = "text"  # or "json", as the proxy's processes (cacheroute_proxy/logs.py)
    knobs: Knobs = msgspec.field(default_factory=Knobs)

    def __post_init__(self) -> None:
        require(0 < self.port < 65536, "port must be a TCP port (1..65535)")
        require(self.time_scale >= 0, "time_scale must be >= 0")
        require(0 <= self.knowledge_count <= 100_000, "knowledge_count must be within 0..100000")
        require(0.0 <= self.kv_ready_ratio <= 1.0, "kv_ready_ratio must be within 0..1")
        require(self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0")

    @property
    def resolved_kdn_id(self) -> str:
        return self.kdn_id or f"kdn_{self.host}:{self.port}"


def kdn_config_from_mapping(raw: Mapping[str, Any]) -> KdnConfig:
    return struct_from_mapping(KdnConfig, raw)
