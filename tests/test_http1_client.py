"""The forward's HTTP/1.1 client (cacheroute_proxy/http1/client.py) against a real socket server on
127.0.0.1 that answers with scripted bytes: framing (length, chunked, until close), keep-alive
reuse and its limits, truncation, back-pressure, and the errors Upstream.open maps them to."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from cacheroute_proxy.http1.client import (HIGH_WATER, ConnectionClosed, Http1Pool, header_lines,
                                           UpstreamResponse, request_line)
from proxy_workers.upstream import SEND_FAILURES, Upstream, UpstreamFailure

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'


class Server:
    """Counts connections and requests; `answer` writes the reply to each request."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.disconnects = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                await self.answer(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1
        finally:
            writer.close()


def answer_then_close(raw: bytes) -> Answer:
    """An instance that writes `raw` and closes the connection."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()
        writer.close()
    return answer


def run(coro: Awaitable[Any]) -> Any:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def settings(**kw: Any) -> Settings:
    return Settings(upstream_first_byte_timeout_s=kw.pop("first_byte", 5.0),
                    upstream_idle_timeout_s=kw.pop("idle", 5.0), **kw)


async def opened(upstream: Upstream, host: str, port: int, path: str, body: bytes, headers: bytes = b"",
                 sent: Callable[[], None] | None = None) -> UpstreamResponse:
    """The exchange's forward: `Upstream.send` awaited, its failures raised as the client's
    HTTPError 502/504 (`Upstream.refusal`)."""
    try:
        return await upstream.send(host, port, path, body, headers, sent)
    except SEND_FAILURES as exc:
        raise upstream.refusal(exc, host, port, path) from None


async def post(upstream: Upstream, port: int, body: bytes = b"{}") -> tuple[int, str | None, bytes]:
    response = await opened(upstream, "127.0.0.1", port, "/v1/chat/completions", body)
    data = await upstream.read_all(response)
    response.release()
    return response.status, response.content_type, data


def test_request_bytes_and_keep_alive_reuse():
    async def answer(reader, writer):
        writer.write(OK_JSON)

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings(openai_api_key="k"))
            for _ in range(3):
                assert await post(upstream, server.port, b'{"a":1}') == (200, "application/json", b'{"ok": true}')
            upstream._pool.close()
            return server

    server = run(main())
    assert server.connections == 1 and len(server.requests) == 3
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert b"Authorization: Bearer k" in head and b"Content-Length: 7" in head and body == b'{"a":1}'
    assert b"accept-encoding" not in head.lower()  # answers come uncompressed, relayed as they are


def test_a_request_on_a_kept_alive_connection_looks_up_no_running_loop(monkeypatch):
    # On CPython 3.11 each asyncio.get_running_loop() is a getpid() syscall, a measurable share
    # of a plain request's CPU (bench/results/hotpath_getpid.json). Only a new connection needs
    # the loop.
    async def answer(reader, writer):
        writer.write(OK_JSON)

    looked_up = []
    real = asyncio.get_running_loop

    def counted():
        looked_up.append(1)
        return real()

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            await post(upstream, server.port)
            monkeypatch.setattr(asyncio, "get_running_loop", counted)
            for _ in range(3):
                assert (await post(upstream, server.port))[0] == 200
            monkeypatch.undo()
            upstream._pool.close()
            return server

    assert run(main()).connections == 1
    assert looked_up == []


def test_chunked_body_arrives_in_pieces_and_the_connection_is_reused():
    async def answer(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            for _ in range(2):
                response = await opened(upstream, "127.0.0.1", server.port, "/v1/chat/completions", b"{}")
                pieces: list[bytes] = []
                assert await upstream.relay(response, lambda data: pieces.append(data) or False)
                assert b"".join(pieces) == b"data: 1\n\ndata: [DONE]\n\n" and len(pieces) == 2
                assert response.at_eof() and response.content_type == "text/event-stream"
                response.release()
            upstream._pool.close()
            return server.connections

    assert run(main()) == 1


def test_truncated_body_fails_and_is_never_pooled():
    answer = answer_then_close(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            with pytest.raises(UpstreamFailure, match="^upstream_failed: ConnectionClosed"):
                await upstream.read_all(response)
            response.close()
            assert not upstream._pool._idle.get(("127.0.0.1", server.port))

    run(main())


def test_body_delimited_by_close_is_complete_and_not_reused():
    answer = answer_then_close(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"old\": 1}")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            assert await post(upstream, server.port) == (200, "application/json", b'{"old": 1}')
            assert await post(upstream, server.port) == (200, "application/json", b'{"old": 1}')
            return server.connections

    assert run(main()) == 2


def test_connection_close_answer_and_idle_closed_by_the_server_are_not_reused():
    answer = answer_then_close(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            for _ in range(3):
                assert (await post(upstream, server.port))[2] == b"ok"
            return server.connections

    assert run(main()) == 3


def test_a_connection_the_instance_closes_while_idle_leaves_the_pool():
    async def answer_then_hang_up(reader, writer):
        writer.write(OK_JSON)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # the instance's keep-alive timeout

    async def main():
        async with Server(answer_then_hang_up) as server:
            upstream = Upstream(settings())
            await post(upstream, server.port)
            assert len(upstream._pool._idle[("127.0.0.1", server.port)]) == 1
            await asyncio.sleep(0.3)
            assert ("127.0.0.1", server.port) not in upstream._pool._idle
            assert (await post(upstream, server.port))[2] == b'{"ok": true}'  # a new connection
            return server.connections

    assert run(main()) == 2


def test_a_connection_idle_past_the_keepalive_is_replaced():
    async def answer(reader, writer):
        writer.write(OK_JSON)

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            upstream._pool = Http1Pool(8, keepalive_s=0.05)
            await post(upstream, server.port)
            await asyncio.sleep(0.2)
            await post(upstream, server.port)
            upstream._pool.close()
            return server.connections

    assert run(main()) == 2


def large_answer(size: int) -> Answer:
    """An instance that answers `size` bytes at once, as fast as the socket takes them."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
    return answer


