"""A relayed stream's whole chunks passed to the client as the instance framed them
(cacheroute_proxy/http1/_chunk_pass.c): what a ChunkPass passes and what it leaves to the parser,
that the two stay in step whatever the reads' cuts, and the wiring through a real connection:
an instance on a socket, the first piece through the relay's sink, keep-alive after."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute_proxy.http1.chunk_pass import NATIVE_CHUNK_PASS, ChunkPass
from cacheroute_proxy.http1.client import Http1Connection
from proxy_workers.sse import DONE_EVENT, PASS_TAIL, StreamRelay
from proxy_workers.upstream import Upstream
from tests.test_http1_client import Server, opened, run, settings as client_settings

pytestmark = pytest.mark.skipif(not NATIVE_CHUNK_PASS, reason="the C pass-through was not built")

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
MARKER, LOOK_BACK = PASS_TAIL


class Recorder:
    """A client's transport and connection, as a ChunkPass and a Cycle's writer see them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.write_paused = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def event(n: int, pad: int = 80) -> bytes:
    return b"data: " + json.dumps({"n": n, "text": "x" * pad}).encode() + b"\n\n"


def chunk(data: bytes, size_text: bytes | None = None) -> bytes:
    return (size_text or b"%x" % len(data)) + b"\r\n" + data + b"\r\n"


def passer(client: Recorder | None = None, ready: bool = True) -> Any:
    client = client or Recorder()
    p = ChunkPass(client, client, MARKER, LOOK_BACK)
    p.relaying, p.ready = True, ready
    return p


