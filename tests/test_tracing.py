"""Tracing through a real cluster (docs/operations.md, "Tracing"): with an
OTLP endpoint set, every request's spans reach a collector (tests/otlp_receiver.py, a real
OTLP/HTTP receiver on 127.0.0.1) under the client's trace id, `receive` a child of the
client's span, the stages nested and in time order; the instance, its KV pull and the KDN get
a traceparent of the same trace whose parent is the proxy's own span. No traceparent, or an
invalid one: a new trace, never a 400. With tracing off the client's traceparent reaches the
instance and the KDN unchanged. Without the SDK the worker serves, and says why once."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from proxy_workers.traceparent import parse
from tests.aio import meta_of
from tests.harness import Cluster, Process, chat_body, free_port, get, http, post, wait_until
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

# One parallel test worker runs them all: they share the module's clusters, KDN and receiver.
pytestmark = pytest.mark.xdist_group(__name__)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
STAGES = ("receive", "select", "prepare", "admission_wait", "forward", "first_token")
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def client_traceparent(trace_id: str = TRACE_ID, flags: str = "01") -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-{flags}"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def kdn(tmp_path_factory):
    port = free_port()
    process = Process(["-m", "cacheroute_sim.kdn", "--port", str(port), "--time-scale", "0.05"], {},
                      tmp_path_factory.mktemp("kdn") / "kdn.log")
    try:
        wait_until(lambda: get(f"http://127.0.0.1:{port}/healthz", timeout=1), 15, message="kdn up")
        yield f"127.0.0.1:{port}"
    finally:
        process.stop()


def start_cluster(tmp_path_factory, name: str, env: dict[str, str]):
    return start_cluster_at(tmp_path_factory.mktemp(name), env)


def start_cluster_at(path, env: dict[str, str]):
    cluster = Cluster(path, workers=1, env=env).start()
    try:
        cluster.add_instance()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def traced(tmp_path_factory, receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "proxy-under-test"}
    cluster = start_cluster(tmp_path_factory, "traced", env)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def untraced(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory, "untraced", {})
    try:
        yield cluster
    finally:
        cluster.stop()


# --- helpers ---------------------------------------------------------------------------------------
def ask(cluster: Cluster, body: dict[str, Any], headers: dict[str, str]) -> Any:
    status, payload, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=30,
                              headers=headers)
    assert status == 200, payload
    return payload


def instance_trace_context(cluster: Cluster) -> dict[str, list[str]]:
    headers = cluster.instances[0].stats()["last_request_headers"]
    return {name: [v for n, v in headers if n == name] for name in ("traceparent", "tracestate")}


def spans_of(receiver: OtlpReceiver, trace_id: str, names: tuple[str, ...]) -> dict[str, ReceivedSpan]:
    """The trace's spans by name, once every one of `names` has arrived (each once)."""
    def arrived() -> dict[str, ReceivedSpan] | None:
        spans = receiver.of_trace(trace_id)
        by_name = {s.name: s for s in spans}
        if not set(names) <= set(by_name):
            return None
        assert len(by_name) == len(spans), f"a span name came twice: {sorted(s.name for s in spans)}"
        return by_name
    return wait_until(arrived, 10, message=f"spans {names} of trace {trace_id}")


def assert_nested(child: ReceivedSpan, parent: ReceivedSpan) -> None:
    assert child.parent_span_id == parent.span_id, (child.name, parent.name)
    assert parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns, (child, parent)


