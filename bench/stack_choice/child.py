"""The child side: the apps (plain, and the proxy with either upstream client), the servers
that serve them on the sockets the orchestrator pre-bound, and the backend."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from .payloads import JSON_BODY, JSON_BYTES, N_CHUNKS, SSE_CHUNK, SSE_DONE




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
