"""Paced streams through the proxy: what relaying them, and waiting at the ready gate, costs.

    python -m bench.gate_wait --out bench/results/gate_wait.json [--workers 2] [--streams 16]
        [--seconds 8] [--rounds 3] [--baseline REF]

One OpenAI fake (bench/peers/openai_fake.py) that sends a stream's 32 tokens 20 ms apart, as
an engine sends one per decode step; the proxy (least_load, READY_CONCURRENCY at its default 8)
in front of it; `--streams` clients streaming back to back: with 16, about half of them wait at
the host-wide gate at any time, most for a place another worker frees; with 8, none. Per
window: streams done, TTFT p50, and the CPU of the proxy's tree per relayed token, by role. With
`--baseline REF` the product at that ref too, interleaved (A B B A ...), in one run."""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from bench.harness.ab import ab_parser, interleaved, trees
from bench.harness.backends import FakeInstances, InstanceSpec
from bench.harness.cli import stop_on_sigterm
from bench.harness.contenders import ProxyContender
from bench.harness.cpu import charged
from bench.harness.results import Run, write_report
from bench.peers.stream_load import run_process

TOKENS = 32
TOKEN_INTERVAL_MS = 20
WARMUP_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = ab_parser("python -m bench.gate_wait", __doc__.split("\n")[0], "bench/results/gate_wait.json",
                       workers=2, seconds=8.0, rounds=3, seconds_help="one window")
    parser.add_argument("--streams", type=int, default=16, help="clients streaming back to back")
    return parser


def window(contender: ProxyContender, streams: int, seconds: float) -> dict[str, Any]:
    result = charged(contender, lambda: run_process(contender.url, streams, seconds, TOKENS))
    tokens = result["streams_ok"] * TOKENS
    return {"streams_ok": result["streams_ok"], "errors": result["errors"],
            "ttft_p50_ms": result.get("ttft_p50_ms"), "cpu_s": result["cpu_s"],
            "cpu_s_by_role": result.get("cpu_s_by_role", {}),
            "cpu_us_per_token": round(1e6 * result["cpu_s"] / tokens, 1) if tokens else None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()  # a timeout or kill unwinds through every `with`: what it started stops
    run = Run("bench.gate_wait", argv)
    contenders = trees(args.baseline)
    windows: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    spec = InstanceSpec(extra_args=("--token-interval-ms", str(TOKEN_INTERVAL_MS)))
    with FakeInstances([spec]) as instances:
        for round_index, name in interleaved(list(contenders), args.rounds):
            with ProxyContender(name, instances, args.workers, "least_load", tree=contenders[name]) as contender:
                run_process(contender.url, args.streams, WARMUP_S, TOKENS)
                result = window(contender, args.streams, args.seconds)
            print(f"round {round_index + 1}: {name}: {result}", flush=True)
            windows[name].append(result)
    results = {name: {"cpu_us_per_token_median": statistics.median(w["cpu_us_per_token"] for w in ws),
                      "windows": ws} for name, ws in windows.items()}
    write_report(args.out, {**run.record(), "workers": args.workers, "streams": args.streams,
                            "seconds": args.seconds, "rounds": args.rounds, "tokens": TOKENS,
                            "token_interval_ms": TOKEN_INTERVAL_MS, "baseline_ref": args.baseline,
                            "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
