"""The typed request record and the cacheroute_meta wire format (proxy_workers/trace.py).

The trace's key names, their order and which of them appear are what clients and
bench/bench_pressure.py read, so they are written out here in full rather than derived from
the Struct: a renamed, moved or dropped field fails these tests.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
from typing import Any, Callable

import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from cacheroute_proxy.http1.client import ConnectFailed
from proxy_workers.app import DataPlane, WorkerContext
from proxy_workers.relay import with_meta
from proxy_workers.knowledge import KnowledgePreparer
from proxy_workers.pipeline import Pipeline
from proxy_workers.predictors import get_predictors
from proxy_workers.request_model import Endpoint
from cacheroute_proxy.routing.policy import Choice
from proxy_workers.router import Lease, Router
from proxy_workers.sse import cut_meta_event, meta_event
from proxy_workers.trace import Knowledge, Trace, encode_meta, tenths
from proxy_workers.event_channel import EventChannelWriter
from shm_schema import DirectoryReader, DirectoryWriter, WorkerRow
from tests.aio import meta_of
from tests.shm_helpers import fresh_segment

META_KEYS = ["trace", "kv_ack", "kv_ready_kids", "text_only_kids", "miss_kids", "error", "resident_kids"]
# Every trace key, in the order a request meets them (and the JSON lists them).
TRACE_KEYS = [
    "proxy_recv_ms", "worker", "request_id",
    "route_select_start_ms", "route_select_end_ms", "snapshot_age_ms", "instance_id",
    "route_predicted_ttft_ms", "affinity_saved_ms", "affinity_guard",
    "prepare_seq", "proxy_enqueue_ms", "iws_reason", "kdn_link_source", "injection_mode",
    "prepare_dequeue_ms", "prepare_start_ms",
    "kdn_fetch_start_ms", "kdn_fetch_end_ms", "kdn_link_wait_ms", "kv_ack_start_ms",
    "kvcache_actual_path", "kv_ack_end_ms", "prepare_self_done_ms",
    "ready_release_seq", "ready_release_policy", "ready_bypass", "ready_blocked_seq",
    "ready_enqueue_ms", "actual_know_prepare_ms",
    "predict_service_ms", "predict_decode_ms", "predict_queue_wait_ms", "predict_total_ms",
    "pred_first_token_ts_ms", "ready_dequeue_ms", "ready_worker_idx",
    "forward_start_ms", "actual_ready_queue_ms", "first_token_ms", "decode_start_ms",
    "actual_ttft_ms", "actual_vllm_ttft_ms", "actual_total_ms", "actual_vllm_internal_ms",
    "predict_error_ms", "forward_end_ms",
    "retries",
]
# Set only when kv_aware chose the instance.
AFFINITY_KEYS = {"route_predicted_ttft_ms", "affinity_saved_ms", "affinity_guard"}
# Set only on a stream's first token.
FIRST_TOKEN_KEYS = {"first_token_ms", "decode_start_ms", "actual_ttft_ms", "actual_vllm_ttft_ms",
                    "actual_total_ms", "actual_vllm_internal_ms", "predict_error_ms"}
# Set only when a text request was released ahead of a blocked head (text_bypass).
BYPASS_KEYS = {"ready_blocked_seq"}


def _decoded(meta: bytes) -> dict[str, Any]:
    return json.loads(meta)


# --- the record and its encoding -----------------------------------------------------------------

def test_every_field_encodes_under_its_wire_name_in_lifecycle_order():
    trace = Trace(**{name: i + 1 for i, name in enumerate(TRACE_KEYS)})
    meta = _decoded(encode_meta(trace, None, Knowledge()))
    assert list(meta) == META_KEYS
    assert list(meta["trace"]) == TRACE_KEYS
    assert list(meta["trace"].values()) == list(range(1, len(TRACE_KEYS) + 1))


def test_the_meta_of_a_request_without_knowledge_is_the_same_bytes_built_once():
    """encode_meta builds the members of EMPTY_KNOWLEDGE's meta once; they must be what a
    Meta of an empty Knowledge encodes to, and an error or any knowledge takes the general way."""
    from proxy_workers.trace import EMPTY_KNOWLEDGE

    trace = Trace(**{name: i + 1 for i, name in enumerate(TRACE_KEYS)})
    assert encode_meta(trace, None, EMPTY_KNOWLEDGE) == encode_meta(trace, None, Knowledge())
    assert _decoded(encode_meta(trace, "cut", EMPTY_KNOWLEDGE))["error"] == "cut"
    assert EMPTY_KNOWLEDGE == Knowledge()  # read, never written


def test_a_field_never_set_is_absent_and_a_zero_is_present():
    trace = Trace(proxy_recv_ms=1700000000000, worker="w0-pid1", request_id=0)
    trace.kdn_link_wait_ms = 0
    trace.snapshot_age_ms = 0.0
    trace.retries = 0
    assert _decoded(encode_meta(trace, None, Knowledge()))["trace"] == {
        "proxy_recv_ms": 1700000000000, "worker": "w0-pid1", "request_id": 0,
        "snapshot_age_ms": 0.0, "kdn_link_wait_ms": 0, "retries": 0}


def test_meta_members_are_always_present_error_as_null():
    assert encode_meta(Trace(), None, Knowledge()) == (
        b'{"trace":{},"kv_ack":{},"kv_ready_kids":[],"text_only_kids":[],"miss_kids":[],'
        b'"error":null,"resident_kids":[]}')
    knowledge = Knowledge(kv_ready_kids=["K1"], text_only_kids=["k2"], miss_kids=["nope"],
                          kv_ack={"ok": True}, prefix_tokens=512, error="prepare_failed: x")
    meta = _decoded(encode_meta(Trace(instance_id="i"), knowledge.error, knowledge))
    assert meta == {"trace": {"instance_id": "i"}, "kv_ack": {"ok": True}, "kv_ready_kids": ["K1"],
                    "text_only_kids": ["k2"], "miss_kids": ["nope"], "error": "prepare_failed: x",
                    "resident_kids": []}


def test_tenths_rounds_as_round_to_one_decimal_but_on_a_half():
    for value in (3.27, 12.34, 0.04, 99.96, -1.26, 1e6 + 0.123, 0.0):
        assert tenths(value) == round(value, 1)
    # value * 10 on a half: the even tenth (0.35 is a hair below it, so round() gives 0.3)
    assert (tenths(0.25), tenths(0.35)) == (0.2, 0.4)


def test_stream_events_carry_the_same_bytes():
    trace, knowledge = Trace(proxy_recv_ms=5, retries=1), Knowledge(miss_kids=["m"])
    encoded = encode_meta(trace, None, knowledge)
    assert meta_event(trace, None, knowledge) == b"event: cacheroute_meta\ndata: " + encoded + b"\n\n"
    cut = cut_meta_event(trace, "upstream_failed: reset", knowledge)
    assert cut == b"\nevent: cacheroute_meta\ndata: " + encode_meta(trace, "upstream_failed: reset",
                                                                     knowledge) + b"\n\n"
    # The drain's cut of a stream it knows nothing about: an empty record, empty knowledge.
    assert cut_meta_event(Trace(), "worker_drain_deadline") == (
        b'\nevent: cacheroute_meta\ndata: {"trace":{},"kv_ack":{},"kv_ready_kids":[],'
        b'"text_only_kids":[],"miss_kids":[],"error":"worker_drain_deadline","resident_kids":[]}\n\n')


@pytest.mark.parametrize("body, expected", [
    (b'{"id":"x","n":1}', b'{"id":"x","n":1,"_cacheroute_meta":META}'),
    (b'{"id":"x"}\n', b'{"id":"x","_cacheroute_meta":META}'),
    (b"{}", b'{"_cacheroute_meta":META}'),
    (b" { \n} ", b'{"_cacheroute_meta":META}'),
    (b'{"a":{}, "b":[{}]}', b'{"a":{}, "b":[{}],"_cacheroute_meta":META}'),
    (b'{"a":[1,,2]}', b'{"raw":"{\\"a\\":[1,,2]}","_cacheroute_meta":META}'),
    (b'{"_cacheroute_meta":1,"id":"x"}', b'{"_cacheroute_meta":META,"id":"x"}'),
    (b"[1,2]", b'{"raw":"[1,2]","_cacheroute_meta":META}'),
    (b"not json", b'{"raw":"not json","_cacheroute_meta":META}'),
])
def test_json_answer_gets_the_encoded_meta_spliced_in(body, expected):
    meta = encode_meta(Trace(proxy_recv_ms=1, retries=0), None, Knowledge())
    assert with_meta(body, meta) == expected.replace(b"META", meta)


# --- routing takes no telemetry -------------------------------------------------------------------

def test_router_acquire_takes_no_trace():
    # The request (kv_aware weighs what each instance holds of it), never its trace.
    assert list(inspect.signature(Router.acquire).parameters) == ["self", "exclude", "request"]


@pytest.fixture
def segment():
    with fresh_segment(instance_capacity=4, worker_capacity=2) as seg:
        yield seg


def test_lease_carries_the_snapshot_age_of_a_least_load_choice(segment):
    DirectoryWriter(segment).allocate("inst-a", "127.0.0.1", 9001)
    for strategy, expected in (("least_load", 12.345), ("round_robin", None)):
        router = Router(Settings(instance_strategy=strategy, shm_name=segment.name), segment,
                        WorkerRow.claim(segment, 0))
        router.view.snapshot_age_ms = lambda: 12.345  # type: ignore[method-assign]
        lease = router.acquire()
        assert (lease.instance.instance_id, lease.snapshot_age_ms) == ("inst-a", expected)
        assert lease.release()
        router.row.release()
    assert Lease(Choice(lease.instance), WorkerRow.claim(segment, 1)).snapshot_age_ms is None


# --- one request through every path, in one process ---------------------------------------------
# app -> exchange (selection, a failed first attempt, the retry) -> pipeline (IWS, prepare,
# reserve, admission) -> knowledge (KDN fetch, KV inject) -> forward (stream: first token) ->
# cacheroute_meta. Only the network is replaced: the KDN, the instances' control planes and
# their data planes answer from here.

class _Answer:
    def __init__(self, status: int, payload: Any) -> None:
        self.status = status
        self._payload = payload

    async def __aenter__(self) -> "_Answer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return json.dumps(self._payload).encode()


class _Session:
    """The KDN's search (every id kv-ready) and the instances' KV inject (accepted; the ack
    names the URL it was asked at)."""

    def __init__(self) -> None:
        self.injects: list[str] = []

    def post(self, url: str, json: dict[str, Any], timeout: Any, headers: Any = None) -> _Answer:
        if url.endswith("/knowledge/search/text"):
            return _Answer(200, {"items": [{"knowledge_id": kid, "content": f"about {kid}",
                                            "kv_ready": True} for kid in json["knowledge_ids"]]})
        assert url.endswith("/v1/kv/inject_ready"), url
        self.injects.append(url)
        return _Answer(200, {"ok": True, "injected_kids": json["knowledge_ids"], "detail": url})


class _Response:
    def __init__(self, chunks: list[bytes]) -> None:
        self.status = 200
        self.content_type = "application/json"
        self.headers = [(b"content-type", b"application/json")]
        self.chunks = chunks

    def at_eof(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Upstream:
    """The first connection is refused (the exchange retries elsewhere); then a stream of two
    chunks, or one JSON answer."""

    def __init__(self) -> None:
        self.session = _Session()
        self.opened: list[int] = []

    def forwarded(self, client_headers: list[tuple[bytes, bytes]]) -> bytes:
        return b""

    async def send(self, host: str, port: int, path: str, body: bytes, headers: bytes,
                   sent: Callable[[], None] | None = None) -> _Response:
        self.opened.append(port)
        if len(self.opened) == 1:  # no connection: nothing was sent
            raise ConnectFailed("connection refused")
        if sent is not None:
            sent()
        if json.loads(body).get("stream"):
            return _Response([b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n',
                              b"data: [DONE]\n\n"])
        return _Response([b'{"object":"chat.completion","choices":[]}'])

    def refusal(self, exc: BaseException, host: str, port: int, path: str) -> HTTPError:
        return HTTPError(502, "upstream_unavailable", str(exc))

    async def relay(self, response: _Response, sink: Callable[[bytes], bool], passer: Any = None) -> bool:
        for chunk in response.chunks:
            sink(chunk)
        return True

    async def read_all(self, response: _Response) -> bytes:
        return b"".join(response.chunks)


def _scheduler_body(stream: bool) -> bytes:
    return json.dumps({
        "Request_ID": 0, "Prompt": {"model": "m", "user_prompt": "q" * 200, "token_length": 50,
                                    "max_tokens": 4, "stream": stream},
        "Service": {"Enable_know_injection": True, "Injection_type": "text",
                    "Knowledge_List": ["K1", "K2"], "Knowledge_length": 4000},
        "Task": {"KDN_server_addr": "127.0.0.1:9101"}}).encode()


class _Cycle:
    """What DataPlane is given by the worker's server, recording what it writes; the client
    stays connected and the body has arrived whole."""

    def __init__(self, body: bytes) -> None:
        self.method, self.path, self.headers = "POST", "/v1/chat/completions", []
        self.disconnected, self.started, self.complete = False, False, False
        self.on_disconnect = None
        self.task = asyncio.current_task()  # what the server's Connection sets: the task answering it
        self.status = 0
        self.sent: list[bytes] = []
        self._body = body

    def whole_body(self, limit: int) -> bytes | None:
        return self._body

    async def read_body(self, limit: int) -> bytes:
        return self._body

    def send_whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        self.start(status, headers)
        self.end(body)
        return True

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.started = status, True

    def write(self, body: bytes) -> bool:
        self.sent.append(body)
        return False

    def body_writer(self) -> Callable[[bytes], bool]:
        return self.write

    def chunk_passer(self, marker: bytes, look_back: int) -> None:
        return None  # as for a body that is not chunked: every read is written as it is

    def end(self, body: bytes = b"") -> None:
        self.sent.append(body)
        self.complete = True


async def _serve(plane: DataPlane, body: bytes) -> tuple[int, bytes]:
    cycle = _Cycle(body)
    await plane.serve(Endpoint.CHAT, cycle)  # type: ignore[arg-type]
    return cycle.status, b"".join(cycle.sent)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_request_through_every_path_reports_every_key_in_order(segment, stream):
    writer = DirectoryWriter(segment)
    writer.allocate("inst-a", "127.0.0.1", 9001)
    writer.allocate("inst-b", "127.0.0.1", 9002)
    settings = Settings(instance_strategy="least_load", injection_strategy="iws",
                        shm_name=segment.name, retry_attempts=1)
    row = WorkerRow.claim(segment, 0)
    router = Router(settings, segment, row)
    router.view.snapshot_age_ms = lambda: 3.27  # type: ignore[method-assign]  # no sidecar here
    upstream = _Upstream()
    predictors = get_predictors(settings.predictor_profile)
    pipeline = Pipeline(settings, EventChannelWriter(segment, row),
                        KnowledgePreparer(settings, upstream, predictors), predictors,
                        pressure_of=lambda instance: 40.0)
    plane = DataPlane(WorkerContext(settings, 0, router, upstream, pipeline))

    status, body = asyncio.run(_serve(plane, _scheduler_body(stream)))

    assert status == 200 and upstream.opened[0] != upstream.opened[1]  # retried elsewhere
    meta = meta_of(body) if stream else json.loads(body)["_cacheroute_meta"]
    assert list(meta) == META_KEYS and meta["error"] is None, meta
    absent = BYPASS_KEYS | AFFINITY_KEYS if stream else BYPASS_KEYS | FIRST_TOKEN_KEYS | AFFINITY_KEYS
    assert list(meta["trace"]) == [k for k in TRACE_KEYS if k not in absent]  # least_load: no affinity
    trace = meta["trace"]
    assert (trace["request_id"], trace["retries"], trace["snapshot_age_ms"]) == (0, 1, 3.3)
    assert (trace["injection_mode"], trace["kvcache_actual_path"]) == ("kvcache", "kv_injected")
    assert trace["instance_id"] == {9001: "inst-a", 9002: "inst-b"}[upstream.opened[1]]
    assert trace["predict_queue_wait_ms"] == 40.0 and trace["kdn_link_wait_ms"] >= 0
    assert trace["kdn_link_source"] == "default"  # no link measured, none configured
    assert meta["kv_ready_kids"] == ["K1", "K2"] and meta["kv_ack"]["ok"] is True
    # The KV was pulled by the instance that failed, then by the one that served: the ack is
    # the second one's.
    injects = upstream.session.injects
    assert len(injects) == 2 and injects[0] != injects[1] and meta["kv_ack"]["detail"] == injects[1]
    assert (trace["ready_release_seq"], trace["ready_release_policy"], trace["ready_bypass"],
            trace["ready_worker_idx"]) == (1, "ordered", False, 0)
    know_prepare = trace["ready_enqueue_ms"] - trace["proxy_enqueue_ms"]
    assert trace["actual_know_prepare_ms"] == know_prepare
    assert trace["predict_total_ms"] == round(know_prepare + 40.0 + trace["predict_service_ms"], 1)
    assert trace["actual_ready_queue_ms"] == trace["forward_start_ms"] - trace["ready_enqueue_ms"]
    assert trace["proxy_enqueue_ms"] <= trace["prepare_dequeue_ms"] <= trace["prepare_start_ms"]
    if stream:
        assert body.endswith(b"data: [DONE]\n\n")
        assert trace["actual_ttft_ms"] == trace["first_token_ms"] - trace["proxy_recv_ms"]
        assert trace["actual_vllm_ttft_ms"] == trace["first_token_ms"] - trace["forward_start_ms"]
        assert trace["actual_vllm_internal_ms"] == trace["actual_vllm_ttft_ms"]
        assert trace["actual_total_ms"] == trace["first_token_ms"] - trace["proxy_enqueue_ms"]
        assert trace["decode_start_ms"] >= trace["first_token_ms"]


def _plane(segment, **overrides: Any) -> tuple[DataPlane, Pipeline, _Upstream, WorkerRow]:
    """A worker's data plane over two instances and the fake upstream (first connection
    refused, then answers), with a real segment, router, pipeline and event channel."""
    writer = DirectoryWriter(segment)
    writer.allocate("inst-a", "127.0.0.1", 9001)
    writer.allocate("inst-b", "127.0.0.1", 9002)
    settings = Settings(instance_strategy="least_load", shm_name=segment.name, retry_attempts=1,
                        **overrides)
    row = WorkerRow.claim(segment, 0)
    router = Router(settings, segment, row)
    upstream = _Upstream()
    predictors = get_predictors(settings.predictor_profile)
    pipeline = Pipeline(settings, EventChannelWriter(segment, row),
                        KnowledgePreparer(settings, upstream, predictors), predictors,
                        pressure_of=lambda instance: 40.0,
                        booking_of=lambda instance, now_us: (40.0, router.view.booking(instance, now_us)[1]))
    return DataPlane(WorkerContext(settings, 0, router, upstream, pipeline)), pipeline, upstream, row


def _plain_body(stream: bool) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "q" * 200}],
                       "max_tokens": 4, "stream": stream}).encode()


def _trace_shape(meta: dict[str, Any]) -> dict[str, Any]:
    """What must not depend on the path: the keys in order, and every value that is not a time."""
    trace = meta["trace"]
    return {"keys": list(trace), **{k: v for k, v in trace.items() if not k.endswith("_ms")}}


def _events_of(segment, row: WorkerRow) -> list[tuple[int, int, bool]]:
    """What the sidecar would read of the row: (kind, request key, failed) in order."""
    from shm_schema.events import EventReader

    return [(e.kind, e.request_key, e.failed) for e in EventReader(segment).drain(row.row)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_plain_request_takes_the_lean_path_and_reports_what_the_pipeline_would(segment, stream):
    from shm_schema.events import EventKind

    plane, pipeline, upstream, row = _plane(segment)
    status, body = asyncio.run(_serve(plane, _plain_body(stream)))
    assert status == 200 and upstream.opened[0] != upstream.opened[1]  # retried elsewhere
    assert pipeline.plain_path == 2  # both attempts were admitted the lean way...
    assert plane.plain.served == 1  # ...by the lean path (plain_path.py), not the exchange
    lean = meta_of(body) if stream else json.loads(body)["_cacheroute_meta"]
    lean_events = _events_of(segment, row)
    kinds = [kind for kind, _, _ in lean_events]
    # Booked once it has left: the refused attempt never did, and the sidecar hears nothing of it.
    assert kinds.count(EventKind.RESERVE) == 1 and kinds.count(EventKind.COMPLETE) == 1

    # The same request, made to take the full pipeline: the same trace, key for key, and the
    # same events for the sidecar, but for the refused attempt's booking and its failure.
    with fresh_segment() as other:
        full_plane, full_pipeline, _, full_row = _plane(other)
        full_pipeline.admit_plain = lambda *args: None  # type: ignore[method-assign]
        _, full_body = asyncio.run(_serve(full_plane, _plain_body(stream)))
        full_events = _events_of(other, full_row)
    full = meta_of(full_body) if stream else json.loads(full_body)["_cacheroute_meta"]
    assert _trace_shape(lean) == _trace_shape(full) and lean["error"] is None
    assert lean["trace"]["ready_release_seq"] == 1 and lean["trace"]["ready_worker_idx"] == 0
    refused = full_events[0][1]
    assert [(kind, key) for kind, key, _ in full_events[:2]] == [(EventKind.RESERVE, refused),
                                                                (EventKind.COMPLETE, refused)]
    assert lean_events == full_events[2:]


@pytest.mark.parametrize("lean", [True, False], ids=["lean path", "exchange"])
def test_a_plain_request_leaves_no_reference_cycle(segment, lean):
    """Everything a request made is freed as its last reference goes, retry included, on either
    path: nothing is left for the cyclic collector, whose passes would stall the worker (a job
    holding a callable that holds the job did, for ~1 % of requests at c1)."""
    plane, pipeline, upstream, _ = _plane(segment)
    plane.plain.open = lean
    asyncio.run(_serve(plane, _plain_body(stream=False)))  # warm: what lives on is made
    gc.collect()
    gc.disable()
    try:
        for stream in (False, True, False):
            upstream.opened.clear()  # the first attempt is refused again: a retry each time
            assert asyncio.run(_serve(plane, _plain_body(stream)))[0] == 200
        assert gc.collect() == 0 and pipeline.plain_path == 8
    finally:
        gc.enable()


def test_a_requests_decode_is_predicted_for_the_batch_it_joins(segment):
    """Two requests of another worker's in flight on each instance: the sidecar is told the
    decode of a batch of three, not of one alone (the attempt that reached an instance: the
    refused one was never booked)."""
    plane, pipeline, _, _ = _plane(segment)
    other = WorkerRow.claim(segment, 1)
    for instance in DirectoryReader(segment).snapshot().alive:
        for _ in range(2):
            assert other.begin(instance.slot, instance.generation)
    real = pipeline._predictors
    asked: list[tuple[int, int, int]] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def decode_ms(self, context: int, tokens: int, bs: int) -> float:
            asked.append((context, tokens, bs))
            return real.decode_ms(context, tokens, bs)

    pipeline._predictors = Recording()
    status, body = asyncio.run(_serve(plane, _plain_body(stream=False)))
    assert status == 200 and [bs for _, _, bs in asked] == [3]
    context, tokens, _ = asked[-1]
    predicted = json.loads(body)["_cacheroute_meta"]["trace"]["predict_decode_ms"]
    assert predicted == round(real.decode_ms(context, tokens, 3), 1) != round(real.decode_ms(context, tokens, 1), 1)


def test_a_scheduler_request_keeps_the_full_pipeline(segment):
    plane, pipeline, _, _ = _plane(segment, injection_strategy="iws")
    status, _ = asyncio.run(_serve(plane, _scheduler_body(stream=False)))
    assert status == 200 and pipeline.plain_path == 0 and plane.plain.served == 0


@pytest.mark.parametrize("strategy, spans, lean", [
    ("least_load", False, True), ("round_robin", False, True),
    ("kv_aware", False, False),  # it hashes the prompt and claims what the request brings
    ("least_load", True, False),  # spans: the exchange opens one per attempt
])
def test_which_plain_requests_take_the_lean_path(segment, strategy, spans, lean):
    from proxy_workers.plain_path import PlainPath
    from proxy_workers.request_model import recover
    from proxy_workers.server import assemble

    settings = Settings(instance_strategy=strategy, shm_name=segment.name)
    ctx = assemble(settings, segment, WorkerRow.claim(segment, 0), 0, object() if spans else None).ctx
    path = PlainPath(ctx.router, ctx.pipeline, ctx.upstream, 1, spans=ctx.tracing is not None)
    assert path.takes(recover(Endpoint.CHAT, _plain_body(stream=True))) is lean
    assert path.takes(recover(Endpoint.CHAT, _scheduler_body(stream=False))) is False  # knowledge


def test_a_plain_request_its_instance_makes_wait_waits_in_the_pipeline_on_the_same_choice(segment):
    """Every ready place of both instances held by another worker: the lean path hands the
    request, with the instance it chose, to the exchange, whose pipeline waits for a place;
    one frees and the request is served there, its wait in the trace."""
    from shm_schema import layout

    plane, pipeline, upstream, row = _plane(segment, ready_concurrency=1)
    upstream.opened.append(0)  # no refused first connection here: nothing fails
    other = WorkerRow.claim(segment, 1)
    instances = DirectoryReader(segment).snapshot().alive
    for instance in instances:
        assert other.try_admit(layout.LANE_READY_ACTIVE, instance.slot, instance.generation, 1).name == "ADMITTED"

    router = plane.plain.router
    choices: list[str] = []

    def acquire(*args: Any) -> Lease:
        lease = Router.acquire(router, *args)
        choices.append(lease.instance.instance_id)
        return lease

    router.acquire = acquire  # type: ignore[method-assign]

    async def scenario() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        for instance in instances:
            loop.call_later(0.05, other.remove, layout.LANE_READY_ACTIVE, instance.slot, instance.generation)
        return await _serve(plane, _plain_body(stream=False))

    status, body = asyncio.run(scenario())
    trace = json.loads(body)["_cacheroute_meta"]["trace"]
    assert status == 200 and plane.plain.served == 1 and pipeline.plain_path == 0
    assert len(upstream.opened) == 2 and "retries" not in trace  # one attempt...
    assert choices == [trace["instance_id"]]  # ...on the one choice made
    assert trace["ready_dequeue_ms"] - trace["ready_enqueue_ms"] >= 40
    assert row.release() == {}  # the lease and every lane given back


def test_a_streams_last_events_its_meta_and_done_leave_in_one_write(segment):
    plane, _, upstream, _ = _plane(segment)
    first, last = (b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % word for word in (b"a", b"z"))

    async def answered(host: str, port: int, path: str, body: bytes, headers: bytes,
                       sent: Callable[[], None] | None = None) -> _Response:
        if sent is not None:
            sent()
        return _Response([first, last + b"data: [DONE]\n\n"])  # the last event and the end in one read
    upstream.send = answered  # type: ignore[method-assign]

    async def served() -> _Cycle:
        cycle = _Cycle(_plain_body(stream=True))
        await plane.serve(Endpoint.CHAT, cycle)  # type: ignore[arg-type]
        return cycle
    cycle = asyncio.run(served())
    assert cycle.status == 200 and cycle.sent[0] == first
    end = cycle.sent[-1]  # Cycle.end: one write with the stream's terminator
    assert end.startswith(last + b"event: cacheroute_meta\ndata: ") and end.endswith(b"\n\ndata: [DONE]\n\n")
    assert b"".join(cycle.sent).count(b"[DONE]") == 1


def test_an_instance_that_left_while_the_request_waited_leaves_it_to_another(segment, monkeypatch):
    """Unregistered between its choice and its admission, nothing sent to it: the request is
    retried on the other instance (a 503 before), within PROXY_RETRY_ATTEMPTS."""
    from shm_schema import Admission

    plane, pipeline, upstream, _ = _plane(segment)
    upstream.opened.append(0)  # no refused connection here: the instance leaving is the failure
    pipeline.admit_plain = lambda *args: None  # type: ignore[method-assign]
    admitted = Lease.try_admit
    asked: list[str] = []

    def try_admit(lease: Lease, lane: int, limit: int) -> Admission:
        asked.append(lease.instance.instance_id)
        return Admission.STALE if lease.instance.instance_id == asked[0] else admitted(lease, lane, limit)

    monkeypatch.setattr(Lease, "try_admit", try_admit)
    status, body = asyncio.run(_serve(plane, _plain_body(stream=False)))
    trace = json.loads(body)["_cacheroute_meta"]["trace"]
    assert status == 200 and trace["retries"] == 1 and len(set(asked)) == 2
