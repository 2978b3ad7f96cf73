"""A quick A/B probe of the worker's request hot path (`python -m bench.hotpath`).

One fast simulated instance (time scale 0: no simulated sleeping) and, over that same
process, these contenders (bench/harness/contenders.py starts and stops them by pid):

- `direct`: the instance itself, the baseline for added latency;
- `proxy-1w` / `proxy-2w`: this proxy through its supervisor with 1 and 2 workers;
- `base-1w` / `base-2w` (--baseline REF): the same proxy as it was at git REF (the whole tree
  at REF, exported, with the C extensions built here where REF's source of them is the same),
  for a before/after in one interleaved run;
- `floor` (--floor): the cheapest proxy this stack allows, one uvicorn+httptools process whose
  plain ASGI callable forwards the body through one pooled aiohttp session and relays the
  answer -- no validation, selection, shared table or metrics: what is left is the stack;
- `nginx-2w` (--nginx): nginx with 2 worker processes, for the throughput ratio.

Measured back to back, interleaved (for each repeat, each scenario, each contender, the order
rotated every repeat) with wrk and a POST Lua script:
- c1:  `wrk -t1 -c1`  p50 / p99 latency; added p50 = median over repeats of (contender p50 -
       direct p50) from the same repeat;
- c32: `wrk -t1 -c32` requests/s and CPU seconds per 1,000 requests (user+sys delta of the
       contender's whole process tree: supervisor, sidecar and workers for the proxy).
`--stream` adds the same two scenarios for a streaming request.

Short by default (3 s per point, 3 repeats, about a minute and a half): a smoke probe on a
busy machine, not the product benchmark. Every run is bounded (--budget) and stops every
process it started, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cacheroute_sim.processes import ROOT, ChildProcess, free_port
from bench.harness.backends import InstanceSpec, SimInstances
from bench.harness.contenders import Contender, DirectContender, NginxContender, ProxyContender
from bench.harness.processes import StartError, http_json, wait_for

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


# --- wrk ---------------------------------------------------------------------------------------
def lua_script(directory: Path, stream: bool, sdk_headers: bool = False) -> Path:
    path = directory / ("post_stream.lua" if stream else "post.lua")
    body = CHAT_BODY % (',"stream":true' if stream else "")
    headers = {"Content-Type": "application/json", **(SDK_HEADERS if sdk_headers else {})}
    path.write_text('wrk.method = "POST"\n'
                    f"wrk.body = '{body}'\n"
                    + "".join(f'wrk.headers["{name}"] = "{value}"\n' for name, value in headers.items()))
    return path


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS[unit]


def parse_wrk(out: str) -> dict[str, Any]:
    """requests, req/s, p50/p99 ms and error counts from `wrk --latency` output."""
    result: dict[str, Any] = {"errors": 0}
    for q in ("50", "99"):
        m = re.search(rf"^\s+{q}%\s+(\S+)", out, re.M)
        if m:
            result[f"p{q}_ms"] = round(_ms(m.group(1)), 4)
    m = re.search(r"(\d+) requests in", out)
    result["requests"] = int(m.group(1)) if m else 0
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    result["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["errors"] += int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    result["errors"] += sum(int(g) for g in m.groups()) if m else 0
    return result


def run_wrk(contender: Contender, lua: Path, connections: int, seconds: float) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s",
           "--latency", "-s", str(lua), contender.url + PATH]
    cpu_before = contender.cpu_seconds()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=False)
    cpu = contender.cpu_seconds() - cpu_before
    result = parse_wrk(done.stdout)
    result["cpu_s"] = round(cpu, 4)
    if result["requests"]:
        result["cpu_s_per_1k"] = round(cpu / result["requests"] * 1000, 4)
    if done.returncode != 0 or not result["requests"]:
        result["wrk_output"] = (done.stdout + done.stderr)[-600:]
    return result


# --- the floor: the thinnest proxy this stack allows -------------------------------------------
def serve_floor(port: int, upstream: str) -> None:
    """One uvicorn+httptools process: read the body, POST it upstream over one pooled aiohttp
    session, relay status, content type and body (streams chunk by chunk)."""
    import aiohttp
    import uvicorn

    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["s"] = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=256), auto_decompress=False)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["s"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        async with state["s"].post(upstream + scope["path"], data=body,
                                   headers={"Content-Type": "application/json"}) as response:
            headers = [(b"content-type", response.headers.get("Content-Type", "").encode())]
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="on")


class FloorContender(Contender):
    kind = "proxy"

    def __init__(self, name: str, instances: SimInstances) -> None:
        super().__init__(name)
        self.workers = 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._upstream = instances.urls[0]
        self._child: ChildProcess | None = None

    def start(self) -> None:
        log = Path(tempfile.mkdtemp(prefix="bench-floor-")) / "floor.log"
        self._child = child = ChildProcess(
            ["-m", "bench.hotpath", "--serve-floor", str(self.port), self._upstream], {}, log,
            die_with_parent=True)
        wait_for(lambda: http_json("GET", self.url + "/healthz")[0] == 200, 60, self.name,
                 child.running, child.tail)

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(signal.SIGTERM, timeout=10)

    def pids(self) -> list[int]:
        return [self._child.pid] if self._child and self._child.running() else []


# --- a baseline: the whole tree as it was at a git ref -------------------------------------------
def baseline_tree(ref: str, into: Path) -> Path:
    """The repository at `ref` (git archive: tracked files only, no results), run with today's
    interpreter and installed dependencies: an A/B of the whole product, across restructurings."""
    tree = into / f"baseline-{ref}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree), "--exclude=bench/results"], input=archive.stdout, check=True)
    _copy_built_extensions(tree)
    return tree


def _copy_built_extensions(tree: Path) -> None:
    """The C extensions built here, into the tree whose source of them is the same (an archive
    has no build products: without them the tree would run the slower Python fallback)."""
    for built in ROOT.glob("proxy_workers/*.so"):
        source = built.with_name(built.name.split(".")[0] + ".c")
        theirs = tree / source.relative_to(ROOT)
        if source.exists() and theirs.exists() and theirs.read_bytes() == source.read_bytes():
            shutil.copy2(built, tree / built.relative_to(ROOT))


def launcher_module(tree: Path) -> str:
    """The module that runs `... run` in that tree (`supervisor` before the product package)."""
    return "cacheroute_proxy" if (tree / "cacheroute_proxy" / "__main__.py").exists() else "supervisor"


class TreeProxyContender(ProxyContender):
    """ProxyContender whose supervisor (and so every worker it starts) runs from `tree`."""

    def __init__(self, name: str, instances: SimInstances, workers: int, strategy: str,
                 tree: Path, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(name, instances, workers, strategy, extra_env=extra_env)
        self.tree = tree

    def start(self) -> None:
        # `python -m` puts the working directory first on sys.path, and children inherit it.
        command = (f"cd {shlex.quote(str(self.tree))} && exec {shlex.quote(sys.executable)} "
                   f"-m {launcher_module(self.tree)} run")
        self._child = child = ChildProcess(["-c", command], self.env, self.log_dir / "supervisor.log",
                                           die_with_parent=True, program="/bin/sh")
        for i in range(self.ports.workers):
            wait_for(lambda i=i: http_json("GET", f"{self.ports.worker_url(i)}/healthz")[0] == 200,
                     60, f"{self.name} worker {i}", child.running, child.tail)
        for i in range(len(self.instances.urls)):
            self._register(i)
        wanted = set(self.instances.ids)
        for i in range(self.ports.workers):
            wait_for(lambda i=i: wanted <= self._alive_seen_by(i), 60,
                     f"{self.name} worker {i} sees every instance", child.running, child.tail)


# --- the run -----------------------------------------------------------------------------------
def scenarios(stream: bool) -> list[tuple[str, bool, int]]:
    found = [("json_c1", False, 1), (f"json_c{HIGH_CONCURRENCY}", False, HIGH_CONCURRENCY)]
    if stream:
        found += [("stream_c1", True, 1), (f"stream_c{HIGH_CONCURRENCY}", True, HIGH_CONCURRENCY)]
    return found


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "kernel": platform.release(),
                            "python": platform.python_version(), "loadavg": os.getloadavg()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        info["pressure_cpu"] = Path("/proc/pressure/cpu").read_text().strip()
    return info


def versions() -> dict[str, str]:
    from importlib.metadata import version

    found = {name: version(name) for name in ("uvicorn", "httptools", "uvloop", "starlette",
                                              "aiohttp", "msgspec")}
    found["wrk"] = subprocess.run(["wrk", "--version"], capture_output=True, text=True,
                                  check=False).stdout.strip().splitlines()[0]
    return found


def measure(contenders: list[Contender], args: argparse.Namespace, lua_dir: Path,
            deadline: float) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    luas = {stream: lua_script(lua_dir, stream, args.sdk_headers) for stream in (False, True)}
    for contender in contenders:  # warm up: connections, pools, code paths
        for stream in {False, args.stream}:
            run_wrk(contender, luas[stream], HIGH_CONCURRENCY, 1)
    for repeat in range(args.repeats):
        for name, stream, connections in scenarios(args.stream):
            shift = repeat % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                if time.monotonic() > deadline:
                    print(f"budget of {args.budget:g} s spent: stopping early", file=sys.stderr)
                    return runs
                result = run_wrk(contender, luas[stream], connections, args.seconds)
                runs[contender.name].append({"scenario": name, "repeat": repeat, **result})
                print(f"  r{repeat} {name:10} {contender.name:9} p50 {result.get('p50_ms', 0):7.3f} ms"
                      f"  {result['rps']:8.0f} req/s  cpu/1k {result.get('cpu_s_per_1k', 0):.3f}"
                      f"  errors {result['errors']}", file=sys.stderr, flush=True)
    return runs


def medians(runs: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_scenario.setdefault(run["scenario"], []).append(run)
    for scenario, rows in by_scenario.items():
        for metric in ("p50_ms", "p99_ms", "rps", "cpu_s_per_1k", "errors"):
            values = [r[metric] for r in rows if metric in r]
            if values:
                out[f"{scenario}.{metric}"] = round(statistics.median(values), 4)
        if scenario.endswith("_c1"):  # paired with direct in the same repeat
            base = {r["repeat"]: r.get("p50_ms") for r in direct if r["scenario"] == scenario}
            added = [r["p50_ms"] - base[r["repeat"]] for r in rows
                     if r.get("p50_ms") is not None and base.get(r["repeat"]) is not None]
            if added:
                out[f"{scenario}.added_p50_ms"] = round(statistics.median(added), 4)
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
        print(f"| {c['name']} | " + " | ".join(f"{m[k]:g}" if k in m else "-" for k in cols)
              + f" | {errors} |")


def build_contenders(args: argparse.Namespace, instances: SimInstances,
                     baseline: Path | None) -> list[Contender]:
    found: list[Contender] = [DirectContender("direct", instances)]
    if args.floor:
        found.append(FloorContender("floor", instances))
    env = {**PROXY_ENV, **dict(kv.split("=", 1) for kv in args.proxy_env)}
    base_env = {**env, **dict(kv.split("=", 1) for kv in args.base_env)}
    for workers in args.workers:
        if baseline is not None:
            found.append(TreeProxyContender(f"base-{workers}w", instances, workers, args.strategy,
                                            baseline, extra_env=base_env))
        found.append(ProxyContender(f"proxy-{workers}w", instances, workers, args.strategy,
                                    extra_env=env))
    if args.nginx:
        found.append(NginxContender("nginx-2w", instances, worker_processes=2, method="least_conn"))
    return found


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--floor", action="store_true", help="also the trivial uvicorn+aiohttp proxy")
    p.add_argument("--nginx", action="store_true", help="also nginx with 2 workers")
    p.add_argument("--baseline", metavar="GIT_REF", default=None,
                   help="also run the proxy as it was at this git ref (an A/B in one run)")
    p.add_argument("--time-scale", type=float, default=0.0, help="of the simulated instance")
    p.add_argument("--proxy-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the proxy contenders")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="for the --baseline contenders only, over --proxy-env (e.g. one setting "
                        "A/B on the same tree: --baseline HEAD --base-env NAME=VALUE)")
    p.add_argument("--budget", type=float, default=300.0, help="stop measuring after this many s")
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    p.add_argument("--serve-floor", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_floor:
        serve_floor(int(args.serve_floor[0]), args.serve_floor[1])
        return 0
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    if args.nginx and shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        print("nginx not found: apt-get install -y nginx-light", file=sys.stderr)
        return 2
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    deadline = time.monotonic() + args.budget
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: clean up
    try:
        # The temp dir outlives the contenders: a baseline proxy runs from inside it.
        with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp, contextlib.ExitStack() as stack:
            instances = stack.enter_context(SimInstances(
                [InstanceSpec(max_concurrency=512, extra_args=("--default-max-tokens", "8"))],
                time_scale=args.time_scale))
            baseline = baseline_tree(args.baseline, Path(tmp)) if args.baseline else None
            contenders = [stack.enter_context(c) for c in build_contenders(args, instances, baseline)]
            runs = measure(contenders, args, Path(tmp), deadline)
    except StartError as exc:
        print(f"a contender did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        return 130
    results = report(args, started_at, contenders, runs)
    print_table(results["contenders"], args.stream)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def report(args: argparse.Namespace, started_at: str, contenders: list[Contender],
           runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = [{**c.describe(), "runs": runs[c.name], "median": medians(runs[c.name], runs["direct"])}
            for c in contenders]
    nginx = next((r for r in rows if r["kind"] == "nginx"), None)
    ratios: dict[str, dict[str, float]] = {}
    if nginx is not None:
        for row in rows:
            ratios[row["name"]] = {k: round(v / nginx["median"][k], 3) for k, v in row["median"].items()
                                   if k.endswith((".rps", ".cpu_s_per_1k")) and nginx["median"].get(k)}
    return {
        "command": " ".join(["python -m bench.hotpath", *sys.argv[1:]]),
        "started_at": started_at, "machine": machine_info(), "versions": versions(),
        "method": {"tool": "wrk -t1 --latency -s post.lua, one thread, keep-alive",
                   "order": "per repeat: each scenario, each contender, order rotated each repeat",
                   "warmup": f"1 s at c{HIGH_CONCURRENCY} per contender", "repeats": args.repeats,
                   "seconds_per_point": args.seconds, "pinning": None,
                   "client_headers": "openai_sdk" if args.sdk_headers else "wrk",
                   "instance": f"one sim_instance, time scale {args.time_scale:g}, max_tokens 8",
                   "proxy_env": {**PROXY_ENV, **dict(kv.split("=", 1) for kv in args.proxy_env)},
                   "base_env": dict(kv.split("=", 1) for kv in args.base_env),
                   "cpu": "user+sys delta of the contender's process tree over the wrk run",
                   "added_p50": "median over repeats of (p50 - direct p50 of the same repeat)"},
        "contenders": rows, "ratios_to_nginx": ratios,
        "notes": ["smoke probe on a shared 2-core machine: read orders of magnitude, not digits"],
    }


if __name__ == "__main__":
    sys.exit(main())
