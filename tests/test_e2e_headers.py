"""Headers through a real cluster, both ways: the client's reach
the instance, the instance's reach the client, stream and not, error and not; hop-by-hop
ones and the proxy's own do not cross; Authorization is replaced only with OPENAI_API_KEY;
a header value with CR or LF never gets past the worker."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import pytest

from cacheroute_sim.scheduler.requests import scheduler_body
from tests.harness import Cluster, chat_body, wait_until

# One parallel test worker runs them all: they share the module's cluster.
pytestmark = pytest.mark.xdist_group(__name__)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
END_TO_END = {"traceparent": TRACEPARENT, "X-Session-ID": "session-42",
              "User-Agent": "OpenAI/Python 1.40.0", "X-Request-Id": "client-req-1"}
HOP_BY_HOP = {"Connection": "keep-alive, X-Hop", "X-Hop": "this hop only", "Keep-Alive": "timeout=5",
              "TE": "trailers", "Proxy-Authorization": "Basic eDp5",
              "Expect": "100-continue", "x-cacheroute-kv-prefix-tokens": "4096"}
# What the instance adds to its answers: end-to-end ones, hop-by-hop ones and ours.
INSTANCE_HEADERS = {"X-Instance-Note": "from the engine", "Keep-Alive": "timeout=9",
                    "Proxy-Authenticate": "Basic", "Connection": "x-engine-hop",
                    "X-Engine-Hop": "1", "X-Cacheroute-Worker": "spoofed",
                    "X-Cacheroute-Instance": "spoofed"}
CASES = [("chat", True), ("chat", False), ("completions", False), ("scheduler", True)]


def _body(kind: str, stream: bool) -> tuple[str, dict[str, Any]]:
    if kind == "chat":
        return "/v1/chat/completions", chat_body(stream=stream, max_tokens=2)
    if kind == "completions":
        return "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream}
    return "/v1/chat/completions", scheduler_body(5, stream=stream, max_tokens=2)


def exchange(port: int, path: str, body: dict[str, Any],
             headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
    """(status, the answer's headers as sent, names lower-case, body) of one POST whose
    headers are exactly `headers` plus Host, Content-Type and Content-Length."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        data = json.dumps(body).encode()
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in {"Content-Type": "text/plain", **headers,
                            "Content-Length": str(len(data))}.items():
            conn.putheader(name, value)
        conn.endheaders(data)
        response = conn.getresponse()
        return response.status, [(k.lower(), v) for k, v in response.getheaders()], response.read()
    finally:
        conn.close()


def values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k == name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("headers"), workers=1).start()
    try:
        c.add_instance()
        yield c
    finally:
        c.stop()


@pytest.fixture
def inst(cluster):
    inst = cluster.instances[0]
    inst.configure(response_headers=INSTANCE_HEADERS, request_id_headers=True)
    try:
        yield inst
    finally:
        inst.configure(response_headers={}, request_id_headers=False, fail_status=None)


@pytest.mark.parametrize("kind, stream", CASES)
def test_client_headers_reach_the_instance_and_hop_by_hop_ones_do_not(cluster, inst, kind, stream):
    path, body = _body(kind, stream)
    status, _, _ = exchange(cluster.dp_port, path, body,
                            {**END_TO_END, **HOP_BY_HOP, "Authorization": "Bearer client-key"})
    assert status == 200
    got = [(k, v) for k, v in inst.stats()["last_request_headers"]]
    for name, value in END_TO_END.items():
        assert values(got, name.lower()) == [value], (name, got)
    assert values(got, "authorization") == ["Bearer client-key"]  # no OPENAI_API_KEY: kept
    for name in HOP_BY_HOP:
        assert values(got, name.lower()) == [], (name, got)
    # The proxy's own: the instance's Host, the JSON it parsed, the length of what it sent.
    assert values(got, "host") == [f"127.0.0.1:{inst.port}"]
    assert values(got, "content-type") == ["application/json"]
    assert len(values(got, "content-length")) == 1 and values(got, "accept-encoding") == []


