"""The policies by name: the original Proxy's names and aliases (PROXY_INSTANCE_STRATEGY takes
any of them, case and surrounding blanks aside) and the one place that builds a policy."""

from __future__ import annotations

from typing import Mapping

from .kv_aware import KvAwarePolicy, Pricing
from .least_load import LeastLoadPolicy
from .policy import Cursor, Policy
from .round_robin import RoundRobinPolicy

# Any accepted name -> the policy's own name.
ALIASES: dict[str, str] = {
    "round_robin": "round_robin", "round-robin": "round_robin", "rr": "round_robin",
    "least_load": "least_load", "least-load": "least_load", "ll": "least_load",
    "kv_aware": "kv_aware", "kv-aware": "kv_aware", "kv": "kv_aware",
}


def build_policy(name: str, *, weights: Mapping[str, float] | None = None,
                 cursor: Cursor | None = None, tie_cursor: Cursor | None = None,
                 kv_aware: Mapping[str, float | bool] | None = None, pricing: Pricing | None = None,
                 native: bool = True) -> Policy:
    """The policy `name` (or an alias) stands for; any other name is a ValueError at start.
    `weights`: least_load's (and kv_aware's) overrides; `kv_aware`: KvAwarePolicy's settings
    (balance_abs, balance_rel, prompt_balance_abs, work_weight, prompt_work_weight,
    slot_guard); `pricing`: the worker's, for kv_aware; `native`: False keeps least_load's C
    selector out even where the install built it (benchmarks compare)."""
    canonical = ALIASES.get(name.strip().lower())
    if canonical == "round_robin":
        return RoundRobinPolicy(cursor)
    if canonical == "least_load":
        return LeastLoadPolicy(weights, cursor, tie_cursor, native=native)
    if canonical == "kv_aware":
        return KvAwarePolicy(weights, cursor, tie_cursor, pricing=pricing, native=native,
                             **(kv_aware or {}))
    raise ValueError(f"unknown instance strategy {name!r}; choose one of {sorted(ALIASES)}")
