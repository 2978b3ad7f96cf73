"""The worker's own HTTP/1.1 server (cacheroute_proxy/http1/) against raw sockets on
127.0.0.1: framing, keep-alive, pipelining, limits, malformed input, disconnects, drain.

Under it: small routes of the test's own, given the Cycle as the worker's proxied routes are,
and a small ASGI app (as Starlette is behind them), with the real Drain, so what is tested is
the server's own behaviour; the worker's routes on it are tested end to end by every e2e file."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from proxy_workers.app import read_body
from proxy_workers.drain import Drain
from proxy_workers.relay import watch_disconnect
from cacheroute_proxy.http import HTTPError
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http1 import BadBody, ClientGone, Cycle, GracefulExit, HeadLimits, Http1Server, head_limits
from tests.harness import wait_until

LIMIT = 1000
LARGE_LIMIT = 2 * 1024 * 1024  # /hang-large, /echo-large: bodies far past the read high-water mark
BIG_CHUNK = b"b" * 65536
BIG_CHUNKS = 200  # 13 MB: far more than the kernel's socket buffers hold on loopback


async def run_until_disconnect(work: Any, cycle: Cycle) -> Any:
    """Await `work` in this task under the exchange's DisconnectWatch, as its attempt does; if
    the client disconnects first, cancel it and return None."""
    watch = watch_disconnect(cycle)
    if watch is None:  # gone before we started watching
        work.close()
        return None
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.absorbed():
            raise
        return None
    finally:
        watch.disarm()


class App:
    """The server's own routes, given the Cycle (as the worker's proxied routes are): /echo the
    body back (413 past LIMIT, by the worker's read_body; /echo-large past LARGE_LIMIT); /whole
    one write through send_whole; /hang waits until the client leaves (run_until_disconnect),
    and records it; /hang-large reads its body first, as the worker's routes do; /big-direct
    BIG_CHUNKS chunks by `write`, /big-writer by `body_writer()` (-sized: with their length, so
    unframed); /boom-direct raises.

    And an ASGI app behind them (as Starlette is in the worker): /stream?n n chunks, /big
    BIG_CHUNKS chunks, /boom raises."""

    def __init__(self) -> None:
        self.gone: list[str] = []
        self.sent = 0  # /big: chunks whose send returned
        self.progress: list[tuple[bool, bool]] = []
        self.release = asyncio.Event()
        self.waiting: list[int] = []  # /hang-large: the size of each body read before waiting
        self.routes = {("POST", b"/echo"): self.echo, ("POST", b"/whole"): self.whole,
                       ("POST", b"/hang"): self.hang, ("POST", b"/big-direct"): self.big,
                       ("POST", b"/big-writer"): functools.partial(self.big, by_writer=True),
                       ("POST", b"/big-writer-sized"): functools.partial(self.big, by_writer=True, sized=True),
                       ("POST", b"/boom-direct"): self.boom, ("POST", b"/late"): self.late,
                       ("POST", b"/echo-large"): functools.partial(self.echo, limit=LARGE_LIMIT),
                       ("POST", b"/hang-large"): self.hang_large}
        self.late_go = asyncio.Event()
        self.ran: list[str] = []

    async def echo(self, cycle: Cycle, limit: int = LIMIT) -> None:
        try:
            body = await read_body(cycle, limit)
        except BadBody:
            self.gone.append("bad body")
            return
        except ClientGone:
            self.gone.append("body")
            return
        except HTTPError as exc:  # 413
            cycle.start(exc.status, [(b"content-length", b"0")])
            cycle.end()
            return
        cycle.start(200, [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))])
        cycle.end(body)

    async def whole(self, cycle: Cycle) -> None:
        assert cycle.send_whole(201, [(b"content-type", b"application/json")], b'{"a":1}')

    async def hang(self, cycle: Cycle) -> None:
        result = await run_until_disconnect(self.release.wait(), cycle)
        if result is None:
            self.gone.append("hang")
        else:
            cycle.start(200, [(b"content-length", b"2")])
            cycle.end(b"ok")

    async def hang_large(self, cycle: Cycle) -> None:
        try:
            body = await read_body(cycle, LARGE_LIMIT)
        except ClientGone:
            self.gone.append("body")
            return
        self.waiting.append(len(body))
        if await run_until_disconnect(self.release.wait(), cycle) is None:
            self.gone.append("hang-large")
        else:
            cycle.start(200, [(b"content-length", b"2")])
            cycle.end(b"ok")

    async def late(self, cycle: Cycle) -> None:
        """Reaches run_until_disconnect only once the test says (after the client left)."""
        await self.late_go.wait()

        async def work() -> None:
            self.ran.append("late")

        if await run_until_disconnect(work(), cycle) is None:
            self.gone.append("late")

    async def big(self, cycle: Cycle, by_writer: bool = False, sized: bool = False) -> None:
        length = [(b"content-length", b"%d" % (BIG_CHUNKS * len(BIG_CHUNK)))] if sized else []
        cycle.start(200, [(b"content-type", b"application/octet-stream"), *length])
        write = cycle.body_writer() if by_writer else cycle.write
        for _ in range(BIG_CHUNKS):
            if write(BIG_CHUNK):
                await cycle.writable()
            self.sent += 1
        cycle.end()

    async def boom(self, cycle: Cycle) -> None:
        raise RuntimeError("boom")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        cycle = send.__self__  # the server's Cycle: how far its response is
        if path == "/stream":
            n = int(scope["query_string"] or b"3")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            self.progress.append((cycle.started, cycle.complete))
            for i in range(n):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.progress.append((cycle.started, cycle.complete))
        elif path == "/big":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream")]})
            for _ in range(BIG_CHUNKS):
                await send({"type": "http.response.body", "body": BIG_CHUNK, "more_body": True})
                self.sent += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            raise RuntimeError("boom")


class Running:
    def __init__(self, keepalive_s: float = 5.0, drain_s: float = 5.0, graceful: bool = False,
                 limits: HeadLimits = head_limits(Settings())) -> None:
        self.app = App()
        self.drain = GracefulExit(drain_s) if graceful else Drain(drain_s)
        self.server = Http1Server(self.app, self.drain, keepalive_s, limits, routes=self.app.routes,
                                  handle_signals=False)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.server.serve([self.sock]),), daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.has_started(), 5, message="server started")

    def call(self, fn: Any) -> None:
        self.loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        self.call(self.server.request_exit)
        self.thread.join(timeout=15)
        assert not self.thread.is_alive()


@pytest.fixture
def srv() -> Iterator[Running]:
    running = Running()
    yield running
    running.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from `sock` (content-length or chunked), leaving what follows in `buf`."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed; got {bytes(buf)!r}")
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name.lower() not in headers, f"duplicate {name}"
        headers[name.lower()] = value.strip()
    buf[:] = rest
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            buf += sock.recv(65536)
        body = bytes(buf[:n])
        del buf[:n]
        return status, headers, body
    assert headers.get("transfer-encoding") == "chunked", headers
    parts = []
    while True:
        while buf.find(b"\r\n") < 0:
            buf += sock.recv(65536)
        start = buf.find(b"\r\n") + 2
        size = int(buf[:start - 2], 16)
        while len(buf) < start + size + 2:
            buf += sock.recv(1 << 20)
        parts.append(bytes(buf[start:start + size]))
        del buf[:start + size + 2]
        if size == 0:
            return status, headers, b"".join(parts)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def test_keep_alive_by_default_and_one_of_each_server_header(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    for i in range(3):
        sock.sendall(post("/echo", b"hello %d" % i))
        status, headers, body = read_response(sock, buf)
        assert (status, body) == (200, b"hello %d" % i)
        assert "connection" not in headers and headers["server"] == "cacheroute-proxy"
        assert headers["date"].endswith("GMT")


def test_pipelined_requests_are_answered_in_order(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post("/stream?4", b"") + post("/echo", b"second") + post("/whole", b"")
                 + post("/echo", b"fourth"))
    assert read_response(sock, buf)[2] == b"".join(b"data: %d\n\n" % i for i in range(4))
    assert read_response(sock, buf)[2] == b"second"
    status, headers, body = read_response(sock, buf)
    assert (status, body, headers["content-type"]) == (201, b'{"a":1}', "application/json")
    assert read_response(sock, buf)[2] == b"fourth"


def test_connection_close_is_honoured(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post("/echo", b"x", "Connection: close\r\n"))
    status, headers, _ = read_response(sock, buf)
    assert status == 200 and headers["connection"] == "close"
    assert closed(sock)


def test_http_1_0_closes_after_its_answer_and_streams_are_chunked(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post("/stream?2", b"", version="1.0"))
    status, headers, body = read_response(sock, buf)
    assert status == 200 and headers["connection"] == "close" and body == b"data: 0\n\ndata: 1\n\n"
    assert closed(sock)
    assert srv.app.progress == [(True, False), (True, True)]


@pytest.mark.parametrize("path", ["/big-writer", "/big-writer-sized"])
def test_a_body_writer_frames_as_write_does(srv: Running, path: str) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post(path, b""))
    status, headers, body = read_response(sock, buf)
    sized = path.endswith("-sized")  # the app gave the length: the parts go unframed
    assert status == 200 and ("transfer-encoding" in headers) is not sized
    assert body == BIG_CHUNK * BIG_CHUNKS
    sock.sendall(post("/echo", b"next"))  # the connection is whole for the next request
    assert read_response(sock, buf)[2] == b"next"


class _QuietConnection:
    """What a Cycle tells its connection about reading, ignored."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_whole_body_takes_a_body_all_here_and_leaves_anything_else_to_read_body() -> None:
    def cycle(*parts: bytes, ended: bool = True) -> Cycle:
        made = Cycle(_QuietConnection(), "POST", b"/echo", b"", [], "1.1", True)  # type: ignore[arg-type]
        for part in parts:
            made.feed(part)
        if ended:
            made.end_of_body()
        return made
    whole = cycle(b"ab", b"cd")
    assert whole.whole_body(LIMIT) == b"abcd" and whole.whole_body(LIMIT) == b""  # taken, as read_body does
    assert cycle(b"ab", ended=False).whole_body(LIMIT) is None  # more to come: read_body waits for it
    large = cycle(b"x" * (LIMIT + 1))
    assert large.whole_body(LIMIT) is None and large.body_size == LIMIT + 1  # read_body says 413
    gone = cycle(b"ab")
    gone.lost()
    assert gone.whole_body(LIMIT) is None and gone.body_size == 2  # read_body says the client left


def test_a_body_over_the_limit_is_413_declared_or_chunked(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post("/echo", b"x" * (LIMIT + 1)))
    assert read_response(sock, buf)[0] == 413
    sock.sendall(post("/echo", b"after"))  # the connection is still usable
    assert read_response(sock, buf)[2] == b"after"
    sock2, buf2 = connect(srv.port), bytearray()
    chunk = b"y" * 600
    sock2.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                  + b"%x\r\n%b\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n")
    assert read_response(sock2, buf2)[0] == 413


