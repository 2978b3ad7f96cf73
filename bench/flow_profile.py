"""Where this proxy's CPU goes on plain requests in flow, by function
(`python -m bench.flow_profile --out bench/results/flow_profile.json`).

bench.pipeline_cost profiles a worker in one process with no client socket, under cProfile,
whose fixed cost per call makes often-called functions weigh more than they do. This asks the
running proxy, on bench-peers' plain-request point: its instances (sim or starlette), this
proxy as it runs there (`proxy-w2-ll`: 2 workers, least_load) and the relay floor
(`relay-floor-w2`), wrk at c32 with keep-alive and its chat body; or, with `--load stream`, its
long-stream point (16 clients streaming 256 tokens each, bench.peers.stream_load), where a
"request" is one whole stream. For each contender two points of the same length: one
unprofiled, for its CPU per request by role, user and system time apart (/proc); then one with
py-spy sampling every process of its tree, Python and native frames (`--native`).

System time is the kernel's (socket reads and writes, epoll, wake-ups): one row. User time is
split by py-spy's samples. py-spy counts a thread blocked in epoll (or in waitpid, as the floor's parent) as running, and
it catches threads inside syscalls far more often than their system time says (it stops a
process to read its stacks), so samples in a wait or a read/write syscall are left out; each remaining sample
is its innermost Python frame's (own time, the C it calls included), except one inside uvloop,
libuv or asyncio's C (the loop between callbacks, a transport's write): that is the event
loop's native work, whoever called it. A function's share of those samples times the role's user time
per request is its µs per request. Layers: "kernel (system time)"; "event loop (native)";
"HTTP/1 relay" (cacheroute_proxy/http1 and the floor's glue: what the floor runs too);
"product" (proxy_workers, sidecar, shm_schema, routing and the rest of cacheroute_proxy);
"Python and libraries" (asyncio's Python, the standard library, others' Python).

py-spy stops a process for each sample; the profiled point's req/s against the unprofiled
one's says how much it disturbed the run: the shares are what it measured, the µs come from the
unprofiled point. Needs py-spy (the `bench` extra) and the right to ptrace the proxy's
processes (root, or kernel.yama.ptrace_scope 0). Bounded: two points a contender, each
`--seconds` long.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import psutil

from bench.harness.cli import Progress, measured, stop_on_sigterm
from bench.harness.contenders import Contender
from bench.harness.cpu import process_tree, user_system_s
from bench.harness.results import Run, tool_versions, write_report
from bench.harness.wrk import run_wrk
from bench.peers import stream_load
from bench.peers.measure import write_script
from bench.peers.plan import BACKENDS, KNOWN, RunConfig
from bench.peers.runner import instances_for

CONTENDERS = ("proxy-w2-ll", "relay-floor-w2")

KERNEL = "kernel (system time)"
LOOP = "event loop (native)"
RELAY = "HTTP/1 relay"
PRODUCT = "product"
LIBRARIES = "Python and libraries"
LAYERS = (KERNEL, LOOP, RELAY, PRODUCT, LIBRARIES)

# Innermost native frames that are the kernel's: a wait (py-spy counts a blocked thread as
# running) or a read or write (system time, counted apart).
_IN_KERNEL = frozenset({"epoll_wait", "epoll_pwait", "epoll_pwait2", "wait4", "waitid", "poll", "ppoll",
                        "select", "pselect6", "nanosleep", "clock_nanosleep", "futex",
                        "read", "write", "readv", "writev", "recv", "send", "recvfrom", "sendto",
                        "recvmsg", "sendmsg"})
_RELAY_FILES = ("cacheroute_proxy/http1/", "bench/peers/relay_floor.py")
_PRODUCT_FILES = ("proxy_workers/", "sidecar/", "shm_schema/", "cacheroute_proxy/")
# Native code of the event loop: uvloop's and libuv's sources and asyncio's C module, by the file
# (or library) py-spy names for a native frame.
_LOOP_SOURCES = frozenset({"loop.c", "linux.c", "stream.c", "core.c", "tcp.c", "timer.c", "uv-common.c",
                           "async.c", "signal.c", "_asynciomodule.c"})
_LOOP_LIBRARIES = ("loop.cpython-", "_asyncio.cpython-")


@dataclass(frozen=True)
class Frame:
    """One frame of a py-spy raw stack: `function (file:line)`, or `function (library)` for a
    native one."""

    function: str
    file: str

    @classmethod
    def parse(cls, text: str) -> "Frame":
        head, sep, where = text.rpartition(" (")
        if not sep:
            return cls(text, "")
        return cls(head, where.rstrip(")").rsplit(":", 1)[0])

    @property
    def label(self) -> str:
        return f"{self.function} ({self.file})" if self.file else self.function

    @property
    def python(self) -> bool:
        return self.file.endswith(".py") or self.file.startswith("<frozen")


EVENT_LOOP = Frame("uvloop, libuv and _asyncio", "native")


def parse_raw(text: str) -> list[tuple[list[Frame], int]]:
    """py-spy's `--format raw` (collapsed stacks: `outer;...;inner count` a line) as stacks of
    frames, outermost first, with their sample counts."""
    stacks = []
    for line in text.splitlines():
        stack, sep, count = line.rstrip().rpartition(" ")
        if sep and stack and count.isdigit():
            stacks.append(([Frame.parse(f) for f in stack.split(";")], int(count)))
    return stacks


def user_frame(frames: list[Frame]) -> Frame | None:
    """The frame a sample's user time is charged to: the event loop's (EVENT_LOOP) when it is
    in the loop's native code, else its innermost Python frame; None for a sample in the kernel
    (epoll, a read or write syscall: system time, counted apart)."""
    leaf = frames[-1]
    if leaf.function in _IN_KERNEL and not leaf.python:
        return None
    innermost = max((i for i, f in enumerate(frames) if f.python), default=-1)
    if any(f.file in _LOOP_SOURCES or f.file.startswith(_LOOP_LIBRARIES) for f in frames[innermost + 1:]):
        return EVENT_LOOP
    return frames[innermost] if innermost >= 0 else leaf


def layer_of(frame: Frame) -> str:
    """The user-space layer of what a sample is charged to (see the module's docstring)."""
    if frame == EVENT_LOOP:
        return LOOP
    if frame.file.startswith(_RELAY_FILES):
        return RELAY
    if frame.file.startswith(_PRODUCT_FILES):
        return PRODUCT
    return LIBRARIES


@dataclass(frozen=True)
class RequestCpu:
    """One role's CPU per request at the unprofiled point, µs."""

    user_us: float
    system_us: float


def own_time(stacks: Iterable[tuple[list[Frame], int]], cpu: RequestCpu | None,
             top: int = 40) -> dict[str, Any]:
    """User-time samples by what they are charged to (user_frame): each layer's and the `top`
    functions' share of them, and, with the role's CPU per request, µs per request (the
    kernel's row is the system time itself)."""
    by_function: Counter[Frame] = Counter()
    in_kernel = 0
    for frames, count in stacks:
        charged = user_frame(frames) if frames else None
        if charged is None:
            in_kernel += count
        else:
            by_function[charged] += count
    samples = sum(by_function.values())
    layers: Counter[str] = Counter()
    for frame, count in by_function.items():
        layers[layer_of(frame)] += count

    def share(count: int) -> float:
        return round(count / samples, 4) if samples else 0.0

    def us(count: int) -> float | None:
        return None if cpu is None or not samples else round(count / samples * cpu.user_us, 2)

    return {
        "user_samples": samples, "kernel_samples": in_kernel,
        "user_us": None if cpu is None else round(cpu.user_us, 2),
        "system_us": None if cpu is None else round(cpu.system_us, 2),
        "layers": [{"layer": KERNEL, "share": None, "us": None if cpu is None else round(cpu.system_us, 2)},
                   *({"layer": name, "share": share(layers[name]), "us": us(layers[name])}
                     for name in LAYERS[1:])],
        "functions": [{"function": frame.label, "layer": layer_of(frame), "share": share(count), "us": us(count)}
                      for frame, count in by_function.most_common(top)],
    }


# --- the run -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """What drives a point: bench-peers' plain requests (wrk) or its long streams."""

    name: str
    cfg: RunConfig
    script: Path

    def run(self, url: str, seconds: float | None = None) -> tuple[dict[str, Any], int]:
        """One point against `url` (of `seconds`, else the run's point length): the load's
        summary and the requests (whole streams) served."""
        cfg = self.cfg
        seconds = cfg.duration_s if seconds is None else seconds
        if self.name == "plain":
            result = run_wrk(url, self.script, cfg.high_concurrency, seconds)
            return result, result.get("requests") or 0
        result = stream_load.run_process(url, cfg.long_stream_concurrency, seconds, cfg.long_stream_tokens)
        return result, result.get("streams_ok") or 0


def describe_load(name: str, cfg: RunConfig) -> str:
    if name == "plain":
        return (f"wrk -t1 -c{cfg.high_concurrency}, keep-alive, bench-peers' chat body "
                f"(max_tokens {cfg.max_tokens}); a request is one answer")
    return (f"bench.peers.stream_load, {cfg.long_stream_concurrency} clients, streams of "
            f"{cfg.long_stream_tokens} tokens; a request is one whole stream")


def find_py_spy() -> str | None:
    """py-spy on the PATH or beside this interpreter (the `bench` extra's), else None."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def py_spy() -> str:
    found = find_py_spy()
    if found is None:
        raise SystemExit("py-spy not found: pip install -e '.[bench]'")
    return found


def processes_by_role(contender: Contender) -> dict[str, list[psutil.Process]]:
    """The contender's processes by role (this proxy's launcher, sidecar and workers); the
    floor's, which has none, as one role."""
    return contender.processes_by_role() or {"relay": process_tree(contender.pids())}


