"""Two real engines behind one proxy, each registered by its agent: least_load spreads concurrent
requests over both (the per-instance counts, x-cacheroute-instance, say so), and an engine that
stops answering is dropped within about two seconds and taken back when it answers."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import Cluster, http, wait_until
from tests.real_engine.engines import SERVED_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

REQUESTS = 16


def one_request(cluster: Cluster, index: int, max_tokens: int = 32) -> str:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": f"request {index}"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    status, answer, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=120)
    assert status == 200 and answer.rstrip().endswith("data: [DONE]"), answer
    return headers["x-cacheroute-instance"]


def test_least_load_spreads_requests_over_both_engines(proxy: Callable[..., Cluster],
                                                        healthy_engines: list[VllmEngine]) -> None:
    cluster = proxy(engines=2, workers=2, strategy="least_load")
    # Long enough (256 tokens, 4 running at once an engine) that all of them are in flight before
    # the first ends: with short answers the threads' starts spread over more than an answer
    # takes, and least_load rightly sends most of them to whichever engine finishes first.
    with ThreadPoolExecutor(REQUESTS) as pool:
        chosen = Counter(pool.map(lambda i: one_request(cluster, i, max_tokens=256), range(REQUESTS)))
    expected_ids = {f"vllm-{engine.port}" for engine in healthy_engines}
    assert set(chosen) == expected_ids, chosen
    # Concurrent arrivals: each pick sees the other's inflight, so neither gets most of them.
    assert min(chosen.values()) >= REQUESTS // 4, chosen
    wait_until(lambda: all(v == 0 for v in cluster.inflight().values()), 10, message="inflight back to 0")


def test_a_stopped_engine_is_dropped_within_two_seconds_and_taken_back(
        proxy: Callable[..., Cluster], healthy_engines: list[VllmEngine]) -> None:
    """SIGSTOP to one engine's processes (it hangs: its /health no longer answers): its agent
    tells the proxy, every worker leaves it out within ~2 s, requests go to the other engine;
    SIGCONT: it is taken back."""
    cluster = proxy(engines=2, workers=2, strategy="least_load")
    stopped, other = healthy_engines
    stopped_id, other_id = f"vllm-{stopped.port}", f"vllm-{other.port}"

    def out_everywhere() -> bool:
        return all(not any(r["instance_id"] == stopped_id and r["is_alive"]
                           for r in cluster.loads(w)["instances"]) for w in range(cluster.workers))

    assert stopped.popen is not None
    os.killpg(stopped.popen.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        wait_until(out_everywhere, 3.0, interval=0.02, message="the stopped engine left every candidate set")
        dropped_after = time.monotonic() - began
        chosen = Counter(one_request(cluster, i) for i in range(4))
        assert chosen == Counter({other_id: 4}), chosen
    finally:
        os.killpg(stopped.popen.pid, signal.SIGCONT)
    wait_until(lambda: not out_everywhere(), 15, message="taken back once it answers")
    assert dropped_after < 3.0
