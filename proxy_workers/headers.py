"""Which headers cross the proxy, in each direction (docs/protocol.md, "What is forwarded to the
instance" and "Responses").

As a proxy should, the worker passes headers end to end -- the client's to the instance
(`traceparent`, `X-Session-ID`, `User-Agent`, `X-Request-Id`, ...), the instance's back to the
client (vLLM's `x-request-id`, ...) -- except the hop-by-hop ones (RFC 9110 §7.6.1: they
describe one connection, not the message) and those the proxy writes itself because it
frames or changes what it sends.

Names are compared lower-case: uvicorn hands the request's names lower-case, and the HTTP/1.1
client (cacheroute_proxy/http1/client.py) lower-cases the answer's. Filtering is one frozenset
lookup per header, and the forwarded headers are joined into one bytes block per request
(written with the body).
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheroute_proxy.http import HTTPError

Header = tuple[bytes, bytes]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

# The proxy's own header on a forward after a KV inject: a client's is
# dropped, so no client can tell an instance to skip a prefill it never got the KV for.
KV_PREFIX_TOKENS = b"x-cacheroute-kv-prefix-tokens"
# Beside it, the knowledge ids whose KV the context starts with, in order: an instance that
# keeps KV per id (the simulated one) counts its resident hits by them.
KV_KNOWLEDGE_IDS = b"x-cacheroute-kv-knowledge-ids"

# Not forwarded from the client, besides the hop-by-hop ones:
# - host: the instance's own; content-length: recomputed (knowledge injection changes the body);
# - expect: the proxy has read the whole body already, there is nothing left to continue;
# - content-type: the proxy parsed the body as JSON whatever it said, so the instance is
#   told application/json, never a type that would make it refuse what the proxy accepted;
# - accept-encoding: the proxy edits the answer (the meta key, the [DONE] line), so it must
#   arrive uncompressed.
_REQUEST_DROPPED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"content-type",
                                 b"accept-encoding", KV_PREFIX_TOKENS, KV_KNOWLEDGE_IDS}

# Not relayed from the instance, besides the hop-by-hop ones: content-length (the proxy frames
# the answer: the meta key changes a JSON body's length, a stream is re-chunked), date and
# server (uvicorn writes the worker's own; nginx drops an upstream's the same way) and the
# proxy's own x-cacheroute-* names (one of each, the proxy's).
_RESPONSE_DROPPED = HOP_BY_HOP | {b"content-length", b"date", b"server",
                                  b"x-cacheroute-worker", b"x-cacheroute-instance"}


# With spans on, the proxy is a hop of the trace: the instance's parent is its forward span, so
# it writes traceparent (and passes the client's tracestate on) itself.
TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})


def request_dropped(replace_authorization: bool, replace_trace_context: bool = False) -> frozenset[bytes]:
    """The names not forwarded; with `replace_authorization` (OPENAI_API_KEY is set) the
    client's Authorization too, since the proxy sends its own; with `replace_trace_context`
    (spans on) the client's traceparent and tracestate, which the proxy sends in its own way."""
    dropped = _REQUEST_DROPPED | {b"authorization"} if replace_authorization else _REQUEST_DROPPED
    return dropped | TRACE_CONTEXT if replace_trace_context else dropped


def forwarded_block(raw: Sequence[Header], dropped: frozenset[bytes]) -> bytes:
    """The client's headers to forward, as `name: value\\r\\n` lines in their order.

    A header that the client's Connection header names is hop-by-hop too. A value with CR or LF
    is refused (400): the server in front (httptools, h11) already refuses them, this makes
    sure that a request line can never be smuggled into the forward whatever server runs it."""
    parts: list[bytes] = []
    named: frozenset[bytes] | None = None
    for name, value in raw:
        if name in dropped:
            if name == b"connection":
                named = _connection_tokens(value, named)
            continue
        parts += (name, b": ", value, b"\r\n")
    if named is not None and not named <= dropped:
        return forwarded_block(raw, dropped | named)
    block = b"".join(parts)
    lines = len(parts) // 4  # four parts a line
    if block.count(b"\n") != lines or block.count(b"\r") != lines:
        raise HTTPError(400, "invalid_header", "a request header value contains CR or LF")
    return block


def relayed(headers: list[Header]) -> list[Header]:
    """The instance's headers that reach the client, in their order."""
    kept: list[Header] = []
    named: frozenset[bytes] | None = None
    for header in headers:
        name = header[0]
        if name in _RESPONSE_DROPPED:
            if name == b"connection":
                named = _connection_tokens(header[1], named)
            continue
        kept.append(header)
    if named is not None:
        kept = [h for h in kept if h[0] not in named]
    return kept


def with_defaults(headers: list[Header], *defaults: Header) -> list[Header]:
    """`headers` plus each default whose name the instance did not send (its own wins)."""
    for default in defaults:
        name = default[0]
        for header in headers:  # a plain loop: any() with a generator costs twice as much here
            if header[0] == name:
                break
        else:
            headers.append(default)
    return headers


def replaced(headers: list[Header], header: Header) -> list[Header]:
    """`headers` with every header of that name replaced by `header`."""
    name = header[0]
    return [h for h in headers if h[0] != name] + [header]


def _connection_tokens(value: bytes, seen: frozenset[bytes] | None) -> frozenset[bytes]:
    tokens = frozenset(t.strip().lower() for t in value.split(b",") if t.strip())
    return tokens if seen is None else seen | tokens
