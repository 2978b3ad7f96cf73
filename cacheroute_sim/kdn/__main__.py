"""``python -m cacheroute_sim.kdn``: command line -> KdnConfig + knowledge store -> server.run."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from cacheroute_sim.common import cli
from cacheroute_sim.kdn.config import KdnConfig, Knobs, kdn_config_from_mapping
from cacheroute_sim.kdn.server import run
from cacheroute_sim.kdn.store import KnowledgeStore, StoreError, generate_store, load_store


def build_parser() -> argparse.ArgumentParser:
    p = cli.new_parser("python -m cacheroute_sim.kdn", "Simulated KDN (knowledge server).",
                       port=9101, id_flag="--kdn-id", id_help="default kdn_{host}:{port}")
    store = p.add_argument_group("knowledge store")
    store.add_argument("--knowledge", default=None, metavar="FILE.json",
                       help='JSON list of {"id","content","kv_ready"}; default: generated')
    store.add_argument("--knowledge-count", type=int, default=200,
                       help="generated store: ids k0000.. (default 200)")
    store.add_argument("--kv-ready-ratio", type=float, default=0.5,
                       help="generated store: share of ids with prebuilt KV (default 0.5)")
    store.add_argument("--seed", type=int, default=0, help="generated store: content seed")
    cli.add_simulation_group(p)
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


def config_from_args(argv: Sequence[str] | None = None) -> tuple[KdnConfig, KnowledgeStore]:
    # Every knob flag above is named after its Knobs field (cli.parse_config pairs them);
    # a store that cannot be loaded is a usage error too.
    return cli.parse_config(build_parser(), argv, Knobs, _config_and_store, (StoreError,))


def _config_and_store(raw: dict[str, Any]) -> tuple[KdnConfig, KnowledgeStore]:
    config = kdn_config_from_mapping(raw)
    if config.knowledge is not None:
        return config, load_store(config.knowledge)
    return config, generate_store(config.knowledge_count, config.kv_ready_ratio, config.seed)


def main(argv: Sequence[str] | None = None) -> int:
    config, store = config_from_args(argv)
    cli.configure_logging(config.log_level, config.log_format, f"kdn {config.resolved_kdn_id}")
    logging.getLogger("cacheroute_sim.kdn").info("knowledge store: %s", store.summary())
    run(config, store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