def assert_request_spans(spans: dict[str, ReceivedSpan], instance_id: str) -> None:
    """The stages' parents and order: select, prepare, admission wait, then the forward with
    its first token, all within receive."""
    receive = spans["receive"]
    assert receive.kind == SERVER and receive.status_code != 2
    assert receive.attributes["http.response.status_code"] == 200
    assert receive.attributes["cacheroute.instance_id"] == instance_id
    assert receive.attributes["cacheroute.strategy"] == "round_robin"
    assert receive.attributes["url.path"] == "/v1/chat/completions"
    assert receive.resource["service.name"] == "proxy-under-test"
    for name in ("select", "prepare", "admission_wait", "forward"):
        assert_nested(spans[name], receive)
    assert_nested(spans["first_token"], spans["forward"])
    order = [spans["select"], spans["prepare"], spans["admission_wait"], spans["forward"]]
    for earlier, later in zip(order, order[1:]):
        assert earlier.end_ns <= later.start_ns, (earlier.name, later.name)
    assert spans["forward"].kind == CLIENT
    assert spans["forward"].attributes["cacheroute.instance_id"] == instance_id
    assert spans["forward"].attributes["http.response.status_code"] == 200
    assert spans["select"].attributes["cacheroute.instance_id"] == instance_id


# --- tracing on ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_spans_arrive_under_the_client_trace_and_the_instance_gets_the_forward_as_parent(
        traced, receiver, stream):
    trace_id = f"{TRACE_ID[:-1]}{int(stream)}"
    answer = ask(traced, chat_body(stream=stream, max_tokens=3),
                 {"traceparent": client_traceparent(trace_id), "tracestate": "vendor=abc,other=1"})
    assert "[DONE]" in answer if stream else answer["choices"]

    spans = spans_of(receiver, trace_id, STAGES)
    assert spans["receive"].parent_span_id == CLIENT_SPAN
    assert_request_spans(spans, traced.instances[0].instance_id)  # first_token: within forward

    # The instance saw one traceparent, of the client's trace, whose parent is the forward span.
    context = instance_trace_context(traced)
    assert len(context["traceparent"]) == 1, context
    sent = parse(context["traceparent"][0])
    assert sent is not None and f"{sent.trace_id:032x}" == trace_id and sent.sampled
    assert f"{sent.span_id:016x}" == spans["forward"].span_id
    assert context["tracestate"] == ["vendor=abc,other=1"]


def test_without_a_traceparent_the_proxy_starts_a_trace(traced, receiver):
    ask(traced, chat_body(stream=True, max_tokens=2), {})
    context = instance_trace_context(traced)
    assert len(context["traceparent"]) == 1 and context["tracestate"] == [], context
    sent = parse(context["traceparent"][0])
    assert sent is not None and sent.sampled
    spans = spans_of(receiver, f"{sent.trace_id:032x}", STAGES)
    assert spans["receive"].parent_span_id == ""  # a root
    assert f"{sent.span_id:016x}" == spans["forward"].span_id


@pytest.mark.parametrize("invalid", [
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",
    "not a traceparent at all",
])
def test_an_invalid_traceparent_is_ignored_never_a_400(traced, receiver, invalid):
    ask(traced, chat_body(stream=False, max_tokens=2), {"traceparent": invalid, "tracestate": "a=1"})
    context = instance_trace_context(traced)
    sent = parse(context["traceparent"][0])
    assert sent is not None and f"{sent.trace_id:032x}" not in invalid.lower()
    assert context["tracestate"] == []  # a tracestate means nothing without its traceparent
    spans = spans_of(receiver, f"{sent.trace_id:032x}", STAGES)
    assert spans["receive"].parent_span_id == ""


def test_an_unsampled_client_trace_is_propagated_and_not_exported(traced, receiver):
    trace_id = "5" * 32
    ask(traced, chat_body(stream=False, max_tokens=2), {"traceparent": client_traceparent(trace_id, "00")})
    sent = parse(instance_trace_context(traced)["traceparent"][0])
    assert sent is not None and f"{sent.trace_id:032x}" == trace_id and not sent.sampled
    # A sampled request after it is exported: had the unsampled one been, it would be too by now.
    ask(traced, chat_body(stream=False, max_tokens=2), {"traceparent": client_traceparent("6" * 32)})
    spans_of(receiver, "6" * 32, STAGES)
    assert receiver.of_trace(trace_id) == []


def kv_ready_id(kdn: str) -> str:
    """An id the KDN has prebuilt KV for (its generated store: half of them)."""
    ids = [f"k{i:04d}" for i in range(20)]
    found = post(f"http://{kdn}/knowledge/search/text", {"knowledge_ids": ids, "need_fields": ["kv_ready"]})
    return next(item["knowledge_id"] for item in found["items"] if item["kv_ready"])


