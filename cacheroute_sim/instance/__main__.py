"""``python -m cacheroute_sim.instance``: command line -> SimConfig -> server.run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from cacheroute_sim.common import cli
from cacheroute_sim.instance.config import Knobs, SimConfig, sim_config_from_mapping
from cacheroute_sim.instance.server import run


def build_parser() -> argparse.ArgumentParser:
    p = cli.new_parser("python -m cacheroute_sim.instance", "Simulated OpenAI-compatible vLLM Instance.",
                       port=9001, id_flag="--instance-id", id_help="default hp_{host}:{port}")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="the context length GET /v1/models reports (default 4096)")
    reg = p.add_argument_group("registration with the Proxy control plane")
    reg.add_argument("--proxy-cp-url", default=os.environ.get("PROXY_CP_URL") or
                     "http://127.0.0.1:8002", help="env PROXY_CP_URL")
    reg.add_argument("--no-register", dest="register", action="store_false")
    reg.add_argument("--register-token", default=os.environ.get("PROXY_CP_TOKEN") or None,
                     help="Bearer token for control-plane calls (env PROXY_CP_TOKEN)")
    reg.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float,
                     default=None, help="seconds; overrides the register reply's interval")
    reg.add_argument("--resource-interval", dest="resource_interval_s", type=float, default=0.0,
                     help="seconds between resource snapshots of the simulated machine, as an agent "
                          "sends them; 0 (default): none")
    cp = p.add_argument_group("instance control plane (KV inject)")
    cp.add_argument("--cp-port", type=int, default=None,
                    help="default: --port + 1 (skipped with a warning if that port is taken); "
                         "0 disables the control plane")
    cp.add_argument("--redis-host", default=os.environ.get("INSTANCE_REDIS_HOST") or "127.0.0.1",
                    help="Redis target handed to the KDN, never connected to "
                         "(env INSTANCE_REDIS_HOST)")
    cp.add_argument("--redis-port", type=int,
                    default=os.environ.get("INSTANCE_REDIS_PORT") or 6379,
                    help="env INSTANCE_REDIS_PORT")
    cp.add_argument("--redis-db", type=int, default=os.environ.get("INSTANCE_REDIS_DB") or 0,
                    help="env INSTANCE_REDIS_DB")
    cp.add_argument("--redis-password", default=os.environ.get("INSTANCE_REDIS_PASSWORD") or None,
                    help="env INSTANCE_REDIS_PASSWORD")
    cp.add_argument("--kdn-timeout", dest="kdn_timeout_s", type=float, default=60.0,
                    help="seconds allowed for one KDN inject call (default 60)")
    cp.add_argument("--kv-mem-gb", type=float, default=128.0,
                    help="KV memory registered (meta.kv_mem_gb); sizes the KV kept unless "
                         "--kv-capacity-tokens is given (default 128)")
    cp.add_argument("--kdn-kv-bytes-per-token", type=int, default=96_000,
                    help="bytes of KV a token in the KDN's payload_bytes, to size each injected "
                         "id's KV (default 96000, the simulated KDN's)")
    cp.add_argument("--report-resident", action="store_true",
                    help="heartbeats carry resident_keys: the knowledge ids whose KV is held")
    cli.add_simulation_group(p, _engine_flags)
    knobs = p.add_argument_group("fault knobs (also settable at run time: POST /sim/config)")
    knobs.add_argument("--slow-factor", type=float, default=1.0)
    knobs.add_argument("--hang", action="store_true")
    knobs.add_argument("--fail-status", type=int, default=None)
    knobs.add_argument("--fail-rate", type=float, default=1.0)
    knobs.add_argument("--drop-after-chunks", type=int, default=None)
    knobs.add_argument("--stall-after-chunks", type=int, default=None)
    knobs.add_argument("--hold-streams", action="store_true")
    knobs.add_argument("--default-max-tokens", type=int, default=16)
    knobs.add_argument("--response-header", dest="response_headers", metavar="NAME:VALUE",
                       action=_HeaderAction, default={},
                       help="add this header to every generation answer (repeatable)")
    knobs.add_argument("--request-id-headers", action="store_true",
                       help="answer with X-Request-Id, the request's or a new one (as vLLM's "
                            "--enable-request-id-headers)")
    kv = p.add_argument_group("KV kept (also settable at run time: POST /sim/config)")
    kv.add_argument("--kv-capacity-tokens", type=int, default=None,
                    help="knowledge KV held at most, in tokens (default: --kv-mem-gb over "
                         "3.81e-5 GB a token); least recently used ids are evicted")
    kv.add_argument("--prefix-caching", action="store_true",
                    help="cache prompt blocks of 16 tokens, as vLLM's automatic prefix caching")
    kv.add_argument("--prefix-cache-blocks", type=int, default=None,
                    help="prefix-cache blocks held at most (default: the KV capacity / 16)")
    kv.add_argument("--cached-prefill-factor", type=float, default=0.1,
                    help="cost of a cached token's prefill against computing it (default 0.1)")
    return p


class _HeaderAction(argparse.Action):
    """``--response-header NAME:VALUE``, repeatable, into one dict (validated with the knobs)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        name, sep, value = str(values).partition(":")
        if not sep:
            parser.error(f"{option_string}: expected NAME:VALUE, got {values!r}")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), name.strip(): value.strip()})


def _engine_flags(sim: cli.ArgGroup) -> None:
    sim.add_argument("--max-concurrency", type=int, default=8)
    sim.add_argument("--seed", type=int, default=None, help="seed for fail_rate draws")


def config_from_args(argv: Sequence[str] | None = None) -> SimConfig:
    # Every knob flag above is named after its Knobs field (cli.parse_config pairs them).
    return cli.parse_config(build_parser(), argv, Knobs, sim_config_from_mapping)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    cli.configure_logging(config.log_level, config.log_format, f"sim {config.resolved_instance_id}")
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
