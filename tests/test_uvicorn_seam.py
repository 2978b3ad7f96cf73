"""Everything cacheroute_proxy/uvicorn_seam.py relies on, against a real uvicorn server on
127.0.0.1 (the sidecar's and the simulators' server): if uvicorn's internals move, these fail
instead of systemd's status line, readiness or a simulator's exit silently going wrong."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any, Awaitable, Callable

import uvicorn
import uvloop

from cacheroute_sim.common import uvicorn_seam as seam

Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]
BODY = b'{"answer": 42}'


class Harness:
    """uvicorn on a pre-bound port."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, http="httptools", loop="asyncio",
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


def held_app(entered: asyncio.Event, release: asyncio.Event) -> App:
    """Answers once `release` is set."""
    @http_app
    async def app(scope: Scope, send: Any, receive: Any) -> None:
        entered.set()
        await release.wait()
        await send_plain(send)
    return app


@in_loop
async def test_server_state_is_read_from_a_running_server() -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    async with Harness(held_app(entered, release)) as harness:
        assert seam.has_started(harness.server) and not seam.exit_requested(harness.server)
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.port)
        writer.write(post())
        await asyncio.wait_for(entered.wait(), 5)
        release.set()
        answer = await asyncio.wait_for(reader.readuntil(BODY), 5)
        writer.close()
        seam.request_exit(harness.server)
        assert seam.exit_requested(harness.server)
    assert answer.startswith(b"HTTP/1.1 200")


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