def cpu_times(processes: dict[str, list[psutil.Process]]) -> dict[str, tuple[float, float]]:
    """(user, system) seconds so far of each role's processes."""
    found = {}
    for role, procs in processes.items():
        times = [user_system_s(proc) for proc in procs]
        found[role] = (sum(user for user, _ in times), sum(system for _, system in times))
    return found


def unprofiled_point(contender: Contender, load: Load) -> tuple[dict[str, Any], dict[str, RequestCpu]]:
    """The load against the contender; its summary and each role's CPU per request."""
    processes = processes_by_role(contender)
    before = cpu_times(processes)
    result, requests = load.run(contender.url)
    after = cpu_times(processes)
    cpu = {role: RequestCpu((after[role][0] - before[role][0]) / requests * 1e6,
                            (after[role][1] - before[role][1]) / requests * 1e6)
           for role in processes if requests}
    return result, cpu


def profiled_point(contender: Contender, load: Load, rate: int,
                   scratch: Path) -> tuple[dict[str, Any], dict[str, list[tuple[list[Frame], int]]]]:
    """The load against the contender with py-spy sampling each of its processes (but the
    launcher) inside the run; the load's summary and the stacks by role."""
    spy, spies = py_spy(), []
    sampled = max(1, round(load.cfg.duration_s) - 2)  # inside the run: no idle head or tail sampled
    for role, procs in processes_by_role(contender).items():
        for proc in procs if role != "launcher" else ():
            out = scratch / f"{contender.name}-{role}-{proc.pid}.txt"
            spies.append((role, out, subprocess.Popen(
                [spy, "record", "--pid", str(proc.pid), "--rate", str(rate), "--duration", str(sampled),
                 "--native", "--format", "raw", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    result, _ = load.run(contender.url)
    stacks: dict[str, list[tuple[list[Frame], int]]] = {}
    for role, out, proc in spies:
        _, err = proc.communicate(timeout=sampled + 60)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"py-spy on {contender.name} {role} failed: {err.strip()[-400:]}")
        stacks.setdefault(role, []).extend(parse_raw(out.read_text()))
    return result, stacks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.flow_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results/flow_profile.json"))
    p.add_argument("--backend", choices=BACKENDS, default="sim")
    p.add_argument("--load", choices=("plain", "stream"), default="plain",
                   help="bench-peers' plain requests (wrk c32) or its long streams")
    p.add_argument("--seconds", type=float, default=12.0, help="per point")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    p.add_argument("--top", type=int, default=40, help="functions listed per role")
    return p


def measure(args: argparse.Namespace, cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both points of each contender: what each served and its CPU by role ("points"), and the
    profile of each of its roles ("profiles")."""
    say = Progress()
    points: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flow-profile-") as tmp, contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        instances = stack.enter_context(instances_for(args.backend, cfg))
        contenders = [stack.enter_context(KNOWN[name].build(instances, cfg)) for name in CONTENDERS]
        load = Load(args.load, cfg, write_script(scratch, cfg.max_tokens))
        for contender in contenders:
            load.run(contender.url, cfg.warmup_s)  # warm up
        for contender in contenders:
            plain, cpu = unprofiled_point(contender, load)
            profiled, stacks = profiled_point(contender, load, args.rate, scratch)
            say(f"{contender.name}: {_rate(plain):.0f} req/s, profiled {_rate(profiled):.0f}")
            points[contender.name] = {
                "unprofiled": {**_summary(plain),
                               "cpu_us_per_request": {role: {"user": round(c.user_us, 2),
                                                             "system": round(c.system_us, 2)}
                                                      for role, c in cpu.items()}},
                "profiled": _summary(profiled)}
            for role, role_stacks in stacks.items():
                profiles[f"{contender.name} {role}"] = own_time(role_stacks, cpu.get(role), args.top)
    return points, profiles


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seconds < 4 or args.rate < 1:
        raise SystemExit("--seconds must be >= 4 and --rate >= 1")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    py_spy()
    cfg = RunConfig(out=str(args.out), duration_s=args.seconds, backends=[args.backend])
    provenance = Run("bench.flow_profile", argv)
    stop_on_sigterm()
    done, code = measured(lambda: measure(args, cfg))
    if done is None:
        return code
    points, profiles = done
    write_report(args.out, {
        **provenance.record(),
        "versions": tool_versions(("uvloop", "httptools", "msgspec", "py-spy")),
        "load": args.load,
        "method": {"load": describe_load(args.load, cfg),
                   "instances": f"{cfg.instances} {args.backend}" + (f", time scale {cfg.time_scale:g}"
                                                                     if args.backend == "sim" else ""),
                   "contenders": "bench-peers' " + " and ".join(CONTENDERS), "seconds_per_point": args.seconds,
                   "sampler": f"py-spy record --native --rate {args.rate} --format raw, each process but "
                              "the launcher; samples in a wait or a read/write syscall left out",
                   "us": "kernel: system time per request; the rest: a function's share of the user-time "
                         "samples x the role's user time per request, both from the unprofiled point"},
        "points": points, "profiles": profiles,
    })
    return 0


def _rate(result: dict[str, Any]) -> float:
    """Requests (whole streams) a second of a load's summary."""
    return result.get("rps") or result.get("streams_per_s") or 0.0


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    return {"requests": result.get("requests", result.get("streams_ok")), "rps": _rate(result),
            "errors": result.get("errors")}


if __name__ == "__main__":
    sys.exit(main())
