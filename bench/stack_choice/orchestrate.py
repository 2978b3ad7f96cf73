"""Part 1 (ASGI servers) and part 2 (upstream clients), in one bounded run."""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from .measure import measure, wrk_cmd
from .payloads import HOST, N_CHUNKS, REQ_BODY
from .processes import Child, check_endpoints, stop_all
from .tables import md_clients, md_servers




def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": sys.version.split()[0],
            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        info["debian"] = Path("/etc/debian_version").read_text().strip()
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    vers = {}
    for pkg in ("uvicorn", "httptools", "h11", "uvloop", "starlette", "granian", "hypercorn",
                "aiohttp", "httpx", "httpcore", "anyio", "sniffio", "psutil"):
        try:
            vers[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            vers[pkg] = None
    info["packages"] = vers
    if vers.get("httpcore") and not vers.get("sniffio"):
        # httpcore's current_async_library() does `import sniffio` on every lock setup; with
        # anyio 4.16 (installed here) no longer depending on it, each request pays failed-import stat()s
        # (measured: httpx proxy ~30% slower still).  Report it rather than hide it.
        info["warning"] = "sniffio not installed: httpx/httpcore pays a failed import per request"
    try:
        info["wrk"] = subprocess.run(["wrk", "--version"], capture_output=True, text=True
                                     ).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        info["wrk"] = None
    return info


SERVER_KINDS = ["uvicorn-httptools", "uvicorn-h11", "granian", "hypercorn"]
CLIENT_KINDS = ["aiohttp", "httpx"]


def _available(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def orchestrate(a) -> dict:
    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get update && apt-get install -y wrk")
    srv_cpu = None if a.no_pin else 0
    if a.no_pin:
        a.wrk_cpu = None
    else:
        a.wrk_cpu = 1
        os.sched_setaffinity(0, {1})
    logdir = Path(tempfile.mkdtemp(prefix="stack_choice_"))
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def log(msg):
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", flush=True)

    lua = logdir / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{REQ_BODY}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n')

    results = {
        "meta": {
            "command": "python -m bench.stack_choice " + " ".join(sys.argv[1:]),
            "machine": machine_info(),
            "duration_s_c32": a.duration, "duration_s_c1": a.c1_duration,
            "repeats": a.repeats, "sse_chunks": N_CHUNKS,
            "pinning": None if a.no_pin else {"server_or_proxy_cpu": 0, "wrk_backend_orchestrator_cpu": 1},
            "wrk_command_template": " ".join(wrk_cmd("PORT", "/PATH", "C", "D", None, a.wrk_cpu)),
            "wrk_post_script": lua.read_text(),
            "cpu_metric": "psutil.Process(pid).cpu_times() user+system delta over the wrk run / requests * 1000",
            "interleaving": "for repeat: for scenario: for target (order rotated per repeat)",
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "prebound_sockets": {},
        "asgi_servers": {},
        "upstream_clients": {},
        "unavailable": {},
    }

    # ---- part 1: ASGI servers ----------------------------------------------------------
    if not a.skip_servers:
        log("part 1: ASGI servers")
        servers = {}
        for kind in SERVER_KINDS:
            mod = {"granian": "granian", "hypercorn": "hypercorn"}.get(kind, "uvicorn")
            if not _available(mod):
                results["unavailable"][kind] = f"python package {mod} not importable"
                continue
            try:
                ch = Child(kind, ["--role", "server", "--server", kind, "--app", "plain"],
                           srv_cpu, logdir)
            except RuntimeError as e:
                results["unavailable"][kind] = str(e)
                log(f"  {kind}: failed to start: {e}")
                continue
            chk = check_endpoints(ch, "GET")
            results["prebound_sockets"][kind] = chk
            log(f"  started {kind} pid={ch.pid} ports={ch.port}/{ch.private_port} check={chk['ok']}")
            if not chk["ok"]:
                results["unavailable"][kind] = f"endpoint check failed: {chk}"
                ch.stop()
                continue
            servers[kind] = ch
        try:
            results["asgi_servers"] = measure(servers, None, a, deadline, log)
        finally:
            for ch in servers.values():
                ch.stop()
        results["asgi_servers_table_md"] = md_servers(results["asgi_servers"])

    # ---- part 2: upstream clients -------------------------------------------------------
    if not a.skip_clients:
        log("part 2: upstream clients (proxy on uvicorn-httptools)")
        targets = {}
        backend = Child("backend", ["--role", "backend"], a.wrk_cpu, logdir)
        try:
            chk = check_endpoints(backend, "POST")
            results["prebound_sockets"]["backend(aiohttp.web)"] = chk
            targets["direct"] = backend
            upstream = f"http://{HOST}:{backend.port}"
            for ck in CLIENT_KINDS:
                if not _available(ck):
                    results["unavailable"][f"proxy-{ck}"] = f"python package {ck} not importable"
                    continue
                ch = Child(f"proxy-{ck}", ["--role", "server", "--server", "uvicorn-httptools",
                                           "--app", f"proxy-{ck}", "--upstream", upstream,
                                           "--pool", str(a.pool)], srv_cpu, logdir)
                chk = check_endpoints(ch, "POST")
                results["prebound_sockets"][f"proxy-{ck}"] = chk
                log(f"  started proxy-{ck} pid={ch.pid} check={chk['ok']}")
                targets[f"proxy-{ck}"] = ch
            results["upstream_clients"] = measure(targets, str(lua), a, deadline, log,
                                                  extra_cpu=backend)
        finally:
            for n, ch in targets.items():
                if n != "direct":
                    ch.stop()
            backend.stop()
        results["upstream_clients_table_md"] = md_clients(results["upstream_clients"])

    results["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    results["meta"]["loadavg_at_end"] = os.getloadavg()
    shutil.rmtree(logdir, ignore_errors=True)
    return results
