"""Instances that fail: retry on another instance while nothing has reached the client,
passive ejection after consecutive failures, and return after recovery."""

from __future__ import annotations

import time

from tests.aio import meta_of
from tests.harness import chat_body, get, http, post, wait_until


def test_failing_instance_is_retried_elsewhere_ejected_then_readmitted(make_cluster):
    cluster = make_cluster(workers=1, env={"PROXY_EJECT_AFTER_FAILURES": "2", "PROXY_EJECT_S": "1.5"})
    bad, good = cluster.add_instance(), cluster.add_instance()
    bad.configure(fail_status=503, fail_rate=1.0)
    url = f"{cluster.dp_url}/v1/chat/completions"
    results = [http("POST", url, chat_body(max_tokens=2)) for _ in range(8)]
    # Round-robin sends some to the bad one; each is retried on the good one, never failing.
    assert [status for status, _, _ in results] == [200] * 8
    served_by = [headers["x-cacheroute-instance"] for _, _, headers in results]
    assert set(served_by) == {good.instance_id}
    retried = [meta_of(text.encode())["trace"].get("retries") for _, text, _ in results]
    assert retried.count(1) == 2  # two failures, then the bad instance is ejected
    assert bad.stats()["total"] == 2
    health = get(f"{cluster.worker_url(0)}/healthz")["outliers"]
    assert any(h["ejections"] == 1 for h in health.values()), health

    bad.configure(fail_status=None)  # it recovers; after the ejection it gets traffic again
    time.sleep(1.6)
    for _ in range(4):
        assert http("POST", url, chat_body(max_tokens=2))[0] == 200
    assert bad.stats()["completed"] >= 1
    wait_until(lambda: all(v == 0 for v in cluster.inflight().values()), 5, message="inflight 0")


def test_refused_connection_is_retried(make_cluster):
    cluster = make_cluster(workers=1)
    good = cluster.add_instance()
    post(f"{cluster.cp_url}/v1/instance/register", {"instance_id": "ghost", "host": "127.0.0.1", "port": 1})
    for _ in range(4):
        status, _, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
        assert status == 200 and headers["x-cacheroute-instance"] == good.instance_id
    assert cluster.inflight()["ghost"] == 0


def test_no_retry_once_the_stream_started(make_cluster):
    cluster = make_cluster(workers=1)
    flaky, other = cluster.add_instance(), cluster.add_instance()
    for inst in (flaky, other):
        inst.configure(drop_after_chunks=1)
    status, text, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(max_tokens=5))
    meta = meta_of(text.encode())
    assert status == 200 and meta["error"].startswith("upstream_failed") and "retries" not in meta["trace"]
    assert (flaky.stats()["total"] + other.stats()["total"]) == 1