@pytest.mark.parametrize("kind, stream", CASES)
def test_instance_headers_reach_the_client_and_hop_by_hop_ones_do_not(cluster, inst, kind, stream):
    path, body = _body(kind, stream)
    status, headers, answer = exchange(cluster.dp_port, path, body, {"X-Request-Id": "client-req-2"})
    assert status == 200, answer
    assert values(headers, "x-request-id") == ["client-req-2"]  # the instance's, echoing ours
    assert values(headers, "x-instance-note") == ["from the engine"]
    assert values(headers, "x-sim-instance") == [inst.instance_id]
    for name in ("keep-alive", "proxy-authenticate", "x-engine-hop"):
        assert values(headers, name) == [], (name, headers)
    # One of each of the proxy's own, the proxy's values: no instance header duplicates them.
    assert values(headers, "x-cacheroute-instance") == [inst.instance_id]
    assert len(values(headers, "x-cacheroute-worker")) == 1
    assert values(headers, "x-cacheroute-worker")[0].startswith("w0-pid")
    assert len(values(headers, "date")) == 1 and len(values(headers, "server")) == 1
    if stream:
        assert values(headers, "content-type")[0].startswith("text/event-stream")
        assert answer.endswith(b"data: [DONE]\n\n") and b"cacheroute_meta" in answer
    else:
        assert values(headers, "content-type") == ["application/json"]
        assert values(headers, "content-length") == [str(len(answer))]
        assert "_cacheroute_meta" in json.loads(answer)


@pytest.mark.parametrize("stream", [True, False])
def test_an_instance_error_keeps_its_headers(cluster, inst, stream):
    inst.configure(fail_status=400)
    status, headers, answer = exchange(cluster.dp_port, "/v1/chat/completions",
                                       chat_body(stream=stream, max_tokens=2), {})
    assert status == 400 and json.loads(answer)["error"], answer
    request_id = values(headers, "x-request-id")
    assert len(request_id) == 1 and len(request_id[0]) == 32  # none sent: the instance made one
    assert values(headers, "x-instance-note") == ["from the engine"]
    assert values(headers, "x-cacheroute-instance") == [inst.instance_id]
    assert values(headers, "content-type") == ["application/json"]
    assert values(headers, "keep-alive") == []


@pytest.mark.parametrize("header", [b"X-A: a\nX-Injected: 1\r\n", b"X-A: a\r\n folded\r\n",
                                    b"X-A: a\rX-Injected: 1\r\n", b"X-A: a\x00b\r\n"],
                         ids=["bare-lf", "obs-fold", "bare-cr", "nul"])
def test_a_header_value_with_cr_or_lf_never_reaches_the_instance(cluster, inst, header):
    before = inst.stats()["total"]
    body = json.dumps(chat_body(stream=False, max_tokens=2)).encode()
    with socket.create_connection(("127.0.0.1", cluster.dp_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + header
                     + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 "), reply  # the worker's parser refuses it
    assert inst.stats()["total"] == before


def test_openai_api_key_replaces_the_clients_authorization(make_cluster):
    cluster = make_cluster(workers=1, env={"OPENAI_API_KEY": "sk-proxy"})
    inst = cluster.add_instance()
    for sent in ({"Authorization": "Bearer client-key"}, {}):
        status, _, _ = exchange(cluster.dp_port, "/v1/chat/completions",
                                chat_body(stream=False, max_tokens=2), {**sent, **END_TO_END})
        assert status == 200
        got = inst.stats()["last_request_headers"]
        assert values([tuple(h) for h in got], "authorization") == ["Bearer sk-proxy"], got
        assert values([tuple(h) for h in got], "traceparent") == [TRACEPARENT]
    wait_until(lambda: cluster.inflight()[inst.instance_id] == 0, 5, message="released")
