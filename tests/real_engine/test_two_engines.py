"""Two real engines behind one proxy: least_load spreads concurrent requests over both, and the
per-instance counts the proxy reports (x-cacheroute-instance) say so."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import Cluster, http, wait_until
from tests.real_engine.engines import SERVED_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

REQUESTS = 16


def one_request(cluster: Cluster, index: int) -> str:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": f"request {index}"}],
            "max_tokens": 32, "stream": True, "ignore_eos": True}
    status, answer, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=120)
    assert status == 200 and answer.rstrip().endswith("data: [DONE]"), answer
    return headers["x-cacheroute-instance"]


def test_least_load_spreads_requests_over_both_engines(proxy: Callable[..., Cluster],
                                                        healthy_engines: list[VllmEngine]) -> None:
    cluster = proxy(engines=2, workers=2, strategy="least_load")
    with ThreadPoolExecutor(REQUESTS) as pool:
        chosen = Counter(pool.map(lambda i: one_request(cluster, i), range(REQUESTS)))
    expected_ids = {f"vllm-{engine.port}" for engine in healthy_engines}
    assert set(chosen) == expected_ids, chosen
    # Concurrent arrivals: each pick sees the other's inflight, so neither gets most of them.
    assert min(chosen.values()) >= REQUESTS // 4, chosen
    wait_until(lambda: all(v == 0 for v in cluster.inflight().values()), 10, message="inflight back to 0")
