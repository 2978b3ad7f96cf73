"""The official `openai` Python client through the proxy to a real vLLM engine: chat streamed and
not, completions, and the Scheduler's request shape (docs/protocol.md, "Data plane")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cacheroute_sim.scheduler.requests import scheduler_body
from tests.harness import Cluster, http
from tests.real_engine.engines import SERVED_MODEL

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

MESSAGES = [{"role": "system", "content": "answer briefly"},
            {"role": "user", "content": "who wrote the quick brown fox"}]


def client_of(openai: Any, cluster: Cluster) -> Any:
    return openai.OpenAI(base_url=f"{cluster.dp_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_stream_through_the_proxy(proxy: Callable[..., Cluster], openai_module: Any) -> None:
    cluster = proxy()
    stream = client_of(openai_module, cluster).chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    # The proxy ends a whole stream with its cacheroute_meta event; the official client
    # does not know the event name and yields its data as one more chunk, without choices.
    *engine_chunks, meta = chunks
    assert meta.choices is None and meta.model_extra["error"] is None
    assert meta.model_extra["trace"]["instance_id"].startswith("vllm-")
    assert meta.model_extra["trace"]["actual_ttft_ms"] >= 0
    assert all(c.object == "chat.completion.chunk" and c.model == SERVED_MODEL for c in engine_chunks)
    finish = [c.choices[0].finish_reason for c in engine_chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    usage = engine_chunks[-1].usage  # include_usage: the last chunk of the engine's own
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 10
    text = "".join(c.choices[0].delta.content or "" for c in engine_chunks if c.choices)
    assert text, "no content streamed"


def test_chat_json_through_the_proxy(proxy: Callable[..., Cluster], openai_module: Any) -> None:
    cluster = proxy()
    raw = client_of(openai_module, cluster).chat.completions.with_raw_response.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=7, extra_body={"ignore_eos": True})
    answer = raw.parse()
    assert raw.status_code == 200 and raw.headers["x-cacheroute-instance"].startswith("vllm-")
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 7
    # The proxy's meta is the body's last key; the client keeps it as an extra field.
    meta = answer.model_extra["_cacheroute_meta"]
    assert meta["trace"]["instance_id"] == raw.headers["x-cacheroute-instance"]


def test_completions_through_the_proxy(proxy: Callable[..., Cluster], openai_module: Any) -> None:
    cluster = proxy()
    client = client_of(openai_module, cluster)
    answer = client.completions.create(model=SERVED_MODEL, prompt="the quick brown", max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert answer.object == "text_completion" and answer.choices[0].text
    assert answer.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=SERVED_MODEL, prompt="hello world", max_tokens=6,
                                              stream=True, extra_body={"ignore_eos": True}))
    *engine_chunks, meta = streamed
    assert meta.model_extra["trace"]["first_token_ms"] > 0
    assert [c.choices[0].finish_reason for c in engine_chunks][-1] == "length"
    assert sum(1 for c in engine_chunks if c.choices[0].text) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_scheduler_request_reaches_vllm(proxy: Callable[..., Cluster], stream: bool) -> None:
    """The Scheduler's body is rebuilt into an OpenAI chat body the engine accepts."""
    cluster = proxy()
    body = scheduler_body(41, model=SERVED_MODEL, user_prompt="who wrote the lazy dog",
                          max_tokens=6, stream=stream)
    status, answer, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=60)
    assert status == 200, answer
    assert headers["x-cacheroute-instance"].startswith("vllm-")
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        assert answer.count("data: {") >= 2 and answer.rstrip().endswith("data: [DONE]")
        meta_line = answer.split("event: cacheroute_meta\ndata: ", 1)[1].split("\n", 1)[0]
        assert '"request_id":41' in meta_line and '"error":null' in meta_line
    else:
        assert answer["model"] == SERVED_MODEL and answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] <= 6
        assert answer["_cacheroute_meta"]["trace"]["request_id"] == 41
