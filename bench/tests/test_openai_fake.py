"""bench/peers/openai_fake.py, the second bench-peers backend, served for real (uvicorn, its own
process, a real socket): vLLM-shaped answers, SSE framing, the response headers vLLM's OpenAI
server sends, the health and model probes, and that it stays apart from the product."""

from __future__ import annotations

import ast
import http.client
import json
from pathlib import Path
from typing import Iterator

import pytest

from bench.harness.backends import FakeInstances, InstanceSpec
from cacheroute_sim.processes import ROOT

# One parallel test worker runs them all: they share the module's fake instances.
pytestmark = pytest.mark.xdist_group(__name__)

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 3}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeInstances]:
    with FakeInstances([InstanceSpec()]) as instances:
        yield instances


def _request(fake: FakeInstances, method: str, path: str, body: object = None,
             headers: dict[str, str] | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", fake.ports[0], timeout=5)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp, raw


def _sse_events(raw: bytes) -> list[bytes]:
    """The payloads of `data: ...\\n\\n` events; anything else in the stream fails the test."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: "):] for e in events]


def test_chat_answer_is_vllm_shaped_json_with_content_length(fake: FakeInstances) -> None:
    resp, raw = _request(fake, "POST", "/v1/chat/completions", CHAT)
    assert resp.status == 200
    assert resp.getheader("content-type") == "application/json"
    assert int(resp.getheader("content-length")) == len(raw)
    assert resp.getheader("transfer-encoding") is None
    body = json.loads(raw)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "sim-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "reasoning_content": None,
                                 "content": "hello hello hello", "tool_calls": []}
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3,
                             "prompt_tokens_details": None}


def test_headers_are_uvicorns_plus_a_request_id(fake: FakeInstances) -> None:
    resp, raw = _request(fake, "POST", "/v1/chat/completions", CHAT)
    assert resp.getheader("server") == "uvicorn" and resp.getheader("date", "").endswith(" GMT")
    new_id = resp.getheader("x-request-id")
    assert new_id and len(new_id) == 32 and json.loads(raw)["id"] == f"chatcmpl-{new_id}"
    resp, _ = _request(fake, "POST", "/v1/chat/completions", CHAT, {"X-Request-Id": "abc-123"})
    assert resp.getheader("x-request-id") == "abc-123"  # the caller's, as vLLM echoes it
    again, _ = _request(fake, "POST", "/v1/chat/completions", CHAT)
    assert again.getheader("x-request-id") != new_id


def test_chat_stream_is_sse_chunks_then_done(fake: FakeInstances) -> None:
    resp, raw = _request(fake, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert resp.status == 200
    assert resp.getheader("content-type") == "text/event-stream; charset=utf-8"
    assert resp.getheader("transfer-encoding") == "chunked" and resp.getheader("content-length") is None
    assert resp.getheader("x-request-id") and resp.getheader("server") == "uvicorn"
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d["content"] for d in deltas) == "hello hello hello"
    assert len(deltas) == 3 + 2  # the role chunk, one per token, the finish chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_completions_whole_and_streamed(fake: FakeInstances) -> None:
    body = {"model": "sim-model", "prompt": "one two three four", "max_tokens": 2}
    resp, raw = _request(fake, "POST", "/v1/completions", body)
    answer = json.loads(raw)
    assert resp.status == 200 and answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == "hello hello" and answer["usage"]["prompt_tokens"] == 4
    resp, raw = _request(fake, "POST", "/v1/completions", {**body, "stream": True})
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["hello", " hello", ""]


def test_probes_and_bad_requests(fake: FakeInstances) -> None:
    resp, raw = _request(fake, "GET", "/health")
    assert resp.status == 200 and raw == b""  # what vllm-router waits for
    resp, raw = _request(fake, "GET", "/v1/models")
    assert resp.status == 200 and json.loads(raw)["data"][0]["id"] == "sim-model"
    resp, raw = _request(fake, "POST", "/v1/chat/completions", {"model": "sim-model"})
    assert resp.status == 400 and json.loads(raw)["object"] == "error"
    resp, raw = _request(fake, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 0})
    assert resp.status == 400
    resp, _ = _request(fake, "GET", "/v1/chat/completions")
    assert resp.status == 405


def test_the_fake_imports_neither_the_simulator_nor_the_product() -> None:
    tree = ast.parse((ROOT / "bench" / "peers" / "openai_fake.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots = {name.split(".")[0] for name in names}
    assert roots.isdisjoint({"cacheroute_sim", "cacheroute_proxy", "sidecar", "proxy_workers",
                             "shm_schema", "instance_agent", "bench"}), roots
    assert {"starlette", "uvicorn"} <= roots


def test_two_fakes_are_two_processes_on_two_ports(tmp_path: Path) -> None:
    with FakeInstances([InstanceSpec(max_concurrency=64)] * 2, log_dir=tmp_path) as pair:
        assert len(set(pair.ports)) == 2 and len(set(pair.pids())) == 2
        assert pair.register_body(1)["meta"] == {"max_num_seqs": 64}
        assert pair.register_body(1)["port"] == pair.ports[1]
