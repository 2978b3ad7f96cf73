"""``python -m sim_kdn``: command line -> KdnConfig + knowledge store -> server.run."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sim_kdn.config import (
    ConfigError,
    KdnConfig,
    kdn_config_from_mapping,
    knobs_from_mapping,
)
from sim_kdn.server import run
from sim_kdn.store import KnowledgeStore, StoreError, generate_store, load_store


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim_kdn",
                                description="Simulated KDN (knowledge server).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9101)
    p.add_argument("--kdn-id", default=None, help="default kdn_{host}:{port}")
    store = p.add_argument_group("knowledge store")
    store.add_argument("--knowledge", default=None, metavar="FILE.json",
                       help='JSON list of {"id","content","kv_ready"}; default: generated')
    store.add_argument("--knowledge-count", type=int, default=200,
                       help="generated store: ids k0000.. (default 200)")
    store.add_argument("--kv-ready-ratio", type=float, default=0.5,
                       help="generated store: share of ids with prebuilt KV (default 0.5)")
    store.add_argument("--seed", type=int, default=0, help="generated store: content seed")
    sim = p.add_argument_group("simulation")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="multiplies every simulated duration (0.05 = 20x faster)")
    sim.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, default=2.0)
    sim.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"])
    knobs = p.add_argument_group("knobs (also settable at run time: POST /sim/config)")
    knobs.add_argument("--rtt-ms", type=float, default=1.0)
    knobs.add_argument("--bandwidth-mbps", type=float, default=1000.0)
    knobs.add_argument("--link-efficiency", type=float, default=0.825)
    knobs.add_argument("--kv-bytes-per-token", type=int, default=96_000)
    knobs.add_argument("--fail-status", type=int, default=None)
    knobs.add_argument("--hang", action="store_true")
    knobs.add_argument("--fault-on", choices=["all", "search", "inject"], default="all",
                       help="which routes fail_status and hang apply to")
    return p


KNOB_FLAGS = ("rtt_ms", "bandwidth_mbps", "link_efficiency", "kv_bytes_per_token",
              "fail_status", "hang", "fault_on")


def config_from_args(argv: Sequence[str] | None = None) -> tuple[KdnConfig, KnowledgeStore]:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        knobs = knobs_from_mapping({name: args.pop(name) for name in KNOB_FLAGS})
        raw: dict[str, Any] = {**args, "knobs": knobs}
        config = kdn_config_from_mapping(raw)
        if config.knowledge is not None:
            store = load_store(config.knowledge)
        else:
            store = generate_store(config.knowledge_count, config.kv_ready_ratio, config.seed)
        return config, store
    except (ConfigError, StoreError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    config, store = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [kdn {config.resolved_kdn_id}] %(name)s: %(message)s")
    logging.getLogger(__name__).info("knowledge store: %s", store.summary())
    run(config, store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