def dechunk(data: bytes) -> bytes:
    """The data of a chunked byte stream (no last chunk needed)."""
    out, at = [], 0
    while at < len(data):
        eol = data.index(b"\r\n", at)
        size = int(data[at:eol].split(b";")[0], 16)
        out.append(data[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2
    return b"".join(out)


# --- the ChunkPass itself ---------------------------------------------------------------------
def test_whole_chunks_pass_as_they_came_in_one_write():
    client = Recorder()
    p = passer(client)
    read = chunk(event(1)) + chunk(event(2), b"%08X" % len(event(2)))  # any size spelling
    assert p(read) == 1 and client.writes == [read] and p.passed == 1


@pytest.mark.parametrize("read, why", [
    (chunk(event(1)[:-2]), "the data does not end a line"),
    (chunk(b"x" * 60 + b"\ndata: [DONE]\n\n"), "the marker near the end"),
    (chunk(b"data: short\n\n"), "the last chunk is shorter than the window"),
    (chunk(event(1)) + chunk(b"data: [DONE]\n\n"), "the marker in the last chunk"),
])
def test_what_the_consumer_would_change_is_left_to_the_parser(read, why):
    client = Recorder()
    p = passer(client)
    assert p(read) == 0 and client.writes == [], why
    assert not p.lost and p(chunk(event(3))) == 1  # still in step: whole chunks again pass


def test_not_relaying_or_not_ready_passes_nothing_but_follows_the_framing():
    client = Recorder()
    p = passer(client, ready=False)
    assert p(chunk(event(1))[:30]) == 0  # a chunk cut by the read
    assert p(chunk(event(1))[30:] + chunk(event(2))) == 0  # not ready: parsed
    p.ready = True
    assert p(chunk(event(3))) == 1
    p.relaying = False
    assert p(chunk(event(4))) == 0 and client.writes == [chunk(event(3))]


@pytest.mark.parametrize("cuts", [(5,), (30,), (-2,), (-1,), (5, 30), (10, -2), (-3, -1), (6, 7, 8, -1)])
def test_a_chunk_read_in_pieces_is_followed_and_the_next_whole_read_passes(cuts):
    """Cut in the data or its CRLF (a size line cut by the read stops the following: below)."""
    client = Recorder()
    p = passer(client)
    whole = chunk(event(1))
    points = [0, *(c % len(whole) for c in cuts)]
    for start, end in zip(points, points[1:]):
        assert p(whole[start:end]) == 0
    assert p(whole[points[-1]:] + chunk(event(2))) == 0  # began mid-chunk: the parser's
    assert p(chunk(event(3))) == 1 and not p.lost


@pytest.mark.parametrize("read", [
    b"5a", b"5a\r", chunk(event(1), b"%x;ext=1" % len(event(1))), b"0\r\n\r\n", b"zz\r\nab\r\n",
    b"3\r\nabcXY",  # no CRLF after the data
])
def test_framing_it_does_not_follow_leaves_every_later_read_to_the_parser(read):
    p = passer()
    assert p(read) == 0 and p.lost
    assert p(chunk(event(1))) == 0


def test_a_full_client_and_a_closing_transport():
    client = Recorder()
    p = passer(client)
    client.write_paused = True
    assert p(chunk(event(1))) == 2 and client.writes == [chunk(event(1))]
    client.closing = True
    client.write_paused = False
    assert p(chunk(event(2))) == 1 and client.writes == [chunk(event(1))]  # nobody to write to


def test_a_failing_write_raises_to_the_caller():
    class Broken(Recorder):
        def write(self, data: bytes) -> None:
            raise RuntimeError("gone")

    client = Broken()
    p = passer(client)
    with pytest.raises(RuntimeError, match="gone"):
        p(chunk(event(1)))


# --- with the connection's parser: in step whatever the cuts --------------------------------
class _Pool:
    def put(self, conn: Any) -> None:
        pass

    def discard(self, conn: Any) -> None:
        pass


def _relay_reads(reads: list[bytes], with_passer: bool) -> tuple[bytes, bool, int]:
    """Feed an Http1Connection `reads` of an event stream with a StreamRelay as its sink:
    (what the client got, de-chunked, with what the relay held at the end; the body ended;
    reads passed)."""
    loop = asyncio.new_event_loop()
    try:
        conn = Http1Connection(_Pool(), ("127.0.0.1", 1), loop)  # type: ignore[arg-type]
        conn.connection_made(Recorder())  # type: ignore[arg-type]
        response = conn.request(b"POST / HTTP/1.1\r\n\r\n", loop.time() + 60)
        conn.data_received(HEAD)
        assert conn.body_read == b""
        client = Recorder()

        def write_part(body: bytes) -> bool:
            client.write(chunk(body))
            return False

        relay = StreamRelay(write_part, lambda: None, passer(client, ready=False) if with_passer else None)
        response._sink = relay
        if with_passer:
            response._passer = relay.passer
            relay.passer.relaying = True
        for read in reads:
            conn.data_received(read)
        held = relay.flush()
        passed = relay.passer.passed if relay.passer is not None else 0
        return dechunk(b"".join(client.writes)) + held, response._eof, passed
    finally:
        loop.close()


@st.composite
def cut_streams(draw: Any) -> tuple[list[bytes], bytes]:
    events = [event(n, draw(st.integers(0, 120))) for n in range(draw(st.integers(1, 8)))]
    if draw(st.booleans()):
        events.append(DONE_EVENT)
    body = b"".join(chunk(e) for e in events) + b"0\r\n\r\n"
    cuts = sorted(set(draw(st.lists(st.integers(1, len(body) - 1), max_size=6))))
    reads = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    return reads, b"".join(events)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(case=cut_streams())
def test_with_the_pass_the_client_gets_what_the_parser_alone_gives(case):
    reads, sent = case
    parsed, parsed_ended, _ = _relay_reads(reads, with_passer=False)
    passed, passed_ended, _ = _relay_reads(reads, with_passer=True)
    # The instance's [DONE] is withheld either way (the exchange sends its own after the meta).
    assert passed == parsed == sent.removesuffix(DONE_EVENT) and passed_ended and parsed_ended


def test_a_stream_read_a_chunk_at_a_time_passes_all_but_its_first_and_last_reads():
    events = [event(n) for n in range(5)]
    reads = [chunk(e) for e in events] + [chunk(DONE_EVENT), b"0\r\n\r\n"]
    content, ended, passed = _relay_reads(reads, with_passer=True)
    assert content == b"".join(events) and ended and passed == 4


# --- through a real connection ----------------------------------------------------------------
def instance_writing(reads: list[bytes], gap_s: float = 0.05) -> Any:
    """An instance that answers with `reads`, each in a write of its own, `gap_s` apart."""
    async def answer(reader, writer):
        for read in reads:
            writer.write(read)
            await writer.drain()
            await asyncio.sleep(gap_s)
    return answer


def test_through_a_socket_whole_reads_keep_the_instances_framing_and_the_connection_is_reused():
    two = chunk(event(2)) + chunk(event(3))
    answer = instance_writing([HEAD, chunk(event(1)), two, chunk(DONE_EVENT) + b"0\r\n\r\n"])

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(client_settings())
            for _ in range(2):
                response = await opened(upstream, "127.0.0.1", server.port, "/v1/chat/completions", b"{}")
                client = Recorder()
                pieces: list[bytes] = []
                relay = StreamRelay(lambda data: pieces.append(data) or False, lambda: None,
                                    passer(client, ready=False))
                assert await upstream.relay(response, relay, relay.passer)
                assert pieces == [event(1)] and client.writes == [two]  # two chunks, as they came
                assert relay.flush() == b"" and relay.saw_done and relay.passer.passed == 1
                response.release()
            upstream._pool.close()
            return server.connections

    assert run(main()) == 1


def _relayed(reads: list[bytes]) -> tuple[list[bytes], list[bytes], int]:
    """A stream relayed from an instance writing `reads` apart: (what reached the relay's sink,
    what was passed on as it came, reads passed)."""
    async def main():
        async with Server(instance_writing(reads)) as server:
            upstream = Upstream(client_settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/v1/chat/completions", b"{}")
            pieces: list[bytes] = []
            client = Recorder()
            relay = StreamRelay(lambda data: pieces.append(data) or False, lambda: None,
                                passer(client, ready=False))
            assert await upstream.relay(response, relay, relay.passer)
            response.release()
            upstream._pool.close()
            return pieces, client.writes, relay.passer.passed

    return run(main())


def test_a_head_that_brought_body_bytes_along_is_followed_from_them():
    cut = chunk(event(1))[:20]  # the first chunk, cut by the read: the passer follows it too
    pieces, passed_on, passed = _relayed([HEAD + cut, chunk(event(1))[20:], chunk(event(2)), b"0\r\n\r\n"])
    assert b"".join(pieces) == event(1) and passed_on == [chunk(event(2))] and passed == 1


def test_a_head_split_across_reads_leaves_its_body_to_the_parser():
    pieces, passed_on, passed = _relayed([HEAD[:30], HEAD[30:] + chunk(event(1)), chunk(event(2)),
                                          b"0\r\n\r\n"])
    assert b"".join(pieces) == event(1) + event(2) and passed_on == [] and passed == 0


def test_a_full_client_stops_the_reading_until_the_relay_is_called_again():
    events = [event(n) for n in range(6)]
    answer = instance_writing([HEAD, *map(chunk, events), b"0\r\n\r\n"], gap_s=0.02)

    async def main():
        async with Server(answer) as server:
            upstream = Upstream(client_settings())
            response = await opened(upstream, "127.0.0.1", server.port, "/v1/chat/completions", b"{}")
            client = Recorder()  # the relay's sink frames what it writes, as a Cycle does
            relay = StreamRelay(lambda data: client.write(chunk(data)) or False, lambda: None,
                                passer(client, ready=False))
            client.write_paused = True  # full from the first read passed on
            rounds = 0
            while not await upstream.relay(response, relay, relay.passer):
                rounds += 1
                assert response._paused and not relay.passer.relaying
                written = len(client.writes)
                await asyncio.sleep(0.05)
                assert len(client.writes) == written  # nothing read, nothing passed meanwhile
                if rounds == 2:
                    client.write_paused = False
            response.release()
            upstream._pool.close()
            return client.writes, relay.passer.passed, rounds

    writes, passed, rounds = run(main())
    # What piled up while the reading stopped comes in fewer reads; all of it, in order.
    assert dechunk(b"".join(writes)) == b"".join(events) and passed >= rounds >= 1
