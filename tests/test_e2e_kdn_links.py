"""IWS over the KDN link through a real cluster: a static link
(PROXY_KDN_LINKS_JSON) changes its decision and its trace, a measured one (reported to the
sidecar) overrides the static one once every worker's refresh has copied it; the workers read
the sidecar's links without a failure."""

from __future__ import annotations

import json

import pytest

from tests.aio import meta_of
from tests.harness import Process, free_port, get, http, wait_until

SLOW_MBPS = 100  # a 3840-token KV takes ~36 s over it: text wins
FAST_MBPS = 100_000


@pytest.fixture
def kdn(tmp_path):
    port = free_port()
    process = Process(["-m", "cacheroute_sim.kdn", "--port", str(port), "--time-scale", "0.05"], {},
                      tmp_path / "kdn.log")
    try:
        wait_until(lambda: get(f"http://127.0.0.1:{port}/healthz", timeout=1), 15, message="kdn up")
        yield port
    finally:
        process.stop()


def _ask(base_url: str, kdn_addr: str) -> dict:
    body = {"Request_ID": 3, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 50,
                                        "max_tokens": 2, "stream": True},
            "Service": {"Enable_know_injection": True, "Injection_type": "text",
                        "Knowledge_List": ["k0001"], "Knowledge_length": 4000},
            "Task": {"KDN_server_addr": kdn_addr}}
    status, text, _ = http("POST", f"{base_url}/v1/chat/completions", body, timeout=30)
    assert status == 200, text
    trace = meta_of(text.encode())["trace"]
    # Which kvcache (or text) reason depends on the instance's predicted wait, not on the link.
    assert trace["iws_reason"].startswith(trace["injection_mode"]), trace
    return {key: trace.get(key) for key in ("injection_mode", "kdn_link_source")}


def _env(kdn_port: int) -> dict[str, str]:
    static = {f"kdn://127.0.0.1:{kdn_port}": {"bandwidth_mbps": SLOW_MBPS, "latency_ms": 1}}
    return {"PROXY_INJECTION_STRATEGY": "iws", "PROXY_KDN_LINKS_JSON": json.dumps(static),
            "PROXY_KDN_LINKS_REFRESH_S": "0.2"}


def test_a_static_link_changes_the_iws_decision_and_the_trace(make_cluster, kdn):
    cluster = make_cluster(workers=2, env=_env(kdn))
    cluster.add_instance()
    assert _ask(cluster.dp_url, f"127.0.0.1:{kdn}") == {"injection_mode": "text", "kdn_link_source": "static"}
    # The same KDN under an address no link names: the default bandwidth (1000 Mbps).
    assert _ask(cluster.dp_url, f"localhost:{kdn}") == {"injection_mode": "kvcache", "kdn_link_source": "default"}
    # Every worker has read the sidecar's (empty) links since it started: none failed once.
    assert "KDN links: cannot read" not in cluster.launcher_log()


def test_a_measured_link_overrides_the_static_one(make_cluster, kdn):
    cluster = make_cluster(workers=2, env=_env(kdn))
    inst = cluster.add_instance()
    report = {"instance_id": inst.instance_id,
              "links": {f"kdn://127.0.0.1:{kdn}": {"bandwidth_mbps": FAST_MBPS, "latency_ms": 0.2,
                                                  "iface": "lo", "measured_by": "test"}}}
    status, answer, _ = http("POST", f"{cluster.cp_url}/v1/topology/report", report)
    assert status == 200 and answer == {"ok": True, "merged_links": 1}, answer
    for worker in range(cluster.workers):  # each copies it within a few refreshes
        url = cluster.worker_url(worker)
        wait_until(lambda: _ask(url, f"127.0.0.1:{kdn}")["kdn_link_source"] == "measured", 10,
                   interval=0.2, message=f"the measured link in worker {worker}")
        assert _ask(url, f"127.0.0.1:{kdn}") == {"injection_mode": "kvcache", "kdn_link_source": "measured"}
