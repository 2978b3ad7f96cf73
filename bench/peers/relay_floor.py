"""The thinnest relay this proxy's own stack allows: the floor under `proxy-w2-ll` in bench-peers.

`python -m bench.peers.relay_floor --port P --processes N --upstream URL ...` forks N relay
processes onto one SO_REUSEPORT port, as the proxy's workers share theirs, and waits for them
(SIGTERM/SIGINT is passed on); the contender is `relay-floor-w2` (bench/harness/contenders.py).
Each is the product's HTTP/1.1 server (cacheroute_proxy/http1) and its forward client
(proxy_workers/upstream.py) with nothing of the product between them: the body read, the next
instance in turn, the request forwarded, the answer relayed whole or, for a stream, as it
arrives. No validation, selection, admission, shared table, events, meta, headers policy or
metrics.

What it costs a request is what this stack costs before the product does anything, so the
proxy's figures over the floor's are the product's own work, and the floor's against
vllm-router's say how much room a Python data plane on this stack leaves for it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
from typing import Any
from urllib.parse import urlsplit

from cacheroute_proxy import serving
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http1 import Cycle, GracefulExit, Http1Server, head_limits
from proxy_workers.headers import relayed
from proxy_workers.server import bind_socket
from proxy_workers.upstream import Upstream

BODY_LIMIT = 1 << 20
ROUTES = (b"/v1/chat/completions", b"/v1/completions")


class Relay:
    """Forward each request to the next upstream in turn; relay what comes back."""

    def __init__(self, upstreams: list[str], upstream: Upstream | None = None) -> None:
        self.upstream = upstream or Upstream(Settings())
        self._next = itertools.cycle([(u.hostname or "127.0.0.1", u.port or 80)
                                      for u in map(urlsplit, upstreams)])

    async def handle(self, cycle: Cycle) -> None:
        body = cycle.whole_body(BODY_LIMIT)  # as the workers: no coroutine when it came whole
        if body is None:
            body = await cycle.read_body(BODY_LIMIT)
        host, port = next(self._next)
        response = await self.upstream.send(host, port, cycle.path, body)
        headers = relayed(response.headers)
        # The floor decodes nothing, so a stream is told by its bytes (the benchmarks' bodies
        # are compact JSON; either spacing is accepted).
        if b'"stream":true' not in body and b'"stream": true' not in body:
            answer = await self.upstream.read_all(response)
            response.release()
            cycle.send_whole(response.status, headers, answer)
            return
        cycle.start(response.status, headers)
        while not await self.upstream.relay(response, cycle.body_writer()):
            await cycle.writable()
        response.release()
        cycle.end()

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The lifespan, and 200 for anything else (the contender's readiness probe)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await self.upstream.start()
                await send({"type": "lifespan.startup.complete"})
            await self.upstream.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def serve_one(port: int, upstreams: list[str]) -> None:
    relay = Relay(upstreams)
    sock = bind_socket("127.0.0.1", port, reuse_port=True)  # as a worker binds the shared port
    routes = {("POST", path): relay.handle for path in ROUTES}
    server = Http1Server(relay.asgi, GracefulExit(5.0), 5.0, head_limits(Settings()), routes=routes)
    serving.serve(server, [sock], lambda _server: "relay floor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--upstream", action="append", required=True, help="http://host:port")
    args = parser.parse_args()
    children = []
    for _ in range(args.processes):
        pid = os.fork()
        if pid == 0:
            serve_one(args.port, args.upstream)
            os._exit(0)
        children.append(pid)

    def pass_on(signum: int, _frame: object) -> None:
        for pid in children:
            os.kill(pid, signum)
    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
