"""kv_aware on real engines: this proxy's kv_aware and least_load, vllm-router
(cache_aware, kv_aware) and the SGLang router (cache_aware) over the same two CPU vLLM engines
(docs/benchmarks.md).

    python -m bench.affinity_vllm --out bench/results/affinity_vllm.json
        [--requests 600] [--loads 0.4,0.6] [--repeats 2] [--contenders NAME,...]
        [--saturation-rps R] [--max-tokens 32] [--seed 1]
        [--proxy-env PROXY_X=v ...] [--kv-aware-env PROXY_X=v ...]
        [--variant NAME:PROXY_X=v,PROXY_Y=w ...] [--outcomes DIR]

Needs .venv-vllm and the tiny model (`make install-vllm`) and the peers' venvs (`make peers`);
`make bench-affinity-vllm` makes all three first. Everything it starts is stopped by pid (the
engines by process group) also on Ctrl-C or an error."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.harness.cli import name_values, stop_on_sigterm
from bench.harness.results import (git_commit, machine_info, run_record, uncommitted_changes, utc_now,
                                   write_report)
from tests.real_engine.engines import TINY_MODEL, stop_engines

from . import contenders, engine_side, figures, runner, targets, workload

MAX_TOKENS = 32
CALIBRATION_REQUESTS = 300
CALIBRATION_CONCURRENCY = 16  # twice the engines' slots (2 × max_num_seqs 4): a queue, never an idle slot


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.affinity_vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity_vllm.json"))
    parser.add_argument("--requests", type=int, default=600, help="streaming chats per run")
    parser.add_argument("--loads", default="0.4,0.6",
                        help="offered loads, as shares of least_load's measured saturation throughput")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each contender per load (ABC…CBA)")
    parser.add_argument("--contenders", default=",".join(s.name for s in contenders.SPECS),
                        help="comma-separated, in this order (default: all of them)")
    parser.add_argument("--saturation-rps", type=float, default=None,
                        help="skip the calibration and take this as least_load's saturation (req/s)")
    parser.add_argument("--calibration-requests", type=int, default=CALIBRATION_REQUESTS)
    parser.add_argument("--calibration-concurrency", type=int, default=CALIBRATION_CONCURRENCY)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens decoded per request (ignore_eos)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--proxy-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for both proxy contenders (repeatable)")
    parser.add_argument("--kv-aware-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the kv_aware contender only (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:NAME=VALUE,...",
                        help="also run kv_aware with these settings, as contender 'kv_aware NAME' "
                             "(repeatable; weighed beside the default, not judged by the targets)")
    parser.add_argument("--outcomes", type=Path, default=None, metavar="DIR",
                        help="also write each run's requests (planned send, system prompt, instance, "
                             "TTFT, kv_aware's account) into DIR, a JSON-lines file a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()  # a timeout or kill unwinds through every `with`: what it started stops
    variants = [contenders.variant(text) for text in args.variant]
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    names += [v.name for v in variants if v.name not in names]
    for name in names:
        contenders.spec(name, variants)  # an unknown name fails here, before the engines start
    loads = [float(x) for x in args.loads.split(",")]
    started_at, machine = utc_now(), machine_info()
    tokenizer = workload.load_tokenizer(TINY_MODEL)
    prompts = workload.system_prompts(tokenizer, args.seed)
    planned = workload.plan(tokenizer, args.seed, max(args.requests, args.calibration_requests))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_affinity_vllm_"))
    if args.outcomes is not None:
        args.outcomes.mkdir(parents=True, exist_ok=True)
    print(f"{len(names)} contenders × {args.repeats} runs × {len(loads)} loads of {args.requests} requests; "
          f"logs in {log_dir}", flush=True)
    engines = engine_side.start(log_dir)
    try:
        setup = runner.Setup(engines, prompts, args.max_tokens, log_dir,
                             {**dict(contenders.PROXY_ENV), **name_values(args.proxy_env)},
                             name_values(args.kv_aware_env), variants, args.outcomes)
        engine = engine_side.describe(engines)
        if args.saturation_rps is None:
            calibration = runner.calibrate(setup, planned[:args.calibration_requests], args.calibration_concurrency)
            print(f"calibration: least_load saturates at {calibration['saturation_rps']} req/s", flush=True)
        else:
            calibration = {"given": True, "saturation_rps": args.saturation_rps}
        runs, failed = runner.run_all(names, setup, planned[:args.requests], loads, args.repeats,
                                      calibration["saturation_rps"])
    finally:
        stop_engines(engines)
    results = figures.aggregate(runs)
    report = {
        **run_record("bench.affinity_vllm", argv, started_at, {**machine, "at_end": {"loadavg": os.getloadavg()}}),
        "commit": git_commit(), "uncommitted_changes": uncommitted_changes(),
        "seed": args.seed, "requests_per_run": args.requests, "loads": loads, "repeats": args.repeats,
        "max_tokens": args.max_tokens, "contenders": names, "workers": contenders.WORKERS,
        "profile": contenders.PROFILE, "proxy_env": setup.proxy_env, "kv_aware_env": setup.kv_aware_env,
        "variants": {v.name: dict(v.env) for v in variants},
        "workload": {"system_prompts": len(prompts), "system_prompt_tokens": workload.SYSTEM_TOKENS,
                     "user_tokens": workload.USER_TOKENS, "zipf_s": workload.ZIPF_S,
                     "arrivals": "Poisson, open loop"},
        "engine": engine, "calibration": calibration,
        "results": results, "targets": targets.as_records(targets.judge(results)),
        "runs": runs, "failed_starts": failed, "logs": str(log_dir),
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
