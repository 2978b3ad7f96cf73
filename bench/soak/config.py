"""The soak's knobs (SoakConfig) and the command line that sets them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench.soak


@dataclass
class SoakConfig:
    duration_s: float = 600.0        # load duration (the warm-up is part of it)
    warmup_s: float = 20.0           # RSS baselines are taken once this old
    clients: int = 20
    workers: int = 4
    instances: int = 3
    time_scale: float = 0.2
    think_max_s: float = 0.3         # uniform 0..this between a client's requests
    max_tokens: tuple[int, int] = (8, 64)
    prompt_tokens: tuple[int, int] = (16, 600)
    stream_share: float = 0.6
    scheduler_share: float = 0.5
    cancel_rate: float = 0.10
    flap_interval_s: float = 20.0
    restart_every: int = 3           # every Nth flap event restarts the flapper's process
    restart_down_s: float = 2.0      # how long the flapper stays stopped
    kill_interval_s: float = 60.0
    kill_offset_s: float = 45.0
    kill_jitter_s: float = 10.0      # each kill time moves by a seeded uniform -j..+j, so kills
    #                                  land both while the flapper answers 503 and while it serves
    max_kills: int | None = None
    kill_grace_s: float = 2.0        # a headless connection error this soon after a kill is its
    chaos_quiet_tail_s: float = 10.0  # no chaos event starts in the last N s of the load
    status_sample_s: float = 2.0
    rss_sample_s: float = 5.0
    rss_min_lifetime_s: float = 60.0
    rss_growth_limit_pct: float = 10.0
    check_rss: bool = True
    quiesce_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    seed: int = 1
    strategy: str = "least_load"     # the proxy's PROXY_INSTANCE_STRATEGY
    # kv_aware only: this share of plain chats lead with one of SYSTEM_PROMPTS shared system
    # prompts, so its claims, homes and shared leading keys are at work through the chaos
    system_prompt_share: float = 0.7
    log_dir: str | None = None


def parse_args(argv: list[str] | None = None) -> tuple[SoakConfig, Path | None]:
    """The configuration the command line asks for, and where to write the JSON report."""
    p = argparse.ArgumentParser(prog="python -m bench.soak",
                                description=(bench.soak.__doc__ or "").split("\n\n")[0])
    d = SoakConfig()

    def knob(flag: str, field: str, **kw: Any) -> None:
        """A flag that sets SoakConfig.<field>; its type and default are the field's."""
        default = getattr(d, field)
        p.add_argument(flag, dest=field, metavar=flag[2:].upper().replace("-", "_"),
                       type=type(default), default=default, **kw)

    knob("--duration", "duration_s", help="seconds of load (default 600)")
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    knob("--clients", "clients")
    knob("--time-scale", "time_scale")
    knob("--warmup", "warmup_s")
    knob("--flap-interval", "flap_interval_s")
    knob("--restart-every", "restart_every")
    knob("--kill-interval", "kill_interval_s")
    knob("--kill-offset", "kill_offset_s")
    knob("--kill-jitter", "kill_jitter_s")
    knob("--kill-grace", "kill_grace_s")
    knob("--cancel-rate", "cancel_rate")
    knob("--quiesce-timeout", "quiesce_timeout_s")
    knob("--rss-limit", "rss_growth_limit_pct")
    p.add_argument("--no-rss-check", dest="check_rss", action="store_false")
    knob("--seed", "seed")
    p.add_argument("--strategy", dest="strategy", default=d.strategy, choices=("least_load", "kv_aware"))
    p.add_argument("--log-dir", dest="log_dir", default=None, help="process logs (default: a new /tmp directory)")
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    return SoakConfig(**args), out
