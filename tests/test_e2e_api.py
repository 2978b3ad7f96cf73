"""The data plane's contract: both request shapes, response formats, errors that name the
problem, the worker header, and 503 when nothing is alive."""

from __future__ import annotations

import pytest

from cacheroute_sim.scheduler.requests import scheduler_body
from tests.aio import meta_of
from tests.harness import chat_body, http

# One parallel test worker runs them all: they share the module's cluster.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.harness import Cluster

    c = Cluster(tmp_path_factory.mktemp("api"), workers=2).start()
    try:
        yield c
    finally:
        c.stop()


def test_no_instance_is_503_with_retry_after(cluster):
    for path, request in (("/v1/chat/completions", chat_body()),
                          ("/v1/completions", {"model": "m", "prompt": "hi"})):
        status, body, headers = http("POST", f"{cluster.dp_url}{path}", request)
        assert status == 503 and body == {"error": "no_instance", "detail": "proxy has no alive instance"}
        assert headers["retry-after"] == "1" and headers["x-cacheroute-worker"].startswith("w")


def test_scheduler_request_streams_with_meta(cluster):
    if not cluster.instances:
        cluster.add_instance()
    status, text, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", scheduler_body(17))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert text.count('"content":"tok "') == 4
    assert text.endswith("data: [DONE]\n\n") and text.count("[DONE]") == 1
    meta = meta_of(text.encode())
    assert list(meta) == ["trace", "kv_ack", "kv_ready_kids", "text_only_kids", "miss_kids", "error",
                          "resident_kids"]
    assert meta["trace"]["request_id"] == 17 and meta["error"] is None
    assert meta["trace"]["instance_id"] == headers["x-cacheroute-instance"]


def test_scheduler_completions_and_non_streaming_chat_are_json(cluster):
    if not cluster.instances:
        cluster.add_instance()
    body = scheduler_body(17, stream=False)
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, payload, headers = http("POST", f"{cluster.dp_url}{path}", body)
        assert status == 200 and headers["content-type"] == "application/json", payload
        assert payload["_cacheroute_meta"]["error"] is None and payload["usage"]["completion_tokens"] == 4


def test_plain_openai_body_is_forwarded(cluster):
    if not cluster.instances:
        cluster.add_instance()
    status, payload, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False, max_tokens=3))
    assert status == 200 and payload["object"] == "chat.completion"
    status, payload, _ = http("POST", f"{cluster.dp_url}/v1/completions",
                              {"model": "m", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and payload["object"] == "text_completion"


@pytest.mark.parametrize("raw, status, code, mentions", [
    (b"{not json", 400, "invalid_json", "JSON"),
    (b"\xff\xfe", 400, "invalid_json", "JSON"),
    (b"[1, 2]", 400, "invalid_request_payload", "object"),
    (b'{"model": "m"}', 422, "invalid_request_payload", "messages"),
    (b'{"messages": [], "model": "m"}', 422, "invalid_request_payload", "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}', 422, "invalid_request_payload", "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 422, "invalid_request_payload", "max_tokens"),
    (b'{"Prompt": {"model": "m", "user_prompt": "x", "token_length": "abc"}}', 422, "invalid_request_payload", "token_length"),
    (b'{"Prompt": {"model": "m"}}', 422, "invalid_request_payload", "user_prompt"),
    (b'{"Prompt": null}', 422, "invalid_request_payload", "Prompt"),
])
def test_bad_input_is_4xx_naming_the_problem(cluster, raw, status, code, mentions):
    got, body, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", raw=raw)
    assert got == status and body["error"] == code and mentions in body["detail"], body
    assert "x-cacheroute-worker" in headers
    assert all(v == 0 for v in cluster.inflight().values())


def test_unknown_routes_and_methods(cluster):
    assert http("GET", f"{cluster.dp_url}/v1/chat/completions")[0] == 405
    status, body, headers = http("GET", f"{cluster.dp_url}/nope")
    assert status == 404 and body["error"] == "not_found" and "x-cacheroute-worker" in headers


def test_body_over_limit_is_413(cluster):
    """Refused from the declared length, before the body is read (so a raw socket: a client
    library would still be sending when the answer comes)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", cluster.dp_port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 9437184\r\n\r\n{")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"] == "payload_too_large"
