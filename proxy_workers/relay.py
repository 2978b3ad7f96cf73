"""The instance's answer to the client, and what surrounds it: what both the exchange
(exchange.py) and the lean path (plain_path.py) do around a forward.

`Responder` is the one response to the client; `select` chooses and leases an instance;
`refused` says a forward that got no answer head, `relay_answer` relays one that did (an error
as it is, a stream as it comes, a JSON answer whole with the meta spliced in) and says whether
another instance should be tried; the disconnect watch cancels a request whose client left.

Headers pass through both ways except the hop-by-hop ones and the proxy's own
(proxy_workers/headers.py), errors relayed from the instance included.

Hot path, measured (bench/hotpath.py, bench-peers): a stream is handed on from the upstream
connection's own callback, each read's bytes in one write, as the instance sent them (only a
chunk's tail is looked at, for the final `[DONE]`); a JSON answer gets `_cacheroute_meta` spliced in
after a validating decode that builds no values, and leaves in one write; a disconnect is a
callback from the server's Cycle that cancels the request's own task.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import msgspec

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.http import HTTPError
from cacheroute_proxy.http1 import Cycle
from cacheroute_proxy.http1.client import UpstreamResponse

from . import metrics
from .headers import Header, relayed, replaced, with_defaults
from .request_model import ProxyRequest
from .router import Lease, Router, Slots
from .sse import DONE_EVENT, PASS_TAIL, StreamRelay, cut_meta_event, meta_event
from .trace import EMPTY_KNOWLEDGE, Knowledge, Trace, encode_meta, tenths
from .upstream import Upstream, UpstreamFailure

log = logging.getLogger("cacheroute.worker")

_encoder = msgspec.json.Encoder()
# The instance's answer as its members, each kept as its bytes: for the rare answer that
# carries a cacheroute_meta of its own.
_object_of_raw = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _MetaOf(msgspec.Struct):
    """What decoding an answer into this checks: one JSON object, every member valid JSON
    (skipped, nothing built), and whether one is `_cacheroute_meta`."""

    meta: msgspec.Raw = msgspec.field(default=msgspec.UNSET, name="_cacheroute_meta")


_meta_of = msgspec.json.Decoder(_MetaOf)
_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream")
_NO_CACHE = (b"cache-control", b"no-cache")
_META_KEY = "_cacheroute_meta"

# Statuses after which another instance is tried, if nothing has reached the client yet.
_RETRY_STATUSES = frozenset({502, 503})

class Responder:
    """The one response to the client: the worker header goes on it, and its status is
    remembered for the metrics (499 while no head was sent: the client left first), with the
    instance of the last attempt ("" before one was chosen)."""

    __slots__ = ("cycle", "status", "instance_id", "spans", "_tail")

    def __init__(self, cycle: Cycle, worker_header: tuple[bytes, bytes]) -> None:
        self.cycle = cycle
        self.status = 499
        self.instance_id = metrics.NO_INSTANCE
        self.spans: Any = None  # the request's RequestSpans (proxy_workers/spans.py) when spans are on
        self._tail = worker_header

    @property
    def started(self) -> bool:
        return self.cycle.started

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        headers.append(self._tail)
        self.cycle.start(status, headers)

    def whole(self, status: int, raw: list[Header], body: bytes, lease: Lease | None = None) -> None:
        """The whole answer in one go, with the headers `raw` (lower-case names, a content-type
        among them, no content-length). A `lease` names the instance in a header and ends before
        the answer leaves: whoever reads the shared table after seeing the answer sees the
        request gone (the exchange's `finally` releases it too; the second call is a no-op)."""
        if lease is not None:
            raw.append(_instance_header(lease))
            lease.release()
        self.status = status
        raw.append(self._tail)
        if not self.cycle.send_whole(status, raw, body):  # the client left: nothing to write
            self.cycle.start(status, raw)
            self.cycle.end()

    def json(self, status: int, content: Any, lease: Lease | None = None,
             headers: dict[str, str] | None = None) -> None:
        raw = [_JSON]
        if headers:
            raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self.whole(status, raw, _encoder.encode(content), lease)

    def error(self, exc: HTTPError, lease: Lease | None = None) -> None:
        self.json(exc.status, {"error": exc.code, "detail": exc.detail}, lease, exc.headers)

def select(router: Router, tried: Slots, request: ProxyRequest, trace: Trace,
           out: Responder) -> Lease | None:
    """An instance chosen outside `tried` and leased, the trace and the answer told which and
    how; None when there is none (answered: no cacheroute_meta, the trace is not sent)."""
    trace.route_select_start_ms = now_ms()
    try:
        lease = router.acquire(tried, request)
    except HTTPError as exc:
        out.error(exc)
        return None
    trace.route_select_end_ms = now_ms()
    age = lease.snapshot_age_ms
    if age is not None:
        trace.snapshot_age_ms = tenths(age)
    trace.instance_id = out.instance_id = lease.instance.instance_id
    choice = lease.choice
    if choice.guard is not None:  # kv_aware
        trace.affinity_guard = choice.guard.fired
        trace.affinity_saved_ms = tenths(choice.affinity.saved_ms)  # type: ignore[union-attr]
        predicted = choice.prediction.total_ms  # type: ignore[union-attr]
        trace.route_predicted_ttft_ms = None if predicted is None else tenths(predicted)
    return lease


def can_retry(router: Router, attempt: int, retries: int, tried: Slots) -> bool:
    """After attempt `attempt` (from 0) failed: another is allowed, and there is an instance
    outside `tried` to make it on."""
    return attempt < retries and router.has_alternative(tried)


def note_outcome(router: Router, lease: Lease, ok: bool) -> None:
    if ok:
        router.outliers.succeeded((lease.instance.slot, lease.instance.generation))
    else:
        note_failure(router, lease)


def note_failure(router: Router, lease: Lease) -> None:
    """A failure the client did not cause; the line when it ejects the instance (rare, so
    logged: with JSON logs it carries the id of the request that tipped it)."""
    instance = lease.instance
    outliers = router.outliers
    if outliers.failed((instance.slot, instance.generation)):
        metrics.ejected(instance.instance_id)
        log.warning("instance %s ejected from this worker's candidates for %.0fs after %d "
                    "failures in a row", instance.instance_id, outliers.eject_s, outliers.threshold)


async def relay_error(upstream: Upstream, response: UpstreamResponse, out: Responder, lease: Lease) -> None:
    """Upstream 4xx/5xx keep their status, headers and body."""
    try:
        body = await upstream.read_all(response)
    except UpstreamFailure as exc:
        out.json(502, {"error": "upstream_failed", "detail": exc.reason}, lease)
        return
    out.whole(response.status, with_defaults(relayed(response.headers), _JSON), body, lease)


def refused(upstream: Upstream, router: Router, lease: Lease, exc: BaseException, path: str,
            out: Responder, may_retry: Callable[[], bool]) -> bool:
    """No answer head came (`exc`, one of SEND_FAILURES): True to try another instance (nothing
    reached this one, and `may_retry()`), else the refusal answered."""
    instance = lease.instance
    refusal = upstream.refusal(exc, instance.host, instance.port, path)
    note_failure(router, lease)
    if refusal.code == "upstream_unavailable" and may_retry():
        return True
    out.error(refusal, lease)
    return False


async def relay_answer(upstream: Upstream, router: Router, response: UpstreamResponse, out: Responder,
                       lease: Lease, trace: Trace, knowledge: Knowledge, stream: bool,
                       on_first: Callable[[], None], may_retry: Callable[[], bool],
                       spans: Any = None) -> bool:
    """The instance's answer, its head come: True to try another instance (a 502 or 503, nothing
    sent yet, and `may_retry()`); else relayed (an error as it is, a stream as it comes, a JSON
    answer whole with the meta), and False."""
    status = response.status
    if spans is not None:
        spans.answer_head(status)
    if status < 400 and lease.claim is not None:
        lease.claim.prompt_taken()
    if status >= 500:
        note_failure(router, lease)
        if status in _RETRY_STATUSES and may_retry():
            response.close()
            return True
    finished = False
    try:
        if status >= 400:
            await relay_error(upstream, response, out, lease)
        elif stream:
            await relay_stream(upstream, router, response, out, lease, trace, on_first, knowledge, spans)
        else:
            await relay_whole(upstream, router, response, out, lease, trace, knowledge)
        finished = True
    finally:
        # A fully read response goes back to the pool; anything else (cancelled, failed)
        # closes the connection so the instance stops work on it.
        response.release() if finished and response.at_eof() else response.close()
    return False


async def relay_whole(upstream: Upstream, router: Router, response: UpstreamResponse, out: Responder,
                      lease: Lease, trace: Trace, knowledge: Knowledge) -> None:
    """The instance's JSON answer, read whole, to the client with `cacheroute_meta` spliced in."""
    try:
        body = await upstream.read_all(response)
    except UpstreamFailure as exc:
        note_failure(router, lease)
        out.json(502, {"error": "upstream_failed", "detail": exc.reason}, lease)
        return
    note_outcome(router, lease, True)
    trace.forward_end_ms = now_ms()
    body, kept = meta_spliced(body, encode_meta(trace, knowledge.error, knowledge))
    headers = relayed(response.headers)
    # The instance's content type describes its JSON object, still there; a wrapped answer
    # is the proxy's JSON.
    headers = with_defaults(headers, _JSON) if kept else replaced(headers, _JSON)
    out.whole(200, headers, body, lease)


async def relay_stream(upstream: Upstream, router: Router, response: UpstreamResponse, out: Responder,
                       lease: Lease, trace: Trace, on_first: Callable[[], None],
                       knowledge: Knowledge = EMPTY_KNOWLEDGE, spans: Any = None) -> None:
    """The instance's stream to the client as it comes (`on_first` at its first piece), then
    `cacheroute_meta` and `[DONE]`; the lease ends before the end leaves."""
    cycle = out.cycle
    headers = with_defaults(relayed(response.headers), _SSE, _NO_CACHE)
    headers.append(_instance_header(lease))
    out.start(200, headers)  # at once, as the instance sent its own: a client may time its wait
    relay = StreamRelay(cycle.body_writer(), on_first, cycle.chunk_passer(*PASS_TAIL))
    error: str | None = None
    try:
        while not await upstream.relay(response, relay, relay.passer):
            await cycle.writable()  # the client is slow: the instance waits with it
    except UpstreamFailure as exc:
        error = exc.reason
        if spans is not None:
            spans.error = error
    note_outcome(router, lease, error is None)
    trace.forward_end_ms = now_ms()
    # [DONE] only after a clean end, so a client can tell a truncated stream from a whole one.
    # What the relay held goes first, in the same write: the events before the instance's
    # [DONE] (also when the stream failed after it), or a line the end cut short (not after
    # a failure, where the cut meta event must not merge into it).
    if error is None:
        final = relay.flush() + meta_event(trace, knowledge.error, knowledge) + DONE_EVENT
    else:
        final = (relay.flush() if relay.saw_done else b"") + cut_meta_event(trace, error, knowledge)
    lease.release()  # before the end of the stream leaves, as for a whole answer
    cycle.end(final)


def first_token_seen(trace: Trace, route: str, predicted_first_token_ms: float | None) -> None:
    """A stream's first piece came: its times in the trace, its TTFT in the metrics."""
    now = now_ms()
    trace.first_token_ms = now
    trace.actual_ttft_ms = ttft = now - trace.proxy_recv_ms  # type: ignore[operator]
    metrics.observe_ttft(route, trace.instance_id or metrics.NO_INSTANCE, ttft / 1000)
    # Always known here: forward() runs only once admitted to ready, and every admission path
    # (pipeline.admit_plain, _without_waiting, _admit) sets ready_dequeue_ms first.
    trace.actual_vllm_ttft_ms = trace.actual_vllm_internal_ms = now - trace.forward_start_ms  # type: ignore[operator]
    if trace.proxy_enqueue_ms is not None:
        trace.actual_total_ms = now - trace.proxy_enqueue_ms
    if predicted_first_token_ms is not None:
        trace.predict_error_ms = int(now - predicted_first_token_ms)
    trace.decode_start_ms = now  # decode starts with the first token


def with_meta(body: bytes, meta: bytes) -> bytes:
    """The instance's JSON object with `meta` (encoded `cacheroute_meta`) as its last key,
    `_cacheroute_meta`. The instance's own bytes are kept (validated, not decoded into values
    and encoded again), and so are the meta's; an answer that is not one JSON object is
    wrapped as `{"raw": <text>, "_cacheroute_meta": ...}`."""
    return meta_spliced(body, meta)[0]


def meta_spliced(body: bytes, meta: bytes) -> tuple[bytes, bool]:
    """`with_meta`, and whether the instance's object was kept (False: it was wrapped)."""
    try:
        own = _meta_of.decode(body).meta
    except (msgspec.DecodeError, RecursionError):
        return _encoder.encode({"raw": body.decode("utf-8", "replace"), _META_KEY: msgspec.Raw(meta)}), False
    if own is not msgspec.UNSET:  # the instance sent one itself: ours replaces it, as before
        fields = _object_of_raw.decode(body)
        fields[_META_KEY] = msgspec.Raw(meta)
        return _encoder.encode(fields), True
    head = body.rstrip()[:-1]  # a valid object: all but its closing brace
    if head.rstrip().endswith(b"{"):  # no member
        return b'{"_cacheroute_meta":' + meta + b"}", True
    return head + b',"_cacheroute_meta":' + meta + b"}", True


class DisconnectWatch:
    """Cancels the request's own task if its client disconnects while armed. The server calls
    back on disconnect (Cycle.on_disconnect), so a silent upstream stall is noticed too, with no
    task per request waiting on the socket. The CancelledError this causes is the watch's own
    (`absorbed`); any other cancellation (server shutdown, drain) goes on up."""

    __slots__ = ("_cycle", "_task", "_armed", "_gone")

    def __init__(self, cycle: Cycle, task: asyncio.Task[Any]) -> None:
        self._cycle, self._task = cycle, task
        self._armed, self._gone = True, False
        cycle.on_disconnect = self._client_gone

    def _client_gone(self) -> None:
        if self._armed:  # never cancel a task that already left the watched work
            self._gone = True
            self._task.cancel()

    def absorbed(self) -> bool:
        """Asked of a CancelledError: True (and the task's cancellation taken back) if it came
        from the client leaving."""
        if not self._gone:
            return False
        self._task.uncancel()
        return True

    def disarm(self) -> None:
        self._armed = False
        self._cycle.on_disconnect = None


def watch_disconnect(cycle: Cycle) -> DisconnectWatch | None:
    """A watch over `cycle` for its own task, armed; None if its client already left."""
    assert cycle.task is not None
    return None if cycle.disconnected else DisconnectWatch(cycle, cycle.task)


def _instance_header(lease: Lease) -> tuple[bytes, bytes]:
    return (b"x-cacheroute-instance", lease.instance.instance_id.encode())
