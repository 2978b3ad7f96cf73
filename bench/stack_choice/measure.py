"""wrk runs against the children, interleaved over repeats, and their medians."""

from __future__ import annotations

import re
import statistics
import subprocess
import time


from .processes import Child
from .payloads import HOST


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(txt: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)$", txt)
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_wrk(out: str) -> dict:
    res = {}
    m = re.search(r"^\s*50%\s+(\S+)", out, re.M)
    res["p50_ms"] = _ms(m.group(1)) if m else None
    m = re.search(r"^\s*99%\s+(\S+)", out, re.M)
    res["p99_ms"] = _ms(m.group(1)) if m else None
    m = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)", out)
    res["requests"] = int(m.group(1)) if m else 0
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    res["rps"] = float(m.group(1)) if m else 0.0
    errs = 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errs += sum(int(x) for x in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errs += int(m.group(1))
    res["errors"] = errs
    return res


def wrk_cmd(port, path, conns, dur, lua, cpu):
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{dur}s", "--timeout", "5s", "--latency"]
    if lua:
        cmd += ["-s", lua]
    cmd.append(f"http://{HOST}:{port}{path}")
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    return cmd


def run_wrk(child: Child, path, conns, dur, lua, cpu, extra_cpu: Child | None = None) -> dict:
    cmd = wrk_cmd(child.port, path, conns, dur, lua, cpu)
    c0 = child.cpu_s()
    e0 = extra_cpu.cpu_s() if extra_cpu else None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=dur + 30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    c1 = child.cpu_s()
    res = parse_wrk(out)
    res["cpu_s"] = round(c1 - c0, 4)
    res["cpu_s_per_1k"] = round(1000 * (c1 - c0) / res["requests"], 4) if res["requests"] else None
    # share of one core the process actually got; < ~0.9 at c32 means it was starved
    # (other tenants of this shared VM), so its req/s is noise while cpu_s_per_1k stays valid
    res["cpu_share"] = round((c1 - c0) / dur, 3)
    if extra_cpu:
        d = extra_cpu.cpu_s() - e0
        res["backend_cpu_s_per_1k"] = round(1000 * d / res["requests"], 4) if res["requests"] else None
    if res["requests"] == 0 or p.returncode != 0:
        res["wrk_output"] = out[-800:]
    return res


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rnd(x, n=3):
    return None if x is None else round(x, n)


SCENARIOS = [  # name, path, connections, metric of interest
    ("json_c32", "/json", 32),
    ("json_c1", "/json", 1),
    ("stream_c32", "/stream", 32),
    ("stream_c1", "/stream", 1),
]


def measure(targets: dict, lua, a, deadline, log, extra_cpu=None) -> dict:
    """targets: name -> Child.  Interleaved: repeat -> scenario -> rotated targets."""
    names = list(targets)
    runs = {n: {s[0]: [] for s in SCENARIOS} for n in names}
    # warm-up: 1 s at c32 on each path per target (JIT-less, but fills pools/caches)
    for n in names:
        for path in ("/json", "/stream"):
            run_wrk(targets[n], path, 32, 1, lua, a.wrk_cpu)
    for rep in range(a.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for scen, path, conns in SCENARIOS:
            dur = a.duration if conns > 1 else a.c1_duration
            for n in order:
                if time.monotonic() + dur > deadline:
                    log(f"  budget exhausted, skipping {n} {scen} rep{rep}")
                    continue
                r = run_wrk(targets[n], path, conns, dur, lua, a.wrk_cpu,
                            extra_cpu=extra_cpu if n != "direct" else None)
                r["repeat"] = rep
                runs[n][scen].append(r)
                log(f"  rep{rep} {scen:10s} {n:18s} rps={r['rps']:9.1f} p50={r['p50_ms']}ms "
                    f"cpu/1k={r['cpu_s_per_1k']} err={r['errors']}")
    out = {}
    for n in names:
        out[n] = {}
        for scen, _, _ in SCENARIOS:
            rs = runs[n][scen]
            med = {k: rnd(median([r.get(k) for r in rs]), 4)
                   for k in ("rps", "p50_ms", "p99_ms", "cpu_s_per_1k", "cpu_share",
                             "backend_cpu_s_per_1k")}
            med = {k: v for k, v in med.items() if v is not None}
            med["errors_total"] = sum(r["errors"] for r in rs)
            med["n"] = len(rs)
            out[n][scen] = {"median": med, "runs": rs}
    return out
