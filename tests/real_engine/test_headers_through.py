"""Headers cross the proxy both ways with a real vLLM (started with --enable-request-id-headers):
the client's X-Request-Id reaches vLLM, and vLLM's X-Request-Id (the client's, echoed, or one it
made up) reaches the client, stream and not."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import Cluster, http
from tests.real_engine.engines import SERVED_MODEL

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_request_id_reaches_the_client(proxy: Callable[..., Cluster], stream: bool) -> None:
    cluster = proxy(engines=1, workers=1)
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3, "stream": stream}
    status, _, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=60,
                              headers={"X-Request-Id": "trace-me-7", "traceparent":
                                       "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert status == 200
    assert headers["x-request-id"] == "trace-me-7"  # the client's id went to vLLM and came back
    status, _, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=60)
    assert status == 200 and len(headers["x-request-id"]) == 32  # one vLLM made up (uuid4 hex)
