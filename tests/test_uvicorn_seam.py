"""Everything cacheroute_proxy/uvicorn_seam.py relies on, against a real uvicorn server on
127.0.0.1 running the worker's own protocol class: if the pinned uvicorn's internals move, these
fail instead of the worker silently taking the slow path (or answering wrongly)."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any, Awaitable, Callable

import uvicorn
import uvloop

from cacheroute_proxy import uvicorn_seam as seam
from cacheroute_proxy.uvicorn_seam import (
    cycle_of,
    draining_protocol,
    send_whole,
    unwatch_disconnect,
    watch_disconnect,
)
from proxy_workers.drain import Drain
from proxy_workers.exchange import run_until_disconnect

Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]
BODY = b'{"answer": 42}'


class Harness:
    """uvicorn with the worker's protocol on a pre-bound port, and what the app saw."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.fast: list[bool] = []
        self.events: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, http=draining_protocol(Drain(5.0)), loop="asyncio",
                                lifespan="off", log_config=None, access_log=False,
                                timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Harness:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await asyncio.wait_for(self.task, 10)


async def exchange(port: int, requests: list[bytes], read_until_close: bool = False) -> bytes:
    """Send raw requests on one connection; the bytes that came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        for sent, request in enumerate(requests, 1):
            writer.write(request)
            await writer.drain()
            while received.count(BODY) < sent:  # each answer before the next request
                chunk = await asyncio.wait_for(reader.read(65536), 5)
                if not chunk:
                    break
                received += chunk
        if read_until_close:
            received += await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    return received


def in_loop(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """An async test run to completion on uvloop (the worker's loop), bounded."""
    def run() -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(asyncio.wait_for(test(), 30))  # type: ignore[arg-type]
    return run


def http_app(handle: Callable[[Scope, Any, Any], Awaitable[None]]) -> App:
    """An ASGI app that reads the request, then runs `handle(scope, send, receive)`."""
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await receive()
            await handle(scope, send, receive)
    return app


def post(extra: bytes = b"") -> bytes:
    return b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n" + extra + b"\r\n{}"


async def send_plain(send: Any, status: int = 200, body: bytes = BODY) -> None:
    """A response through ASGI `send`: head (announcing BODY's length), then body."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": body})


def whole_app(harness_ref: list[Harness]) -> App:
    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        fast = send_whole(send, 200, [(b"content-type", b"application/json"),
                                      (b"x-test", b"yes")], BODY)
        harness_ref[0].fast.append(fast)
        if not fast:
            await send_plain(send)
    return app


@in_loop
async def test_whole_response_in_one_write_keeps_the_connection_alive() -> None:
    ref: list[Harness] = []
    async with Harness(whole_app(ref)) as harness:
        ref.append(harness)
        received = await exchange(harness.port, [post(), post(), post()])
    assert harness.fast == [True, True, True]  # the pinned uvicorn takes the fast path
    answers = received.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 3  # all on one connection: keep-alive bookkeeping done each time
    for answer in answers:
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"200 OK")
        assert b"content-length: %d" % len(BODY) in head
        assert b"x-test: yes" in head and b"content-type: application/json" in head
        assert b"connection: close" not in head
        assert body == BODY


@in_loop
async def test_whole_response_honours_connection_close() -> None:
    ref: list[Harness] = []
    async with Harness(whole_app(ref)) as harness:
        ref.append(harness)
        received = await exchange(harness.port, [post(b"connection: close\r\n")],
                                  read_until_close=True)
    assert harness.fast == [True]
    assert b"connection: close" in received and received.endswith(BODY)


@in_loop
async def test_head_and_started_responses_take_the_normal_path() -> None:
    results: list[bool] = []

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        if scope["method"] == "HEAD":
            results.append(send_whole(send, 200, [], BODY))
            await send_plain(send, body=b"")
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(BODY)).encode())]})
        results.append(send_whole(send, 200, [], BODY))  # too late: the head is out
        await send({"type": "http.response.body", "body": BODY})

    async with Harness(app) as harness:
        await exchange(harness.port, [post()])
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert results == [False, False]
    assert head.startswith(b"HTTP/1.1 200 OK")


@in_loop
async def test_a_header_value_with_a_line_break_is_refused() -> None:
    errors: list[str] = []

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        try:
            send_whole(send, 200, [(b"x-bad", b"a\r\nset-cookie: x")], BODY)
        except RuntimeError as exc:
            errors.append(str(exc))
        await send_plain(send, 500)

    async with Harness(app) as harness:
        received = await exchange(harness.port, [post()])
    assert errors == ["Invalid HTTP header value."]
    assert received.startswith(b"HTTP/1.1 500") and b"set-cookie" not in received


@in_loop
async def test_disconnect_callback_fires_once_when_the_client_leaves() -> None:
    called: list[str] = []
    registered = asyncio.Event()
    finished = asyncio.Event()

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        cycle = watch_disconnect(send, lambda: called.append("gone"))
        assert cycle is not None
        registered.set()
        for _ in range(500):  # the answer never comes: the client gives up first
            if called:
                break
            await asyncio.sleep(0.01)
        unwatch_disconnect(cycle)
        finished.set()

    async with Harness(app) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(registered.wait(), 5)
        writer.close()
        await asyncio.wait_for(finished.wait(), 5)
    assert called == ["gone"]


@in_loop
async def test_no_callback_after_unwatch_or_after_the_response() -> None:
    called: list[str] = []
    done = asyncio.Event()

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        cycle = watch_disconnect(send, lambda: called.append("unwatched"))
        assert cycle is not None
        unwatch_disconnect(cycle)
        watch_disconnect(send, lambda: called.append("after the response"))
        assert send_whole(send, 200, [], BODY)
        done.set()

    async with Harness(app) as harness:
        received = await exchange(harness.port, [post()])
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.1)  # the connection is closed by now; no callback may run
    assert received.endswith(BODY)
    assert called == []


def test_other_servers_get_plain_asgi() -> None:
    async def send(message: dict[str, Any]) -> None:  # not a uvicorn cycle's bound method
        raise AssertionError("not called")

    assert send_whole(send, 200, [], BODY) is False
    assert watch_disconnect(send, lambda: None) is None


@in_loop
async def test_run_until_disconnect_cancels_the_work_when_the_client_leaves() -> None:

    outcome: list[object] = []
    started = asyncio.Event()
    finished = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.sleep(30)  # an upstream that never answers
        return "answered"

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        outcome.append(await run_until_disconnect(work(), send, receive))
        finished.set()

    async with Harness(app) as harness:
        _, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(started.wait(), 5)
        writer.close()
        await asyncio.wait_for(finished.wait(), 5)
    assert outcome == [None]  # cancelled and absorbed: not an error, not "answered"


@in_loop
async def test_run_until_disconnect_does_not_start_for_a_client_already_gone() -> None:

    outcome: list[object] = []
    ran: list[bool] = []
    finished = asyncio.Event()

    async def work() -> str:
        ran.append(True)
        return "answered"

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        cycle = cycle_of(send)
        assert cycle is not None
        while not cycle.disconnected:  # the client leaves between its body and the forward
            await asyncio.sleep(0.01)
        outcome.append(await run_until_disconnect(work(), send, receive))
        finished.set()

    async with Harness(app) as harness:
        _, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.wait_for(finished.wait(), 5)
    assert outcome == [None] and ran == []


# --- the connection and server layers -------------------------------------------------------------
class Hooks:
    """A drain as DrainingServer sees it: records what it was told."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.calls: list[tuple[str, int]] = []

    def begin(self, connections: int) -> None:
        self.draining = True
        self.calls.append(("begin", connections))

    def cut_remaining(self) -> None:
        self.calls.append(("cut", 0))

    def report(self) -> None:
        self.calls.append(("report", 0))


class DrainingHarness(Harness):
    def __init__(self, app: App, hooks: Hooks) -> None:
        super().__init__(app)
        config = uvicorn.Config(self.app, http=draining_protocol(hooks), loop="asyncio",
                                lifespan="off", log_config=None, access_log=False,
                                timeout_keep_alive=5, timeout_graceful_shutdown=10)
        self.server = seam.DrainingServer(config, hooks)


def held_app(entered: asyncio.Event, release: asyncio.Event, seen: list[tuple[bool, bool]]) -> App:
    """Answers once `release` is set, noting response_progress before, during and after."""
    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        entered.set()
        await release.wait()
        seen.append(seam.response_progress(send))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(BODY)).encode())]})
        seen.append(seam.response_progress(send))
        await send({"type": "http.response.body", "body": BODY})
        seen.append(seam.response_progress(send))
    return app