def test_large_body_pauses_reading_and_arrives_whole():
    size = 4 * HIGH_WATER

    async def main():
        async with Server(large_answer(size)) as server:
            upstream = Upstream(settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            await asyncio.sleep(0.3)  # the server writes everything it can meanwhile
            assert response._size <= HIGH_WATER + 256 * 1024  # reading paused near the mark
            total = len(await upstream.read_all(response))
            response.release()
            upstream._pool.close()
            return total

    assert run(main()) == size


def test_open_maps_refused_and_silent_instances():
    async def silent(reader, writer):  # never answers; notices when the proxy hangs up
        await reader.read()
        raise ConnectionResetError

    async def main():
        upstream = Upstream(settings(first_byte=0.3))
        async with Server(silent) as server:
            free = server.port
        with pytest.raises(HTTPError) as refused:
            await opened(upstream, "127.0.0.1", free, "/x", b"{}")
        assert (refused.value.status, refused.value.code) == (502, "upstream_unavailable")
        async with Server(silent) as server:
            with pytest.raises(HTTPError) as hung:
                await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            assert (hung.value.status, hung.value.code) == (504, "upstream_timeout")
            await asyncio.sleep(0.2)
            assert server.disconnects == 1  # the proxy closed the connection: the instance can stop
            assert not upstream._pool._idle.get(("127.0.0.1", server.port))

    run(main())


def test_the_first_byte_bound_counts_from_each_request_on_one_lazy_timer():
    """Requests on one kept-alive connection share one timer: armed by the first, it outlives
    answered requests, and a request sent after it was armed gets its full bound (re-armed,
    never failed early); the one that exceeds it fails with 504. (Bounds of a second and more:
    a loaded machine must not let the first timer fire before the second request is checked.)"""
    answers = 0

    async def answer_twice_then_hang(reader, writer):
        nonlocal answers
        answers += 1
        if answers <= 2:
            writer.write(OK_JSON)
        else:
            await reader.read()

    async def main():
        loop = asyncio.get_running_loop()
        async with Server(answer_twice_then_hang) as server:
            upstream = Upstream(settings(first_byte=1.0))
            await post(upstream, server.port)
            (conn,) = upstream._pool._idle[("127.0.0.1", server.port)]
            timer = conn._head_timer
            await asyncio.sleep(0.6)
            await post(upstream, server.port)
            assert conn._head_timer is timer  # no timer of its own for the second request
            await asyncio.sleep(0.3)  # the first request's bound runs out ~0.1 s into the third
            sent = loop.time()
            with pytest.raises(HTTPError) as hung:
                await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            waited = loop.time() - sent
        assert (hung.value.status, hung.value.code) == (504, "upstream_timeout")
        assert 1.0 <= waited < 2.5, waited
        assert conn._head_timer is None and conn.closed

    run(main())


def test_reset_before_the_head_is_upstream_unavailable():
    async def reset(reader, writer):
        writer.transport.abort()

    async def main():
        async with Server(reset) as server:
            upstream = Upstream(settings())
            with pytest.raises(HTTPError) as failed:
                await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            assert (failed.value.status, failed.value.code) == (502, "upstream_unavailable")

    run(main())


def test_request_line_brackets_ipv6_and_header_lines_keep_their_order():
    assert request_line("/v1/completions", "::1", 9001) == (
        b"POST /v1/completions HTTP/1.1\r\nHost: [::1]:9001\r\n")
    assert header_lines({"Content-Type": "application/json", "Authorization": "Bearer k"}) == (
        b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n")


def test_connection_closed_is_an_oserror():
    assert issubclass(ConnectionClosed, OSError)  # what Upstream.chunks turns into upstream_failed


def test_idle_bound_counts_only_waits_for_data():
    async def stall(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"one", b"two"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.1)
        await reader.read()  # then silence, until the proxy hangs up

    async def main():
        async with Server(stall) as server:
            upstream = Upstream(settings(idle=0.3))
            response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            got: list[bytes] = []
            with pytest.raises(UpstreamFailure, match="^upstream_idle_timeout"):
                # a slow client, full after every piece: the time it takes is not counted
                while not await upstream.relay(response, lambda data: got.append(data) or True):
                    await asyncio.sleep(0.5)
            response.close()
            assert b"".join(got) == b"onetwo"

    run(main())


def test_a_reused_connection_the_instance_closed_as_we_sent_is_retried_once_on_a_new_one():
    """The keep-alive race: the instance closes an idle connection just as a request goes out
    on it. It never read the request, so it is sent again on a new connection; a new
    connection that fails the same way is the instance's failure (502)."""
    async def main():
        async with Server(answering_once_per_connection()) as server:
            upstream = Upstream(settings())
            assert await post(upstream, server.port) == (200, "application/json", b'{"ok": true}')
            assert await post(upstream, server.port) == (200, "application/json", b'{"ok": true}')
            connections = server.connections
        async with Server(lambda reader, writer: _close(writer)) as server:
            with pytest.raises(HTTPError) as failed:  # a new connection is not retried
                await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            assert (failed.value.status, failed.value.code) == (502, "upstream_unavailable")
            return connections, server.connections

    assert run(main()) == (2, 1)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()


def answering_once_per_connection() -> Callable[[Any, asyncio.StreamWriter], Awaitable[None]]:
    """A handler that answers a connection's first request and closes it unanswered at its
    second (the keep-alive race). It keeps the writers it answered, not their id(): a freed
    writer's id may be the next connection's."""
    answered: list[asyncio.StreamWriter] = []

    async def answer(reader: Any, writer: asyncio.StreamWriter) -> None:
        if any(writer is done for done in answered):
            writer.close()
            return
        answered.append(writer)
        writer.write(OK_JSON)
    return answer


def test_sent_is_called_once_the_request_is_written_and_not_for_one_never_sent():
    """Upstream.open's `sent` (the lean path books a request with it): once a request, also when
    the keep-alive race sends it again; never when there was no connection to write it on."""
    sent: list[int] = []

    async def main():
        upstream = Upstream(settings())
        async with Server(answering_once_per_connection()) as server:
            for request in range(2):  # the second on a kept-alive connection the instance closes
                response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}",
                                               sent=lambda: sent.append(request))
                await upstream.read_all(response)
                response.release()
            free, requests = server.port, len(server.requests)
        with pytest.raises(HTTPError):  # refused: nothing written
            await opened(Upstream(settings()), "127.0.0.1", free, "/x", b"{}", sent=lambda: sent.append(-1))
        return requests

    assert run(main()) == 3 and sent == [0, 1]  # 3 written: the second request twice


