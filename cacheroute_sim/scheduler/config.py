"""Start-time config and run-time knobs of the simulated Scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from cacheroute_sim.common.knobs import KnobsBase
from cacheroute_sim.common.validation import ConfigError, require, struct_from_mapping

__all__ = ["ConfigError", "FaultOn", "Knobs", "SchedulerConfig", "config_from_mapping"]

FaultOn = Literal["all", "register", "heartbeat", "unregister"]


class Knobs(KnobsBase, frozen=True):
    # Told to every proxy in the register reply (the original Scheduler says 5 s / 30 s);
    # tests make it short so heartbeats come fast.
    heartbeat_interval_s: float = 5.0
    ttl_s: float = 30.0
    # Answer with this status instead of serving (on the routes fault_on selects).
    fail_status: int | None = None
    # Accept and never answer until POST /sim/release (on the routes fault_on selects).
    hang: bool = False
    fault_on: FaultOn = "all"

    def __post_init__(self) -> None:
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0")
        require(self.ttl_s > 0, "ttl_s must be > 0")
        require(self.fail_status is None or 400 <= self.fail_status <= 599,
                "fail_status must be an HTTP error status (400..599) or null")

    def faults(self, route: str) -> bool:
        return self.fault_on in ("all", route)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 7002
    scheduler_id: str | None = None
    time_scale: float = 1.0  # the shared simulation flag; nothing here is timed by it
    shutdown_grace_s: float = 2.0
    log_level: str = "info"
    log_format: str = "text"  # or "json", as the proxy's processes (cacheroute_proxy/logs.py)
    knobs: Knobs = msgspec.field(default_factory=Knobs)

    def __post_init__(self) -> None:
        require(0 < self.port < 65536, "port must be a TCP port (1..65535)")
        require(self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0")

    @property
    def resolved_id(self) -> str:
        return self.scheduler_id or f"sched_{self.host}:{self.port}"


def config_from_mapping(raw: Mapping[str, Any]) -> SchedulerConfig:
    return struct_from_mapping(SchedulerConfig, raw)