def knowledge_body(kdn: str, kid: str) -> dict[str, Any]:
    return {"Request_ID": 11, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 5,
                                         "max_tokens": 2, "stream": True},
            "Service": {"Enable_know_injection": True, "Injection_type": "kvcache",
                        "Knowledge_List": [kid], "Knowledge_length": 1000},
            "Task": {"KDN_server_addr": kdn}}


def test_the_kdn_and_the_kv_pull_get_the_trace_with_their_own_spans_as_parents(traced, receiver, kdn):
    trace_id = "7" * 32
    text = ask(traced, knowledge_body(kdn, kv_ready_id(kdn)),
               {"traceparent": client_traceparent(trace_id), "tracestate": "vendor=kdn"})
    meta = meta_of(text.encode())
    assert meta["error"] is None and meta["trace"]["kvcache_actual_path"] == "kv_injected", meta

    spans = spans_of(receiver, trace_id, STAGES + ("kdn_fetch", "kv_inject"))
    assert_request_spans(spans, traced.instances[0].instance_id)
    assert_nested(spans["kdn_fetch"], spans["prepare"])
    assert_nested(spans["kv_inject"], spans["prepare"])
    assert spans["kdn_fetch"].end_ns <= spans["kv_inject"].start_ns
    assert spans["prepare"].attributes["cacheroute.injection_mode"] == "kvcache"

    searched = get(f"http://{kdn}/sim/stats")["last_search_trace_context"]
    assert searched == {"traceparent": f"00-{trace_id}-{spans['kdn_fetch'].span_id}-01",
                        "tracestate": "vendor=kdn"}
    pulled = traced.instances[0].stats()["last_inject_trace_context"]
    assert pulled == {"traceparent": f"00-{trace_id}-{spans['kv_inject'].span_id}-01",
                      "tracestate": "vendor=kdn"}
    forwarded = parse(instance_trace_context(traced)["traceparent"][0])
    assert forwarded is not None and f"{forwarded.span_id:016x}" == spans["forward"].span_id


# --- tracing off -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [client_traceparent(), "not a traceparent at all"])
def test_with_tracing_off_the_client_context_reaches_the_instance_unchanged(untraced, value):
    ask(untraced, chat_body(stream=True, max_tokens=2), {"traceparent": value, "tracestate": "vendor=abc"})
    assert instance_trace_context(untraced) == {"traceparent": [value], "tracestate": ["vendor=abc"]}
    ask(untraced, chat_body(stream=False, max_tokens=2), {})
    assert instance_trace_context(untraced) == {"traceparent": [], "tracestate": []}


def test_with_tracing_off_the_kdn_and_the_kv_pull_get_the_client_context_unchanged(untraced, kdn):
    ask(untraced, knowledge_body(kdn, kv_ready_id(kdn)),
        {"traceparent": client_traceparent(), "tracestate": "vendor=abc"})
    expected = {"traceparent": client_traceparent(), "tracestate": "vendor=abc"}
    assert get(f"http://{kdn}/sim/stats")["last_search_trace_context"] == expected
    assert untraced.instances[0].stats()["last_inject_trace_context"] == expected


# --- settings --------------------------------------------------------------------------------------
def test_tracing_is_off_without_an_endpoint_or_when_the_sdk_is_disabled():
    from cacheroute_proxy.config import Settings
    from proxy_workers.tracing import start_tracing

    assert start_tracing(Settings(), "w0", 0) is None
    off = Settings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                             "OTEL_SDK_DISABLED": "true"})
    assert start_tracing(off, "w0", 0) is None
    assert Settings.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}).otel_traces_on
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        Settings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"})