def test_a_transfer_coding_other_than_chunked_is_delimited_by_the_close():
    answer = answer_then_close(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: identity\r\n\r\n{\"whole\": 1}")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            return await post(upstream, server.port)

    assert run(main()) == (200, "application/json", b'{"whole": 1}')


# --- relay: the body handed on from the connection's callback ------------------------------------
def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


def test_relay_hands_on_what_each_read_brought_in_one_call_and_reuses_the_connection():
    async def answer(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunked(b"data: 1\n\n", b"data: 2\n\n"))  # one write: one read, two chunks
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunked(b"data: 3\n\n") + b"0\r\n\r\n")

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(settings())
            for _ in range(2):
                response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
                calls: list[bytes] = []
                assert await upstream.relay(response, lambda data: calls.append(data) or False)
                assert calls == [b"data: 1\n\ndata: 2\n\n", b"data: 3\n\n"]
                response.release()
            upstream._pool.close()
            return server.connections

    assert run(main()) == 1


def test_a_full_sink_pauses_reading_until_relay_is_called_again():
    size = 4 * HIGH_WATER

    async def main():
        async with Server(large_answer(size)) as server:
            upstream = Upstream(settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            got: list[int] = []
            returns = []
            while True:
                done = await upstream.relay(response, lambda data: got.append(len(data)) or True)
                returns.append(done)
                if done:
                    break
                assert response._paused  # nothing more is read while the consumer is full
                await asyncio.sleep(0.02)
                assert response._size <= HIGH_WATER + 256 * 1024
            response.release()
            upstream._pool.close()
            return sum(got), returns

    total, returns = run(main())
    assert total == size and returns[-1] is True and returns.count(False) >= 2


def test_relay_ends_with_the_sinks_own_error():
    async def one_piece_then_silence(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b"one"))
        await writer.drain()
        await reader.read()  # until the proxy hangs up

    def broken(data: bytes) -> bool:
        raise RuntimeError("the consumer broke")

    async def main():
        async with Server(one_piece_then_silence) as server:
            upstream = Upstream(settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/x", b"{}")
            with pytest.raises(RuntimeError, match="consumer broke"):
                await upstream.relay(response, broken)
            response.close()
            upstream._pool.close()

    run(main())
