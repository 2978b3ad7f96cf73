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
