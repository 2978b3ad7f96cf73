"""Pick the ASGI server and the upstream HTTP client by measurement on this machine.

Run:  python -m bench.stack_choice --out bench/results/stack_choice.json

Part 1 (asgi_servers): one worker process per server kind, each serving the same trivial
Starlette app (GET /json, GET /stream = 20 SSE chunks) on two PRE-BOUND sockets that this
orchestrator binds itself (a SO_REUSEPORT "shared" port + a private port) and hands over by
fd (pass_fds), exactly as our supervisor will.  Each child runs its server in-process on
uvloop (``uvloop.run``).  Kinds: uvicorn+httptools, uvicorn+h11, granian (embedded ASGI
worker on our uvloop loop), hypercorn (asyncio serve, ``fd://`` binds).

Part 2 (upstream_clients): a Starlette-on-uvicorn(httptools) proxy that forwards
POST /json and POST /stream to a tiny aiohttp.web backend over a pooled keep-alive HTTP/1.1
connection pool, with either aiohttp (one ClientSession + TCPConnector) or httpx.AsyncClient
(http1, Limits).  "direct" = wrk against the backend itself (baseline for added latency).

Load: wrk (C, one thread), requests/s at -c32 and p50 latency at -c1.  CPU seconds of the
server/proxy pid per 1,000 requests come from psutil cpu_times (user+system, all threads)
read just before and after each wrk run.  Measurements are interleaved (repeat -> scenario
-> target, target order rotated each repeat) and medians over the repeats are reported.
The server/proxy under test is pinned to CPU 0, wrk + backend + this orchestrator to CPU 1
(``--no-pin`` to disable).  Everything binds 127.0.0.1 only; every child is stopped by pid.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HOST = "127.0.0.1"
N_CHUNKS = 20  # SSE chunks per streaming response (the last one is "data: [DONE]")
REPO = Path(__file__).resolve().parent.parent

JSON_BODY = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "bench-model",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hello from the backend"},
         "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
}
JSON_BYTES = json.dumps(JSON_BODY, separators=(",", ":")).encode()
SSE_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench-model",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
SSE_DONE = b"data: [DONE]\n\n"
REQ_BODY = (
    '{"model":"bench-model","messages":[{"role":"user","content":"Say hello."}],'
    '"max_tokens":16,"stream":false}'
)

# ----------------------------------------------------------------------------------------
# child side: apps and servers
# ----------------------------------------------------------------------------------------


def sse_chunks():
    return [SSE_CHUNK] * (N_CHUNKS - 1) + [SSE_DONE]


def build_plain_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        return PlainTextResponse("ok")

    async def json_ep(request):
        return JSONResponse(JSON_BODY)

    async def stream_ep(request):
        async def gen():
            for chunk in sse_chunks():
                yield chunk

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health),
        Route("/json", json_ep, methods=["GET", "POST"]),
        Route("/stream", stream_ep, methods=["GET", "POST"]),
    ])


def build_proxy_app(client_kind: str, upstream: str, pool: int):
    """Returns (app, async_setup).  async_setup() must run on the serving loop."""
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict = {}
    up_json, up_stream = upstream + "/json", upstream + "/stream"
    fwd_headers = {"content-type": "application/json"}

    async def health(request):
        return PlainTextResponse("ok")

    if client_kind == "aiohttp":
        import aiohttp

        async def setup():
            connector = aiohttp.TCPConnector(limit=pool, limit_per_host=pool, keepalive_timeout=60)
            state["s"] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=60))

        async def json_ep(request):
            body = await request.body()
            async with state["s"].post(up_json, data=body, headers=fwd_headers) as r:
                data = await r.read()
                return Response(data, status_code=r.status,
                                media_type=r.headers.get("content-type"))

        async def stream_ep(request):
            body = await request.body()
            r = await state["s"].post(up_stream, data=body, headers=fwd_headers)

            async def gen():
                try:
                    async for chunk in r.content.iter_any():
                        yield chunk
                finally:
                    r.release()

            return StreamingResponse(gen(), status_code=r.status, media_type="text/event-stream")

    elif client_kind == "httpx":
        import httpx

        async def setup():
            state["c"] = httpx.AsyncClient(
                http1=True, http2=False,
                limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool,
                                    keepalive_expiry=60),
                timeout=httpx.Timeout(60.0))

        async def json_ep(request):
            body = await request.body()
            r = await state["c"].post(up_json, content=body, headers=fwd_headers)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))

        async def stream_ep(request):
            body = await request.body()
            req = state["c"].build_request("POST", up_stream, content=body, headers=fwd_headers)
            r = await state["c"].send(req, stream=True)
            return StreamingResponse(r.aiter_raw(), status_code=r.status_code,
                                     media_type="text/event-stream",
                                     background=BackgroundTask(r.aclose))
    else:
        raise SystemExit(f"unknown client {client_kind}")

    app = Starlette(routes=[
        Route("/health", health),
        Route("/json", json_ep, methods=["POST"]),
        Route("/stream", stream_ep, methods=["POST"]),
    ])
    return app, setup


def _stop_event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, ev.set)
    return ev


async def serve_uvicorn(app, socks, http_impl):
    import uvicorn

    cfg = uvicorn.Config(app, http=http_impl, lifespan="off", access_log=False,
                         log_level="warning", ws="none")
    server = uvicorn.Server(cfg)
    await server.serve(sockets=socks)  # uvicorn traps SIGTERM/SIGINT itself


async def serve_granian(app, socks):
    # Granian's public Server API only takes address/port/uds and binds itself.  Pre-bound
    # sockets need its private Rust bindings: SocketHolder(fd, is_uds, backlog) fed to the
    # same ASGIWorker that granian.server.embed uses (mirrors its _spawn_asgi_worker).
    from granian._futures import _future_watcher_wrapper, _new_cbscheduler
    from granian._granian import ASGIWorker, SocketHolder, WorkerSignal
    from granian.asgi import _callback_wrapper
    from granian.http import HTTP1Settings

    loop = asyncio.get_running_loop()
    stop = _stop_event()
    callback = _future_watcher_wrapper(_callback_wrapper(app, {}, {}, None))
    keep, sigs = [], []
    for i, s in enumerate(socks):
        sig = WorkerSignal()
        holder = SocketHolder(s.fileno(), False, 1024)
        ssl_ctx = (False, None, None, None, "tls13", None, [], False)
        worker = ASGIWorker(i + 1, (None, holder), None, 1, 512, 1, 30, 1024, "1",
                            HTTP1Settings(), None, False, None, *ssl_ctx, (None, None))
        sched = _new_cbscheduler(loop, callback, impl_asyncio=True)
        worker.serve_async(sched, loop, sig)
        keep.append((worker, sched, holder))
        sigs.append(sig)
    await stop.wait()
    for sig in sigs:
        sig.set()
    await asyncio.sleep(0.3)


async def serve_hypercorn(app, socks):
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    cfg = Config()
    cfg.bind = [f"fd://{s.fileno()}" for s in socks]
    cfg.accesslog = None
    cfg.loglevel = "WARNING"
    stop = _stop_event()
    await serve(app, cfg, shutdown_trigger=stop.wait, mode="asgi")


async def serve_backend(socks):
    from aiohttp import web

    async def health(request):
        return web.Response(text="ok")

    async def json_ep(request):
        await request.read()
        return web.Response(body=JSON_BYTES, content_type="application/json")

    async def stream_ep(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in sse_chunks():
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    for path, h in (("/json", json_ep), ("/stream", stream_ep)):
        app.router.add_get(path, h)
        app.router.add_post(path, h)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    for s in socks:
        await web.SockSite(runner, s).start()
    stop = _stop_event()
    await stop.wait()
    await runner.cleanup()


def child_main(a):
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    import uvloop

    socks = [socket.socket(fileno=int(fd)) for fd in a.fds.split(",")]
    for s in socks:
        s.setblocking(False)

    async def run():
        if a.role == "backend":
            return await serve_backend(socks)
        if a.app == "plain":
            app = build_plain_app()
        else:
            app, setup = build_proxy_app(a.app.split("-", 1)[1], a.upstream, a.pool)
            await setup()
        if a.server == "uvicorn-httptools":
            return await serve_uvicorn(app, socks, "httptools")
        if a.server == "uvicorn-h11":
            return await serve_uvicorn(app, socks, "h11")
        if a.server == "granian":
            return await serve_granian(app, socks)
        if a.server == "hypercorn":
            return await serve_hypercorn(app, socks)
        raise SystemExit(f"unknown server {a.server}")

    uvloop.run(run())


# ----------------------------------------------------------------------------------------
# orchestrator side
# ----------------------------------------------------------------------------------------

_CHILDREN: list = []


class Child:
    def __init__(self, name: str, child_args: list[str], cpu: int | None, logdir: Path,
                 ready_path: str = "/health"):
        self.name = name
        shared = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind((HOST, 0))
        shared.listen(1024)
        private = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        private.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        private.bind((HOST, 0))
        private.listen(1024)
        for s in (shared, private):
            # Inherited by accepted sockets on Linux.  Granian sets this on the listeners it
            # builds itself and does NOT set it per connection, so a pre-bound socket without
            # it gives ~40 ms Nagle/delayed-ACK stalls on streamed responses.  uvloop (uvicorn,
            # hypercorn, aiohttp) sets TCP_NODELAY per connection anyway.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port, self.private_port = shared.getsockname()[1], private.getsockname()[1]
        fds = (shared.fileno(), private.fileno())
        cmd = [sys.executable, "-m", "bench.stack_choice", *child_args,
               "--fds", f"{fds[0]},{fds[1]}"]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.log = logdir / f"{name}.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=self._logf, stderr=subprocess.STDOUT)
        _CHILDREN.append(self)
        shared.close()
        private.close()
        self.pid = self.proc.pid
        self._wait_ready(ready_path)

    def _wait_ready(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}: {self.log_tail()}")
            try:
                st, _ = http_req(self.port, "GET", path, timeout=1.0)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self, n=1500):
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(8)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # SIGKILL to this pid only
                self.proc.wait(5)
        self._logf.close()
        if self in _CHILDREN:
            _CHILDREN.remove(self)


def _stop_all():
    for c in list(_CHILDREN):
        try:
            c.stop()
        except Exception:
            pass


def http_req(port, method, path, body=None, timeout=5.0):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check_endpoints(child: Child, method: str) -> dict:
    """Both pre-bound sockets must serve both endpoints correctly."""
    out = {}
    body = REQ_BODY if method == "POST" else None
    for label, port in (("shared_reuseport", child.port), ("private", child.private_port)):
        try:
            sj, bj = http_req(port, method, "/json", body)
            ss, bs = http_req(port, method, "/stream", body)
            ok = (sj == 200 and json.loads(bj)["object"] == "chat.completion"
                  and ss == 200 and bs.count(b"data: ") == N_CHUNKS and bs.endswith(SSE_DONE))
            out[label] = {"ok": ok, "port": port}
        except Exception as e:  # noqa: BLE001
            out[label] = {"ok": False, "port": port, "error": repr(e)}
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


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


SCENARIOS = [  # name, path, connections, metric of interest
    ("json_c32", "/json", 32),
    ("json_c1", "/json", 1),
    ("stream_c32", "/stream", 32),
    ("stream_c1", "/stream", 1),
]

SERVER_KINDS = ["uvicorn-httptools", "uvicorn-h11", "granian", "hypercorn"]
CLIENT_KINDS = ["aiohttp", "httpx"]


def _available(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


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


def ratio(x, base):
    return None if (x is None or not base) else round(x / base, 3)


def md_servers(res: dict, base="uvicorn-httptools") -> str:
    """Medians over repeats; ratio = server / base.  req per CPU-s = 1000 / CPU s per 1k."""
    b = res[base]
    rows = ["| server | JSON req/s @c32 | ratio | JSON CPU s/1k req @c32 | ratio | JSON p50 @c1 (ms) "
            "| ratio | stream req/s @c32 | ratio | stream CPU s/1k req @c32 | ratio "
            "| stream p50 @c1 (ms) | ratio | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        def g(s, k, r=r):
            return r[s]["median"].get(k)

        def c(s, k):
            return f"{g(s, k)} | {ratio(g(s, k), b[s]['median'].get(k))}"
        errs = sum(r[s]["median"]["errors_total"] for s in r)
        rows.append(f"| {n} | {g('json_c32', 'rps'):.0f} | {ratio(g('json_c32', 'rps'), b['json_c32']['median'].get('rps'))} "
                    f"| {c('json_c32', 'cpu_s_per_1k')} | {c('json_c1', 'p50_ms')} "
                    f"| {g('stream_c32', 'rps'):.0f} | {ratio(g('stream_c32', 'rps'), b['stream_c32']['median'].get('rps'))} "
                    f"| {c('stream_c32', 'cpu_s_per_1k')} | {c('stream_c1', 'p50_ms')} | {errs} |")
    return "\n".join(rows)


def added_latency(res, name, scen):
    """Median over repeats of the paired difference p50(proxy) - p50(direct), same repeat."""
    d = {r["repeat"]: r["p50_ms"] for r in res["direct"][scen]["runs"]}
    diffs = [r["p50_ms"] - d[r["repeat"]] for r in res[name][scen]["runs"]
             if r["repeat"] in d and r["p50_ms"] is not None and d[r["repeat"]] is not None]
    return rnd(median(diffs), 4)


def md_clients(res: dict, base="proxy-aiohttp") -> str:
    rows = ["| target | JSON p50 @c1 (ms) | added p50 (ms) | JSON req/s @c32 | ratio | "
            "proxy CPU s/1k req (JSON @c32) | ratio | stream p50 @c1 (ms) | added p50 (ms) | "
            "stream req/s @c32 | ratio | proxy CPU s/1k req (stream @c32) | ratio | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    b = res.get(base)
    for n, r in res.items():
        def g(s, k, r=r):
            return r[s]["median"].get(k)

        def c(s, k):
            return f"{g(s, k)} | {ratio(g(s, k), b[s]['median'].get(k)) if b else None}"
        errs = sum(r[s]["median"]["errors_total"] for s in r)
        if n == "direct":
            rows.append(f"| direct (backend, no proxy) | {g('json_c1', 'p50_ms')} | 0 | {g('json_c32', 'rps'):.0f} "
                        f"| - | ({g('json_c32', 'cpu_s_per_1k')} backend) | - | {g('stream_c1', 'p50_ms')} "
                        f"| 0 | {g('stream_c32', 'rps'):.0f} | - | ({g('stream_c32', 'cpu_s_per_1k')} backend) | - | {errs} |")
            continue
        rows.append(f"| {n} | {c('json_c1', 'p50_ms').split(' |')[0]} | {added_latency(res, n, 'json_c1')} "
                    f"| {g('json_c32', 'rps'):.0f} | {ratio(g('json_c32', 'rps'), b['json_c32']['median'].get('rps'))} "
                    f"| {c('json_c32', 'cpu_s_per_1k')} | {g('stream_c1', 'p50_ms')} | {added_latency(res, n, 'stream_c1')} "
                    f"| {g('stream_c32', 'rps'):.0f} | {ratio(g('stream_c32', 'rps'), b['stream_c32']['median'].get('rps'))} "
                    f"| {c('stream_c32', 'cpu_s_per_1k')} | {errs} |")
    return "\n".join(rows)


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
    atexit.register(_stop_all)
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/stack_choice.json")
    p.add_argument("--duration", type=int, default=5, help="seconds per c32 measurement")
    p.add_argument("--c1-duration", type=int, default=3, help="seconds per c1 measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pool", type=int, default=64, help="upstream pool size (>= concurrency)")
    p.add_argument("--budget-s", type=float, default=540.0, help="hard cap on measuring time")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--skip-servers", action="store_true")
    p.add_argument("--skip-clients", action="store_true")
    # child-only
    p.add_argument("--role", choices=["orchestrate", "server", "backend"], default="orchestrate",
                   help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--app", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    p.add_argument("--fds", help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role != "orchestrate":
        return child_main(a)
    results = orchestrate(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for key in ("asgi_servers_table_md", "upstream_clients_table_md"):
        if key in results:
            print("\n" + results[key])
    if results["unavailable"]:
        print("\nunavailable:", json.dumps(results["unavailable"], indent=1))
    print(f"\nwrote {out} ({results['meta']['wall_s']} s)")


if __name__ == "__main__":
    main()