def test_an_endpoint_without_the_sdk_logs_one_error_and_serves_without_spans(monkeypatch, caplog):
    from cacheroute_proxy.config import Settings
    from proxy_workers.tracing import start_tracing

    # As if the [otel] extra were not installed: importing the SDK (and our module of it) fails.
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setitem(sys.modules, "proxy_workers.spans", None)
    on = Settings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    with caplog.at_level(logging.DEBUG, logger="cacheroute.worker"):
        assert start_tracing(on, "w0", 0) is None
        assert start_tracing(on, "w1", 1) is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cacheroute-proxy[otel]" in errors[0].getMessage()


def test_a_worker_that_stops_exports_what_is_still_batched(tmp_path, receiver):
    # A minute's batch delay: nothing is exported before the stop, everything at it.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    cluster = start_cluster_at(tmp_path, env)
    try:
        trace_id = "8" * 32
        ask(cluster, chat_body(stream=True, max_tokens=2), {"traceparent": client_traceparent(trace_id)})
        assert receiver.of_trace(trace_id) == []
    finally:
        code = cluster.stop()
    assert code == 0, cluster.launcher_log()[-3000:]
    assert {s.name for s in receiver.of_trace(trace_id)} >= set(STAGES)
    assert "tracing on: spans exported over OTLP/HTTP to " + receiver.endpoint in cluster.launcher_log()


def test_a_cluster_without_the_sdk_serves_passes_the_context_on_and_says_so_once(tmp_path, receiver):
    # A package that shadows the SDK and cannot be imported: the [otel] extra is not installed.
    stub = tmp_path / "no-sdk" / "opentelemetry"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("no OpenTelemetry here")\n')
    cluster = Cluster(tmp_path / "cluster", workers=2, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "PYTHONPATH": str(stub.parent)})
    (tmp_path / "cluster").mkdir()
    cluster.start()
    try:
        cluster.add_instance()
        ask(cluster, chat_body(stream=True, max_tokens=2), {"traceparent": client_traceparent("9" * 32)})
        assert instance_trace_context(cluster)["traceparent"] == [client_traceparent("9" * 32)]
    finally:
        cluster.stop()
    log = cluster.launcher_log()
    assert log.count("tracing is off: OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK "
                     "is not installed") == 1, log[-3000:]
    assert receiver.of_trace("9" * 32) == []


def test_a_retried_request_has_one_forward_span_per_attempt(make_cluster, receiver):
    cluster = make_cluster(workers=1, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                           "OTEL_BSP_SCHEDULE_DELAY": "50"})
    bad, good = cluster.add_instance(), cluster.add_instance()
    bad.configure(fail_status=503, fail_rate=1.0)
    retried = None
    for n in range(4):  # round robin: one of the first two goes to the bad instance first
        trace_id = f"{n + 1:x}" * 32
        text = ask(cluster, chat_body(stream=True, max_tokens=2), {"traceparent": client_traceparent(trace_id)})
        if meta_of(text.encode())["trace"].get("retries") == 1:
            retried = trace_id
            break
    assert retried is not None, "no request was retried"

    def both_forwards() -> list[ReceivedSpan] | None:
        spans = receiver.of_trace(retried)
        forwards = sorted((s for s in spans if s.name == "forward"), key=lambda s: s.start_ns)
        return forwards if len(forwards) == 2 and any(s.name == "receive" for s in spans) else None
    failed, served = wait_until(both_forwards, 10, message="two forward spans")
    receive = next(s for s in receiver.of_trace(retried) if s.name == "receive")
    assert receive.attributes["cacheroute.retries"] == 1 and receive.status_code != 2
    assert failed.attributes["cacheroute.instance_id"] == bad.instance_id and failed.status_code == 2
    assert failed.attributes["http.response.status_code"] == 503
    assert served.attributes["cacheroute.instance_id"] == good.instance_id and served.status_code != 2
    assert (failed.attributes["cacheroute.attempt"], served.attributes["cacheroute.attempt"]) == (0, 1)
    assert failed.end_ns <= served.start_ns and failed.parent_span_id == served.parent_span_id == receive.span_id
    headers = dict(good.stats()["last_request_headers"])
    assert headers["traceparent"] == f"00-{retried}-{served.span_id}-01"
