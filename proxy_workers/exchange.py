"""One proxied request, from lease to last byte, as an ASGI callable.

The lease is taken and released here and nowhere else, in one try/finally that covers every
way out: success, upstream error, timeout, client disconnect (watched on `receive` while the
upstream is read, so a silent stall is noticed too) and cancellation. A client that goes away
also closes the upstream connection, so the instance stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable

import aiohttp
import msgspec

from cacheroute.clock import now_ms
from cacheroute.http import HTTPError

from . import metrics
from .pipeline import Job, Pipeline
from .request_model import ProxyRequest
from .router import Lease, Router
from .sse import DONE_EVENT, DoneStripper, meta_event, meta_object
from .upstream import Upstream, UpstreamFailure

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

_encoder = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


# Statuses after which another instance is tried, if nothing has reached the client yet.
_RETRY_STATUSES = frozenset({502, 503})


class ProxyExchange:
    def __init__(self, router: Router, pipeline: Pipeline, upstream: Upstream,
                 request: ProxyRequest, trace: dict[str, Any], retries: int = 0) -> None:
        self._router = router
        self._pipeline = pipeline
        self._upstream = upstream
        self._job = Job(request, trace)
        self._retries = retries

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        tried: frozenset[tuple[int, int]] = frozenset()
        for attempt in range(1 + self._retries):
            try:
                lease = self._router.acquire(self._job.trace, tried)
            except HTTPError as exc:
                await send_json(send, exc.status, {"error": exc.code, "detail": exc.detail}, headers=exc.headers)
                return
            tried |= {(lease.instance.slot, lease.instance.generation)}
            last = attempt == self._retries or not self._router.has_alternative(tried)
            try:
                retry = await run_until_disconnect(self._run(lease, send, last), receive)
            finally:
                lease.release()
            if not retry:
                return
            self._job.knowledge.prefix_tokens = 0  # KV was pushed to the failed instance only
            self._job.trace["retries"] = attempt + 1

    async def _run(self, lease: Lease, send: Send, last: bool) -> bool:
        """True if the attempt failed before sending anything and another should be made."""
        try:
            async with self._pipeline.admitted(lease, self._job):
                return await self._forward(lease, send, last)
        except HTTPError as exc:  # refused before anything was sent: queue full, timeout, gone
            await send_json(send, exc.status, {"error": exc.code, "detail": exc.detail}, lease, exc.headers)
            return False

    async def _forward(self, lease: Lease, send: Send, last: bool) -> bool:
        job = self._job
        request, trace = job.request, job.trace
        key = (lease.instance.slot, lease.instance.generation)
        outliers = self._router.outliers
        trace["forward_start_ms"] = now_ms()
        headers = None
        if job.knowledge.prefix_tokens:  # the simulated instance shortens its prefill by this
            headers = {"x-cacheroute-kv-prefix-tokens": str(job.knowledge.prefix_tokens)}
        try:
            response = await self._upstream.open(lease.base_url + request.endpoint.path,
                                                 request.encoded_body(), headers)
        except HTTPError as exc:
            outliers.failed(key)
            if not last and exc.code == "upstream_unavailable":
                return True
            await send_json(send, exc.status, {"error": exc.code, "detail": exc.detail}, lease)
            return False
        if response.status >= 500:
            outliers.failed(key)
            if not last and response.status in _RETRY_STATUSES:
                response.close()
                return True
        finished = False
        try:
            if response.status >= 400:
                await self._relay_error(response, send, lease)
            elif request.stream:
                await self._relay_stream(response, send, lease)
            else:
                await self._relay_whole(response, send, lease)
            finished = True
        finally:
            # A fully read response goes back to the pool; anything else (cancelled, failed)
            # closes the connection so the instance stops work on it.
            response.release() if finished and response.content.at_eof() else response.close()
        return False

    async def _relay_error(self, response: aiohttp.ClientResponse, send: Send, lease: Lease) -> None:
        """Upstream 4xx/5xx keep their status and body."""
        try:
            body = await self._upstream.read_all(response)
        except UpstreamFailure as exc:
            await send_json(send, 502, {"error": "upstream_failed", "detail": exc.reason}, lease)
            return
        content_type = response.headers.get("Content-Type", "application/json").encode("latin-1")
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", content_type), _instance_header(lease)]})
        await send({"type": "http.response.body", "body": body})

    async def _relay_stream(self, response: aiohttp.ClientResponse, send: Send, lease: Lease) -> None:
        job = self._job
        trace = job.trace
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, _instance_header(lease)]})
        stripper = DoneStripper()
        error: str | None = None
        try:
            async for chunk in self._upstream.chunks(response):
                if "first_token_ms" not in trace:
                    self._first_token(job)
                out = stripper.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            tail = stripper.flush()
            if tail:
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        except UpstreamFailure as exc:
            error = exc.reason
        self._account(lease, error is None)
        trace["forward_end_ms"] = now_ms()
        # [DONE] only after a clean end, so a client can tell a truncated stream from a whole one.
        final = meta_event(trace, error or job.knowledge.error, job.knowledge) + \
            (DONE_EVENT if error is None else b"")
        await send({"type": "http.response.body", "body": final, "more_body": False})

    async def _relay_whole(self, response: aiohttp.ClientResponse, send: Send, lease: Lease) -> None:
        job = self._job
        trace = job.trace
        try:
            body = await self._upstream.read_all(response)
        except UpstreamFailure as exc:
            self._account(lease, False)
            await send_json(send, 502, {"error": "upstream_failed", "detail": exc.reason}, lease)
            return
        self._account(lease, True)
        trace["forward_end_ms"] = now_ms()
        meta = meta_object(trace, job.knowledge.error, job.knowledge)
        try:
            parsed = msgspec.json.decode(body)
        except msgspec.DecodeError:
            parsed = None
        if isinstance(parsed, dict):
            parsed["_cacheroute_meta"] = meta
        else:
            parsed = {"raw": body.decode("utf-8", "replace"), "_cacheroute_meta": meta}
        await send_json(send, 200, parsed, lease)


    def _account(self, lease: Lease, ok: bool) -> None:
        key = (lease.instance.slot, lease.instance.generation)
        self._router.outliers.succeeded(key) if ok else self._router.outliers.failed(key)

    def _first_token(self, job: Job) -> None:
        trace = job.trace
        now = now_ms()
        trace["first_token_ms"] = now
        trace["actual_ttft_ms"] = now - trace["proxy_recv_ms"]
        metrics.TTFT.observe(trace["actual_ttft_ms"] / 1000)
        if "ready_dequeue_ms" in trace:
            trace["actual_vllm_ttft_ms"] = now - trace["forward_start_ms"]
        if job.predicted_first_token_ms is not None:
            trace["predict_error_ms"] = int(now - job.predicted_first_token_ms)
        self._pipeline.first_token(job)


async def run_until_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Run `work`, cancelling it if the client disconnects first; its result, else None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return None if task.cancelled() else task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send: Send, status: int, content: Any, lease: Lease | None = None,
                    headers: dict[str, str] | None = None) -> None:
    raw = [_JSON] if lease is None else [_JSON, _instance_header(lease)]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": _encoder.encode(content)})


def _instance_header(lease: Lease) -> tuple[bytes, bytes]:
    return (b"x-cacheroute-instance", lease.instance.instance_id.encode())

