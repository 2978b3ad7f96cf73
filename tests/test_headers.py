"""Which headers cross the proxy (proxy_workers/headers.py): the
client's to the instance and the instance's to the client, hop-by-hop ones and the proxy's
own excepted; and the bytes of a forward that carries them (against a real socket)."""

from __future__ import annotations

import asyncio

import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from proxy_workers.headers import forwarded_block, relayed, replaced, request_dropped, with_defaults
from proxy_workers.upstream import Upstream
from tests.test_http1_client import Server, opened, run, settings

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# What a client sends, as uvicorn hands it over (names lower-case, in order).
CLIENT = [
    (b"host", b"proxy:8001"), (b"user-agent", b"OpenAI/Python 1.40.0"),
    (b"content-type", b"text/plain"), (b"content-length", b"42"), (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, deflate"), (b"authorization", b"Bearer client-key"),
    (b"traceparent", TRACEPARENT), (b"x-session-id", b"s-1"), (b"expect", b"100-continue"),
    (b"connection", b"keep-alive, X-Hop"), (b"x-hop", b"only for this hop"),
    (b"keep-alive", b"timeout=5"), (b"te", b"trailers"), (b"trailer", b"x-t"),
    (b"transfer-encoding", b"chunked"), (b"upgrade", b"h2c"), (b"proxy-connection", b"keep-alive"),
    (b"proxy-authorization", b"Basic eA=="), (b"proxy-authenticate", b"Basic"),
    (b"x-cacheroute-kv-prefix-tokens", b"999999"), (b"x-cacheroute-kv-knowledge-ids", b"k1"),
    (b"x-tag", b"one"), (b"x-tag", b"two"),
]
FORWARDED = (b"user-agent: OpenAI/Python 1.40.0\r\naccept: application/json\r\n"
             b"authorization: Bearer client-key\r\ntraceparent: " + TRACEPARENT + b"\r\n"
             b"x-session-id: s-1\r\nx-tag: one\r\nx-tag: two\r\n")


def test_the_client_headers_forwarded_are_the_end_to_end_ones_in_order():
    assert forwarded_block(CLIENT, request_dropped(replace_authorization=False)) == FORWARDED


def test_with_an_api_key_the_clients_authorization_is_not_forwarded():
    block = forwarded_block(CLIENT, request_dropped(replace_authorization=True))
    assert block == FORWARDED.replace(b"authorization: Bearer client-key\r\n", b"")


def test_connection_names_a_header_whatever_its_case_and_spacing():
    raw = [(b"x-a", b"1"), (b"connection", b" X-A ,, x-b"), (b"x-b", b"2"), (b"x-c", b"3")]
    assert forwarded_block(raw, request_dropped(False)) == b"x-c: 3\r\n"
    assert forwarded_block([], request_dropped(False)) == b""


@pytest.mark.parametrize("value", [b"a\r\nx-injected: 1", b"a\nb", b"a\rb", b"\r\n"])
def test_a_value_with_cr_or_lf_is_refused(value):
    with pytest.raises(HTTPError) as refused:
        forwarded_block([(b"x-ok", b"fine"), (b"x-bad", value)], request_dropped(False))
    assert (refused.value.status, refused.value.code) == (400, "invalid_header")


def test_the_same_headers_as_the_last_requests_are_forwarded_as_the_same_lines():
    upstream = Upstream(Settings())
    first = upstream.forwarded(CLIENT)
    assert first == FORWARDED and upstream.forwarded(list(CLIENT)) is first  # not built again
    other = [*CLIENT[:-1], (b"x-tag", b"three")]
    assert upstream.forwarded(other) == FORWARDED.replace(b"x-tag: two", b"x-tag: three")
    with pytest.raises(HTTPError):  # refused, and not kept: refused again
        upstream.forwarded([(b"x-bad", b"a\r\nb")])
    with pytest.raises(HTTPError):
        upstream.forwarded([(b"x-bad", b"a\r\nb")])
    assert upstream.forwarded(CLIENT) == FORWARDED


INSTANCE = [
    (b"date", b"Mon, 01 Jan 2024 00:00:00 GMT"), (b"server", b"uvicorn"),
    (b"content-length", b"120"), (b"content-type", b"application/json"),
    (b"x-request-id", b"cmpl-1"), (b"connection", b"keep-alive, x-hop"), (b"x-hop", b"1"),
    (b"keep-alive", b"timeout=5"), (b"transfer-encoding", b"chunked"), (b"trailer", b"x-t"),
    (b"proxy-authenticate", b"Basic"), (b"upgrade", b"h2c"), (b"te", b"trailers"),
    (b"x-cacheroute-worker", b"spoofed"), (b"x-cacheroute-instance", b"spoofed"),
    (b"set-cookie", b"a=1"), (b"set-cookie", b"b=2"),
]


def test_the_instance_headers_relayed_are_the_end_to_end_ones_in_order():
    assert relayed(INSTANCE) == [(b"content-type", b"application/json"), (b"x-request-id", b"cmpl-1"),
                                 (b"set-cookie", b"a=1"), (b"set-cookie", b"b=2")]


def test_defaults_fill_in_what_the_instance_did_not_send_and_replaced_overrides():
    sse = (b"content-type", b"text/event-stream")
    no_cache = (b"cache-control", b"no-cache")
    own = [(b"content-type", b"text/event-stream; charset=utf-8")]
    assert with_defaults(list(own), sse, no_cache) == [*own, no_cache]
    assert with_defaults([], sse) == [sse]
    json_type = (b"content-type", b"application/json")
    assert replaced([(b"x-a", b"1"), (b"content-type", b"text/plain")], json_type) == [(b"x-a", b"1"), json_type]


def _forward(upstream_settings: Settings, headers: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The bytes one forward writes, and the answer's headers as the client parsed them."""
    async def answer(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r-9\r\n"
                     b"Content-Length: 2\r\n\r\n{}")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(upstream_settings)
            response = await opened(upstream, "127.0.0.1", server.port, "/v1/chat/completions",
                                           b'{"a":1}', upstream.forwarded(CLIENT) + headers)
            await upstream.read_all(response)
            response.release()
            upstream._pool.close()
            await asyncio.sleep(0)
            return server.requests[0], response.headers

    return run(main())


def test_a_forward_carries_the_client_headers_then_the_proxys_own():
    request, answer_headers = _forward(settings(), b"x-cacheroute-kv-prefix-tokens: 256\r\n")
    port = request.split(b"Host: 127.0.0.1:", 1)[1].split(b"\r\n", 1)[0]
    assert request == (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port + b"\r\n"
                       + FORWARDED + b"x-cacheroute-kv-prefix-tokens: 256\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}")
    assert answer_headers == [(b"content-type", b"application/json"), (b"x-request-id", b"r-9"),
                              (b"content-length", b"2")]


def test_with_an_api_key_the_forward_carries_the_proxys_authorization_only():
    request, _ = _forward(settings(openai_api_key="sk-proxy"), b"")
    head = request.split(b"\r\n\r\n")[0].lower()
    assert head.count(b"authorization") == 1 and b"authorization: bearer sk-proxy" in head
    assert b"traceparent: " + TRACEPARENT in head