@in_loop
async def test_server_state_and_response_progress_are_read_from_a_running_server() -> None:
    entered, release, seen = asyncio.Event(), asyncio.Event(), []
    async with Harness(held_app(entered, release, seen)) as harness:
        assert seam.has_started(harness.server) and not seam.exit_requested(harness.server)
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(entered.wait(), 5)
        assert seam.requests_in_flight(harness.server) == 1
        assert seam.open_connections(harness.server) == 1
        release.set()
        answer = await asyncio.wait_for(reader.readuntil(BODY), 5)
        writer.close()
        seam.request_exit(harness.server)
        assert seam.exit_requested(harness.server)
    assert answer.startswith(b"HTTP/1.1 200")
    assert seen == [(False, False), (True, False), (True, True)]


@in_loop
async def test_a_request_arriving_during_the_drain_is_answered_with_connection_close() -> None:
    entered, release, seen = asyncio.Event(), asyncio.Event(), []
    hooks = Hooks(timeout_s=5.0)
    async with DrainingHarness(held_app(entered, release, seen), hooks) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(entered.wait(), 5)
        seam.request_exit(harness.server)  # what SIGTERM does
        while not hooks.calls:
            await asyncio.sleep(0.01)
        release.set()
        answer = await asyncio.wait_for(reader.read(), 5)  # read to the close
    assert hooks.calls == [("begin", 1), ("report", 0)]
    assert b"connection: close" in answer.lower() and answer.endswith(BODY)


@in_loop
async def test_the_deadline_cuts_what_still_runs() -> None:
    entered, release, seen = asyncio.Event(), asyncio.Event(), []
    hooks = Hooks(timeout_s=0.2)
    async with DrainingHarness(held_app(entered, release, seen), hooks) as harness:
        _, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(entered.wait(), 5)
        seam.request_exit(harness.server)
        while ("cut", 0) not in hooks.calls:
            await asyncio.sleep(0.01)
        release.set()  # the app answers after the cut; the connection closes after it
    assert hooks.calls == [("begin", 1), ("cut", 0), ("report", 0)]


def test_run_with_uses_the_loop_the_config_names() -> None:
    loops: list[object] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())

    seam.run_with(uvicorn.Server(uvicorn.Config(http_app(send_plain), loop="uvloop")), main)
    assert isinstance(loops[0], uvloop.Loop)


@in_loop
async def test_a_signal_free_server_leaves_the_signal_handlers_to_its_caller() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))
        await send_plain(send)

    harness = Harness(app)
    harness.server = seam.SignalFreeServer(harness.server.config)
    async with harness:
        await exchange(harness.port, [post()])
    assert seen == [before] and signal.getsignal(signal.SIGTERM) is before
