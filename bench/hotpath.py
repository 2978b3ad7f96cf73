"""A quick A/B probe of the worker's request hot path (`python -m bench.hotpath`).

One fast simulated instance (time scale 0: no simulated sleeping) and, over that same
process, these contenders (bench/harness/contenders.py starts and stops them by pid):

- `direct`: the instance itself, the baseline for added latency;
- `proxy-1w` / `proxy-2w`: this proxy through its supervisor with 1 and 2 workers;
- `base-1w` / `base-2w` (--baseline REF): the same proxy as it was at git REF (the whole tree
  at REF, exported, with the C extensions built here where REF's source of them is the same:
  bench/harness/baseline.py), for a before/after in one interleaved run;
- `floor` (--floor): the relay floor of bench-peers (bench/peers/relay_floor.py), the product's
  own server and forward client with nothing of the product between them, 2 processes: what
  is left is the stack;
- `nginx-2w` (--nginx): nginx with 2 worker processes, for the throughput ratio.

Measured back to back, interleaved (for each repeat, each scenario, each contender, the order
rotated every repeat) with wrk and a POST Lua script:
- c1:  `wrk -t1 -c1`  p50 / p99 latency; added p50 = median over repeats of (contender p50 -
       direct p50) from the same repeat;
- c32: `wrk -t1 -c32` requests/s and CPU seconds per 1,000 requests (user+sys delta of the
       contender's whole process tree: supervisor, sidecar and workers for the proxy, also
       by role).
`--stream` adds the same two scenarios for a streaming request.

Short by default (3 s per point, 3 repeats, about a minute and a half): a smoke probe on a
busy machine, not the product benchmark. Every run is bounded (--budget) and stops every
process it started, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.backends import InstanceSpec, SimInstances
from bench.harness.baseline import baseline_tree
from bench.harness.cli import measured, name_values, stop_on_sigterm
from bench.harness.contenders import (Contender, DirectContender, NginxContender, ProxyContender,
                                      RelayFloorContender, rotated)
from bench.harness.results import Run, git_commit, tool_versions, write_report
from bench.harness.stats import median, ratio
from bench.harness.wrk import run_wrk, wrk_point, wrk_post_script

CHAT_BODY = ('{"model":"sim-model","messages":[{"role":"user","content":"Say something short."}],'
             '"max_tokens":8%s}')
PATH = "/v1/chat/completions"
HIGH_CONCURRENCY = 32
# The host-wide ready admission (READY_CONCURRENCY, 8 by default: a vLLM batch) would queue
# 24 of the 32 connections inside the proxy, which nginx does not do: raised here so the probe
# measures the hot path, not that gate (--proxy-env READY_CONCURRENCY=8 puts it back).
PROXY_ENV = {"READY_CONCURRENCY": "64"}


# What the OpenAI Python SDK sends besides Host, Content-Type and Content-Length (--sdk-headers):
# the headers a real client makes the worker filter and forward to the instance.
SDK_HEADERS = {
    "Accept": "application/json", "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive",
    "User-Agent": "OpenAI/Python 1.40.0", "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "1.40.0", "X-Stainless-OS": "Linux", "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython", "X-Stainless-Runtime-Version": "3.12.3",
    "Authorization": "Bearer sk-hotpath-0000000000000000", "X-Stainless-Async": "false",
    "X-Stainless-Retry-Count": "0",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}


def lua_script(directory: Path, stream: bool, sdk_headers: bool = False) -> Path:
    return wrk_post_script(directory / ("post_stream.lua" if stream else "post.lua"),
                           CHAT_BODY % (',"stream":true' if stream else ""), PATH,
                           SDK_HEADERS if sdk_headers else None)


# --- the run -----------------------------------------------------------------------------------
def scenarios(stream: bool) -> list[tuple[str, bool, int]]:
    found = [("json_c1", False, 1), (f"json_c{HIGH_CONCURRENCY}", False, HIGH_CONCURRENCY)]
    if stream:
        found += [("stream_c1", True, 1), (f"stream_c{HIGH_CONCURRENCY}", True, HIGH_CONCURRENCY)]
    return found


def measure(contenders: list[Contender], args: argparse.Namespace, lua_dir: Path,
            deadline: float) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    luas = {stream: lua_script(lua_dir, stream, args.sdk_headers) for stream in (False, True)}
    for contender in contenders:  # warm up: connections, pools, code paths
        for stream in {False, args.stream}:
            run_wrk(contender.url, luas[stream], HIGH_CONCURRENCY, 1)
    for repeat in range(args.repeats):
        for name, stream, connections in scenarios(args.stream):
            for contender in rotated(contenders, repeat):
                if time.monotonic() > deadline:
                    print(f"budget of {args.budget:g} s spent in repeat {repeat + 1} of {args.repeats}: "
                          "stopping early (--budget)", file=sys.stderr)
                    return runs
                result = wrk_point(contender, luas[stream], connections, args.seconds)
                runs[contender.name].append({"scenario": name, "repeat": repeat, **result})
                print(f"  r{repeat} {name:10} {contender.name:9} p50 {result.get('p50_ms') or 0:7.3f} ms"
                      f"  {result['rps']:8.0f} req/s  cpu/1k {result.get('cpu_s_per_1k', 0):.3f}"
                      f"  errors {result['errors']}", file=sys.stderr, flush=True)
    return runs


def whole_repeats(runs: dict[str, list[dict[str, Any]]], scenario_count: int) -> int:
    """The repeats in which every contender measured every scenario (--budget may cut the last)."""
    points: dict[int, int] = {}
    for contender_runs in runs.values():
        for run in contender_runs:
            points[run["repeat"]] = points.get(run["repeat"], 0) + 1
    whole = len(runs) * scenario_count
    return sum(1 for count in points.values() if count == whole)


def medians(runs: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_scenario.setdefault(run["scenario"], []).append(run)
    for scenario, rows in by_scenario.items():
        for metric in ("p50_ms", "p99_ms", "rps", "cpu_s_per_1k", "errors"):
            if any(metric in r for r in rows):
                out[f"{scenario}.{metric}"] = median(r.get(metric) for r in rows)
        if scenario.endswith("_c1"):  # paired with direct in the same repeat
            base = {r["repeat"]: r.get("p50_ms") for r in direct if r["scenario"] == scenario}
            added = [r["p50_ms"] - base[r["repeat"]] for r in rows
                     if r.get("p50_ms") is not None and base.get(r["repeat"]) is not None]
            if added:
                out[f"{scenario}.added_p50_ms"] = median(added)
    return out


def print_table(contenders: list[dict[str, Any]], stream: bool) -> None:
    cols = []
    for name, _, connections in scenarios(stream):
        cols += [f"{name}.p50_ms", f"{name}.p99_ms", f"{name}.added_p50_ms"] if connections == 1 \
            else [f"{name}.rps", f"{name}.cpu_s_per_1k"]
    print("| contender | " + " | ".join(cols) + " | errors |")
    print("|---" * (len(cols) + 2) + "|")
    for c in contenders:
        m = c["median"]
        errors = sum(r["errors"] for r in c["runs"])
        print(f"| {c['name']} | " + " | ".join(f"{m[k]:g}" if m.get(k) is not None else "-" for k in cols)
              + f" | {errors} |")


def build_contenders(args: argparse.Namespace, instances: SimInstances,
                     baseline: Path | None) -> list[Contender]:
    found: list[Contender] = [DirectContender("direct", instances)]
    if args.floor:
        found.append(RelayFloorContender("floor", instances))
    env = {**PROXY_ENV, **name_values(args.proxy_env)}
    for workers in args.workers:
        if baseline is not None:
            found.append(ProxyContender(f"base-{workers}w", instances, workers, args.strategy,
                                        extra_env={**env, **name_values(args.base_env)}, tree=baseline,
                                        python=args.base_python))
        found.append(ProxyContender(f"proxy-{workers}w", instances, workers, args.strategy,
                                    extra_env=env))
    if args.nginx:
        found.append(NginxContender("nginx-2w", instances, worker_processes=2, method="least_conn"))
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                   help="proxy contenders by worker count (default 1,2)")
    p.add_argument("--strategy", default="round_robin")
    p.add_argument("--seconds", type=float, default=3.0, help="per measured point")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="also a streaming request")
    p.add_argument("--sdk-headers", action="store_true",
                   help="send the headers the OpenAI Python SDK sends (user agent, x-stainless-*, "
                        "authorization, traceparent), which the proxy forwards")
    p.add_argument("--floor", action="store_true",
                   help="also the relay floor (the product's server and client, nothing between)")
    p.add_argument("--nginx", action="store_true", help="also nginx with 2 workers")
    p.add_argument("--baseline", metavar="GIT_REF", default=None,
                   help="also run the proxy as it was at this git ref (an A/B in one run)")
    p.add_argument("--time-scale", type=float, default=0.0, help="of the simulated instance")
    p.add_argument("--proxy-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the proxy contenders")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="for the --baseline contenders only, over --proxy-env (e.g. one setting "
                        "A/B on the same tree: --baseline HEAD --base-env NAME=VALUE)")
    p.add_argument("--base-python", metavar="PATH", default=None,
                   help="run the --baseline contenders on this interpreter, whose environment holds "
                        "the product's dependencies (an interpreter A/B: --baseline HEAD)")
    p.add_argument("--budget", type=float, default=300.0, help="stop measuring after this many s")
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    if args.nginx and shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        print("nginx not found: apt-get install -y nginx-light", file=sys.stderr)
        return 2
    provenance = Run("bench.hotpath", argv)
    baseline_commit = git_commit(args.baseline) if args.baseline else None  # before HEAD moves
    deadline = time.monotonic() + args.budget
    stop_on_sigterm()

    def work() -> tuple[list[Contender], dict[str, list[dict[str, Any]]]]:
        # The temp dir outlives the contenders: a baseline proxy runs from inside it.
        with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp, contextlib.ExitStack() as stack:
            instances = stack.enter_context(SimInstances(
                [InstanceSpec(max_concurrency=512, extra_args=("--default-max-tokens", "8"))],
                time_scale=args.time_scale))
            baseline = baseline_tree(args.baseline, Path(tmp)) if args.baseline else None
            contenders = [stack.enter_context(c) for c in build_contenders(args, instances, baseline)]
            return contenders, measure(contenders, args, Path(tmp), deadline)

    done, code = measured(work)
    if done is None:
        return code
    contenders, runs = done
    results = report(args, provenance, contenders, runs, baseline_commit)
    print_table(results["contenders"], args.stream)
    if args.out:
        write_report(args.out, results, indent=1)
    return 0


def report(args: argparse.Namespace, provenance: Run, contenders: list[Contender],
           runs: dict[str, list[dict[str, Any]]], baseline_commit: str | None = None) -> dict[str, Any]:
    rows = [{**c.describe(), "runs": runs[c.name], "median": medians(runs[c.name], runs["direct"])}
            for c in contenders]
    nginx = next((r for r in rows if r["kind"] == "nginx"), None)
    ratios: dict[str, dict[str, float | None]] = {}
    if nginx is not None:
        for row in rows:
            ratios[row["name"]] = {k: ratio(v, nginx["median"].get(k), 3) for k, v in row["median"].items()
                                   if k.endswith((".rps", ".cpu_s_per_1k")) and nginx["median"].get(k)}
    return {
        **provenance.record(),
        "baseline_commit": baseline_commit,  # what --baseline named then (kept out of the report)
        "versions": tool_versions(("uvloop", "httptools", "aiohttp", "msgspec"), (("wrk", "--version"),)),
        "method": {"tool": "wrk -t1 -s post.lua, one thread, keep-alive",
                   "order": "per repeat: each scenario, each contender, order rotated each repeat",
                   "warmup": f"1 s at c{HIGH_CONCURRENCY} per contender",
                   "repeats": whole_repeats(runs, len(scenarios(args.stream))), "repeats_asked": args.repeats,
                   "seconds_per_point": args.seconds, "pinning": None,
                   "client_headers": "openai_sdk" if args.sdk_headers else "wrk",
                   "instance": f"one sim_instance, time scale {args.time_scale:g}, max_tokens 8",
                   "proxy_env": {**PROXY_ENV, **name_values(args.proxy_env)},
                   "base_env": name_values(args.base_env),
                   "python": _interpreter(sys.executable),
                   "base_python": _interpreter(args.base_python) if args.base_python else None,
                   "cpu": "user+sys delta of the contender's process tree over the wrk run",
                   "added_p50": "median over repeats of (p50 - direct p50 of the same repeat)"},
        "contenders": rows, "ratios_to_nginx": ratios,
        "notes": ["smoke probe on a shared 2-core machine: read orders of magnitude, not digits"],
    }


def _interpreter(path: str) -> str:
    """The interpreter at `path`: its real file and the version it reports."""
    done = subprocess.run([path, "-c", "import sys; print(sys.version.split()[0])"],
                          capture_output=True, text=True, check=False)
    return f"{os.path.realpath(path)} {done.stdout.strip() or '(did not start)'}"


if __name__ == "__main__":
    sys.exit(main())
