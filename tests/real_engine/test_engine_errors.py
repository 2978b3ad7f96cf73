"""vLLM's own error answers reach the client unchanged: status, content type and body
(docs/protocol.md, "Responses": instance errors). Each is compared with what the engine answers
directly to the same body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Cluster, http
from tests.real_engine.engines import MAX_MODEL_LEN, SERVED_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

# Each character of this filler is about one token of the tiny model's tokenizer or more.
TOO_LONG = "x1 " * (MAX_MODEL_LEN * 2)

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "prompt over max_model_len": ("/v1/chat/completions", {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 4}, 400),
    "completions prompt over max_model_len": ("/v1/completions", {
        "model": SERVED_MODEL, "prompt": TOO_LONG, "max_tokens": 4, "stream": True}, 400),
    "bad parameter": ("/v1/chat/completions", {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": -1}, 400),
    "unknown model": ("/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream": True}, 404),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_errors_pass_through(proxy: Callable[..., Cluster], healthy_engines: list[VllmEngine],
                                  case: str) -> None:
    path, body, expected = CASES[case]
    cluster = proxy()
    direct_status, direct_body, direct_headers = http("POST", healthy_engines[0].url + path, body, timeout=30)
    assert direct_status == expected, direct_body  # what vLLM says, asked directly
    status, answer, headers = http("POST", cluster.dp_url + path, body, timeout=30)
    assert (status, answer) == (direct_status, direct_body)
    assert headers["content-type"] == direct_headers["content-type"] == "application/json"
    assert headers["x-cacheroute-instance"].startswith("vllm-")  # the engine's, not a refusal
    assert "_cacheroute_meta" not in answer and answer["error"]["code"] == expected


def test_the_openai_client_sees_the_engines_error(proxy: Callable[..., Cluster], openai_module: Any) -> None:
    cluster = proxy()
    client = openai_module.OpenAI(base_url=f"{cluster.dp_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai_module.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert raised.value.status_code == 404 and raised.value.body["param"] == "model"
    with pytest.raises(openai_module.BadRequestError) as raised:
        client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": TOO_LONG}],
                                       max_tokens=4, stream=True)
    assert raised.value.status_code == 400 and str(MAX_MODEL_LEN) in raised.value.message
