"""Instances that fail: retry on another instance while nothing has reached the client,
passive ejection after consecutive failures, and return after recovery."""

from __future__ import annotations

import time

from tests.aio import meta_of
from tests.harness import Process, chat_body, free_port, get, http, post, wait_until


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


def test_a_kvcache_retry_reports_the_kv_of_the_instance_that_served(make_cluster, tmp_path):
    """The first instance pulls the KV, then fails the request (503): the retry has the
    second pull it too, and the meta's ack, path and timings are the second one's."""
    kdn_port = free_port()
    kdn = Process(["-m", "cacheroute_sim.kdn", "--port", str(kdn_port), "--time-scale", "0.05"], {},
                  tmp_path / "kdn.log")
    try:
        wait_until(lambda: get(f"http://127.0.0.1:{kdn_port}/healthz", timeout=1), 15, message="kdn up")
        found = post(f"http://127.0.0.1:{kdn_port}/knowledge/search/text",
                     {"knowledge_ids": [f"k{i:04d}" for i in range(20)], "need_fields": ["kv_ready"]})
        kid = next(item["id"] for item in found["items"] if item["kv_ready"])
        cluster = make_cluster(workers=1)
        bad, good = cluster.add_instance(), cluster.add_instance()
        bad.configure(fail_status=503, fail_rate=1.0)
        body = {"Request_ID": 7, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 20,
                                            "max_tokens": 2, "stream": True},
                "Service": {"Enable_know_injection": True, "Injection_type": "kvcache",
                            "Knowledge_List": [kid], "Knowledge_length": 1024},
                "Task": {"KDN_server_addr": f"127.0.0.1:{kdn_port}"}}
        metas = []
        for _ in range(2):  # round robin: one of the two tries the bad instance first
            status, text, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=30)
            assert status == 200 and headers["x-cacheroute-instance"] == good.instance_id, text
            metas.append(meta_of(text.encode()))
        retried = [m for m in metas if m["trace"].get("retries") == 1]
        assert retried, [m["trace"] for m in metas]
        # Each instance pulled the KV once: after its ack the affinity index had the id resident
        # there, so the next attempt on it asked for no inject (resident_kids). The request that
        # reached the good instance first is the one whose meta has no resident id.
        assert (bad.stats()["kv_injects"], good.stats()["kv_injects"]) == (1, 1)
        assert [len(m["resident_kids"]) for m in metas] == [0, 1]
        stats = good.stats()
        assert stats["kv_prefix_hits"] == 2  # both forwards to it carried the prefix...
        # ...and the ids it is the KV of: the KV it pulled was resident at both prefills.
        assert [kid] == [v for k, v in stats["last_request_headers"]
                         if k == "x-cacheroute-kv-knowledge-ids"]
        assert (stats["kv_resident_hits"], stats["kv_inject_fast_acks"]) == (2, 0)
        meta = retried[0]
        trace = meta["trace"]
        assert trace["instance_id"] == good.instance_id and meta["error"] is None
        assert meta["kv_ready_kids"] == [kid] and meta["kv_ack"]["ok"] is True
        if meta["resident_kids"]:  # the good instance already held it: no pull, no pull timings
            assert trace["kvcache_actual_path"] == "kv_resident" and "kv_ack_start_ms" not in trace
        else:
            assert trace["kvcache_actual_path"] == "kv_injected"
            # The pull whose timings the trace gives is the one just before the (second) forward.
            assert trace["prepare_start_ms"] <= trace["kv_ack_start_ms"] <= trace["kv_ack_end_ms"] \
                <= trace["forward_start_ms"]
    finally:
        kdn.stop()
