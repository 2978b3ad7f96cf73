"""The product's HTTP/1.1 server, for every role (the workers' data plane, the sidecar's
control plane): one asyncio Protocol per connection, requests parsed by httptools. A worker's
two proxied routes are handlers given the request's :class:`Cycle` itself (`routes`); every
other request goes to the role's ASGI app (Starlette) through a minimal scope/receive/send of
the same Cycle.

Why its own: under uvicorn, its protocol callbacks, the ASGI messages of every chunk and the
private attributes the worker had to reach into for a one-write answer and a disconnect
callback were a large share of a request's CPU. Here those are plain methods of the Cycle:
`read_body`, `start`/`write`/`end`, `send_whole` (head and body in one write),
`on_disconnect` (called once when the client leaves before the answer is complete), `started`
and `complete`. A client that leaves is seen whatever the size of its body: reading pauses only
to bound what is buffered (the connection module says when).

What it keeps from uvicorn's behaviour, on purpose, because clients and tests depend on it:
HTTP/1.1 keep-alive by default, `Connection: close` and HTTP/1.0 honoured, pipelined requests
answered in order (what follows one is held, unparsed, until its turn), the idle keep-alive
timeout, `transfer-encoding: chunked` for a response without a length, `date` and `server`
headers, 400 and close on a request that does not parse, 500 when the app fails before
answering, and the drain of proxy_workers/drain.py (stop accepting, never close a connection
under a request that may be on its way, cut at the deadline). What it adds, as nginx has:
limits on a request head (`limits`: 414, 431, and 408 for one that takes too long), and 400 for
a chunked body that does not parse.

The modules, one job each: `wire` (the bytes: status lines, `date`, header checks, the plain
answers), `limits` (what a request head may hold, and how long it may take), `cycle` (one
request and its response), `connection` (the Protocol of one client connection), `server`
(listening, the lifespan, signals and the drain), `draining` (what the server asks of a role's
drain), `lifespan` (the ASGI lifespan, for Starlette). And `client`, the other side: the
kept-alive client of a worker's forward to an instance and of the sidecar's Scheduler link.
"""

from .cycle import BadBody, BodyTooLarge, ClientGone, Cycle, Handler
from .draining import Draining, GracefulExit
from .limits import HeadLimits, head_limits
from .server import Http1Server
from .wire import Header, status_line

__all__ = ["BadBody", "BodyTooLarge", "ClientGone", "Cycle", "Draining", "GracefulExit", "Handler",
           "HeadLimits", "Header", "Http1Server", "head_limits", "status_line"]