def test_a_malformed_request_gets_400_and_close(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(b"NOT A REQUEST\r\n\r\n")
    status, headers, _ = read_response(sock, buf)
    assert status == 400 and headers["connection"] == "close"
    assert closed(sock)


def test_a_chunk_size_that_does_not_parse_is_400_and_the_handler_is_told(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    wait_until(lambda: srv.server.requests_in_flight() == 1, 5, message="the handler reads the body")
    sock.sendall(b"zz\r\n")
    status, headers, _ = read_response(sock, buf)
    assert status == 400 and headers["connection"] == "close"
    assert closed(sock)
    wait_until(lambda: srv.app.gone == ["bad body"], 5, message="read_body raised BadBody")


def test_a_head_line_still_arriving_is_refused_once_past_the_limit() -> None:
    """A header value that never ends, 1 KiB a read: refused once what arrived of the head
    passes the limit (4 KiB here), not held for ever."""
    running = Running(limits=HeadLimits(url_bytes=1024, head_bytes=4096, headers=10, timeout_s=60))
    try:
        sock, buf = connect(running.port), bytearray()
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nx-long: ")
        for _ in range(64):
            try:
                sock.sendall(b"v" * 1024)
            except OSError:
                break  # closed by the server
            time.sleep(0.01)  # not a timing assertion: one piece a read
        status, headers, _ = read_response(sock, buf)
        assert status == 431 and headers["connection"] == "close"
        assert closed(sock)
    finally:
        running.stop()


@pytest.mark.parametrize("path", ["/boom", "/boom-direct"])
def test_an_app_failure_before_answering_is_500(srv: Running, path: str) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post(path, b""))
    assert read_response(sock, buf)[0] == 500
    assert closed(sock)


def test_a_client_that_leaves_mid_body_is_seen(srv: Running) -> None:
    sock = connect(srv.port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 500\r\n\r\n" + b"z" * 100)
    time.sleep(0.05)  # not a timing assertion: lets the head reach the app before the close
    sock.close()
    wait_until(lambda: srv.app.gone == ["body"], 5, message="the app saw the client leave")


def test_a_client_that_leaves_while_waiting_cancels_the_work(srv: Running) -> None:
    sock = connect(srv.port)
    sock.sendall(post("/hang", b""))
    wait_until(lambda: srv.server.requests_in_flight() == 1, 5, message="request running")
    sock.close()
    wait_until(lambda: srv.app.gone == ["hang"], 5, message="disconnect callback")
    wait_until(lambda: srv.server.requests_in_flight() == 0, 5, message="task ended")


def test_a_client_that_leaves_after_a_large_body_is_seen_while_waiting(srv: Running) -> None:
    """A body past the read high-water mark (64 KiB) paused reading; once it is all in, the
    server reads on, so the client's leaving is seen as it is after a small body."""
    sock = connect(srv.port)
    sock.sendall(post("/hang-large", b"m" * 1_000_000))
    wait_until(lambda: srv.app.waiting == [1_000_000], 5, message="the body read, the app waiting")
    sock.close()
    wait_until(lambda: srv.app.gone == ["hang-large"], 5, message="disconnect callback")
    wait_until(lambda: srv.server.requests_in_flight() == 0, 5, message="task ended")


def test_a_client_that_pipelines_and_leaves_is_seen(srv: Running) -> None:
    """A pipelined request waits its turn unparsed, and the socket is still read meanwhile."""
    sock = connect(srv.port)
    sock.sendall(post("/hang", b"") + post("/echo", b"next"))
    wait_until(lambda: srv.server.requests_in_flight() == 1, 5, message="request running")
    wait_until(lambda: any(c.queued for c in list(srv.server.connections)), 5,
               message="the second request waits its turn")
    sock.close()
    wait_until(lambda: srv.app.gone == ["hang"], 5, message="disconnect callback")
    wait_until(lambda: srv.server.requests_in_flight() == 0, 5, message="task ended")


def test_pipelined_bytes_past_the_bound_wait_their_turn(srv: Running) -> None:
    """Behind a request in flight, what follows a pipelined request's head is held unparsed
    only up to a bound, then reading pauses; once its turn comes it is read and answered, in
    order."""
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(post("/hang", b""))
    wait_until(lambda: srv.server.requests_in_flight() == 1, 5, message="request running")
    large = b"p" * 1_000_000
    pipelined = post("/echo-large", large) + post("/echo", b"last")
    head_end = pipelined.index(b"\r\n\r\n") + 4
    sock.sendall(pipelined[:head_end])  # the head alone: its request waits its turn
    wait_until(lambda: any(c.queued for c in list(srv.server.connections)), 5,
               message="the second request waits its turn")
    sender = threading.Thread(target=sock.sendall, args=(pipelined[head_end:],))
    sender.start()  # its body and the next request, held behind it
    wait_until(lambda: any(c.reading_paused for c in list(srv.server.connections)), 5,
               message="reading paused past the bound")
    srv.call(srv.app.release.set)
    assert read_response(sock, buf)[2] == b"ok"
    assert read_response(sock, buf)[2] == large
    assert read_response(sock, buf)[2] == b"last"
    sender.join(timeout=5)


def test_work_is_not_started_for_a_client_already_gone(srv: Running) -> None:
    sock = connect(srv.port)
    sock.sendall(post("/late", b""))
    wait_until(lambda: srv.server.requests_in_flight() == 1, 5, message="request running")
    sock.close()
    wait_until(lambda: not srv.server.connections, 5, message="the server saw the client leave")
    srv.call(srv.app.late_go.set)
    wait_until(lambda: srv.app.gone == ["late"], 5, message="run_until_disconnect returned None")
    assert srv.app.ran == []  # the work was closed, never run
    wait_until(lambda: srv.server.requests_in_flight() == 0, 5, message="task ended")


def test_an_idle_connection_is_closed_after_the_keepalive_timeout() -> None:
    running = Running(keepalive_s=0.3)
    try:
        sock, buf = connect(running.port), bytearray()
        sock.sendall(post("/echo", b"a"))
        assert read_response(sock, buf)[2] == b"a"
        assert closed(sock)  # the server closes it (the socket's own timeout is 5 s)
    finally:
        running.stop()


def test_drain_finishes_the_request_in_flight_with_connection_close() -> None:
    running = Running(drain_s=5.0)
    try:
        sock, buf = connect(running.port), bytearray()
        sock.sendall(post("/hang", b""))
        wait_until(lambda: running.server.requests_in_flight() == 1, 5, message="request running")
        running.call(running.server.request_exit)
        wait_until(lambda: running.drain.draining, 5, message="drain began")
        with pytest.raises(ConnectionRefusedError):  # the listener is closed
            socket.create_connection(("127.0.0.1", running.port), timeout=1)
        running.call(running.app.release.set)
        status, headers, body = read_response(sock, buf)
        assert (status, body, headers["connection"]) == (200, b"ok", "close")
        running.thread.join(timeout=10)
        assert not running.thread.is_alive() and running.drain.finished == 1
    finally:
        if running.thread.is_alive():
            running.stop()


def test_a_graceful_exit_closes_idle_connections_at_once() -> None:
    """The sidecar's drain: no peer takes over its port, so an idle keep-alive connection is
    closed when the exit begins, not at the keep-alive timeout or the drain deadline (30 s
    here, the socket's own timeout 5 s: only the exit can close it in time)."""
    running = Running(keepalive_s=30.0, drain_s=30.0, graceful=True)
    try:
        sock, buf = connect(running.port), bytearray()
        sock.sendall(post("/echo", b"a"))
        assert read_response(sock, buf)[2] == b"a"
        running.call(running.server.request_exit)
        assert closed(sock)
        running.thread.join(timeout=10)
        assert not running.thread.is_alive()
    finally:
        if running.thread.is_alive():
            running.stop()


def test_drain_deadline_cuts_a_request_with_503() -> None:
    running = Running(drain_s=0.3)
    try:
        sock, buf = connect(running.port), bytearray()
        sock.sendall(post("/hang", b""))
        wait_until(lambda: running.server.requests_in_flight() == 1, 5, message="request running")
        running.call(running.server.request_exit)
        status, headers, body = read_response(sock, buf)
        assert status == 503 and json.loads(body)["error"] == "worker_draining"
        assert headers["retry-after"] == "1"  # as every 429 and 503 the proxy answers itself
        running.thread.join(timeout=10)
        assert running.drain.cut == 1
    finally:
        if running.thread.is_alive():
            running.stop()


# --- a real cluster ----------------------------------------------------------------------------------
def test_a_cluster_answers_on_both_ports(make_cluster: Any) -> None:
    from tests.harness import http

    cluster = make_cluster(workers=2)  # checks the server header
    inst = cluster.add_instance()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for url in (cluster.dp_url, cluster.worker_url(0), cluster.worker_url(1)):
        status, answer, headers = http("POST", f"{url}/v1/chat/completions", body)
        assert status == 200 and headers["x-cacheroute-instance"] == inst.instance_id, answer
        assert headers["server"] == "cacheroute-proxy" and "_cacheroute_meta" in answer
        status, answer, headers = http("POST", f"{url}/v1/chat/completions", {**body, "stream": True})
        assert status == 200 and answer.endswith("data: [DONE]\n\n"), answer
        assert headers["transfer-encoding"] == "chunked"


def test_expect_100_continue_is_answered_before_the_body(srv: Running) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\nExpect: 100-continue\r\n\r\n")
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(100)
    assert bytes(buf).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    del buf[:len(b"HTTP/1.1 100 Continue\r\n\r\n")]
    sock.sendall(b"later")
    assert read_response(sock, buf)[2] == b"later"


@pytest.mark.parametrize("path", ["/big", "/big-direct", "/big-writer"])
def test_a_client_that_does_not_read_holds_back_the_sender(srv: Running, path: str) -> None:
    sock, buf = connect(srv.port), bytearray()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.sendall(post(path, b""))
    wait_until(lambda: any(c.write_paused for c in list(srv.server.connections)), 10,
               message="the transport paused writing")
    assert srv.app.sent < BIG_CHUNKS  # waiting in send, not buffering the whole answer
    status, _, body = read_response(sock, buf)
    assert status == 200 and len(body) == BIG_CHUNKS * len(BIG_CHUNK)
    assert srv.app.sent == BIG_CHUNKS
