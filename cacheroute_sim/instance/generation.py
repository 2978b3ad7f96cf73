"""One generation request, run as an ASGI response object (returned by the route handlers).

It runs at the ASGI level rather than through a StreamingResponse because the fault knobs need
what Starlette hides: answering nothing at all (hang), cutting a body short (drop), and
noticing a disconnect while no byte is being written (hold, stall, queueing).

Two tasks per request: the work, and a watcher blocked on ``receive()``, which uvicorn
answers with ``http.disconnect`` as soon as the socket closes. Whichever ends first decides;
a disconnect cancels the work, and the engine's ``finally`` blocks give back the slot, the
prefill lock and the decode batch place at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from starlette.types import Message, Receive, Scope, Send

from cacheroute_sim.instance.config import Knobs
from cacheroute_sim.instance.engine import Engine
from cacheroute_sim.instance.request_model import GenerationRequest
from cacheroute_sim.instance.wire import Formatter, error_body

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
SHUTTING_DOWN_BODY = b'{"error":"shutting_down"}'


class SimulatedDrop(Exception):
    """Raised after a partial body so uvicorn closes the connection without finishing it.

    uvicorn answers an exception after the response started with ``transport.close()`` and no
    terminating chunk: the client sees a truncated body. server.py mutes its traceback.
    """


class GenerationResponse:
    def __init__(self, request: GenerationRequest, engine: Engine, rng: random.Random) -> None:
        self.request = request
        self.engine = engine
        self.rng = rng
        # Fault behaviour is fixed at arrival, so a knob change cannot split one response.
        self.knobs: Knobs = engine.knobs.current
        self.fmt = Formatter(request)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.engine.stats
        stats.total += 1
        # A gauge, so a benchmark can sample the instance's own view of its load over time.
        stats.inflight += 1
        try:
            await self._respond(scope, receive, send)
        finally:
            stats.inflight -= 1

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracked = _TrackedSend(send)
        work = asyncio.create_task(self._run(tracked))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when the shutdown grace runs out.
            await _cancel(work, watcher)
            if not tracked.started:
                await _send_whole(send, 503, SHUTTING_DOWN_BODY)
            raise
        watcher.cancel()
        if work.done():
            work.result()  # re-raises SimulatedDrop (wanted) or a genuine bug
            return
        # Counted before the cancel gives back the slot: whoever sees the slot free must
        # already see why (a reader polling /sim/stats may run before this task resumes).
        self.engine.stats.disconnected += 1
        await _cancel(work)

    async def _run(self, send: Send) -> None:
        if self._should_fail():
            await self._send_failure(send)
            return
        if self.knobs.hang:
            await self.engine.hold()  # before headers: the client sees nothing at all
        if self.request.stream:
            # Like vLLM: stream headers go out at once, even while queued for a slot.
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        async with self.engine.slot():
            if self.request.stream:
                await self._stream_body(send)
            else:
                await self._unary(send)
        self.engine.stats.completed += 1

    def _should_fail(self) -> bool:
        k = self.knobs
        return k.fail_status is not None and self.rng.random() < k.fail_rate

    async def _send_failure(self, send: Send) -> None:
        status = self.knobs.fail_status or 500
        await _send_whole(send, status, error_body(status))
        self.engine.stats.failed += 1

    async def _stream_body(self, send: Send) -> None:
        engine = self.engine
        await engine.prefill(self.request)
        async with engine.decoding():
            for sent in range(self.request.completion_tokens):
                await self._pause_point(sent)
                if sent == 0:
                    event = self.fmt.first_token_event()
                else:
                    await engine.decode_step()
                    event = self.fmt.token_event()
                await send({"type": "http.response.body", "body": event, "more_body": True})
            # A pause point past the last token still breaks the stream before its end.
            await self._pause_point(self.request.completion_tokens)
        await send({"type": "http.response.body", "body": self.fmt.final_events(),
                    "more_body": False})

    async def _pause_point(self, sent: int) -> None:
        """Apply the stream faults that trigger once ``sent`` content chunks are out."""
        k = self.knobs
        if k.drop_after_chunks is not None and sent == k.drop_after_chunks:
            self._drop(f"after {sent} content chunks")
        stall = k.stall_after_chunks is not None and sent == k.stall_after_chunks
        if stall or (k.hold_streams and sent == 1):
            await self.engine.hold()

    async def _unary(self, send: Send) -> None:
        engine = self.engine
        await engine.prefill(self.request)
        async with engine.decoding():
            for _ in range(self.request.completion_tokens - 1):
                await engine.decode_step()
        body = self.fmt.full_body()
        if self.knobs.drop_after_chunks is None:
            await _send_whole(send, 200, body)
            return
        # Announce the full length, deliver half: the client must see a short read.
        await send({"type": "http.response.start", "status": 200, "headers": [
            *_JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body[: len(body) // 2],
                    "more_body": True})
        self._drop("mid-body (non-streaming)")

    def _drop(self, where: str) -> None:
        self.engine.stats.dropped += 1
        log.info("drop_after_chunks: cutting the connection %s", where)
        raise SimulatedDrop(where)


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was already read by the route, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class _TrackedSend:
    """Remembers whether the response has started (decides what a shutdown can still say)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


async def _send_whole(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        *_JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
