"""Static instances (PROXY_STATIC_INSTANCES): engines without an agent,
registered and probed by the sidecar. Simulated instances started with --no-register stand
in for vLLM (they serve /health, /v1/models and /version); the cluster is real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, SimInstance, chat_body, free_port, get, http, wait_until

PROBE_S = "0.5"
NOT_A_CONTROL_PLANE = "http://127.0.0.1:1"  # they never register: nothing to reach


def engine(tmp_path: Path, port: int, name: str) -> SimInstance:
    sim = SimInstance(NOT_A_CONTROL_PLANE, tmp_path, "--no-register", "--time-scale", "0.05",
                      "--model", "static-model", "--max-model-len", "2048", port=port, instance_id=name)
    wait_until(lambda: get(f"{sim.url}/health", timeout=1)["ok"], 20, message=f"{name} serving")
    return sim


def row(cluster: Any, instance_id: str) -> dict[str, Any] | None:
    listed = get(f"{cluster.cp_url}/v1/instance/list?include_dead=true")
    return {r["instance_id"]: r for r in listed}.get(instance_id)


def health(cluster: Any, instance_id: str) -> str | None:
    found = row(cluster, instance_id)
    return None if found is None else found["health"]


def served_by(cluster: Any, n: int) -> set[str]:
    seen = set()
    for _ in range(n):
        status, body, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
        assert status == 200, body
        seen.add(headers["x-cacheroute-instance"])
    return seen


def probes(cluster: Any) -> int:
    return cluster.status()["static_instances"]["instances"][0]["probes"]


@pytest.mark.slow
def test_static_instances_are_registered_probed_flipped_kept_and_readopted(make_cluster, tmp_path):
    port = free_port()
    static = engine(tmp_path, port, "static-a")
    cluster = make_cluster(workers=2, env={
        "PROXY_STATIC_INSTANCES": f"{static.url}=static-a", "PROXY_STATIC_PROBE_S": PROBE_S,
        "PROXY_INSTANCE_TTL_S": "3", "PROXY_INSTANCE_PURGE_GRACE_S": "1"})

    wait_until(lambda: health(cluster, "static-a") == "healthy", 15, message="static-a probed in")
    found = row(cluster, "static-a")
    assert found["static"] is True and (found["host"], found["port"]) == ("127.0.0.1", port)
    assert found["capabilities"]["model"]["identifier"] == "static-model"
    assert found["capabilities"]["runtime"] == {"vllm_version": "sim-0.1", "supported_cache_features": []}
    assert found["meta"]["max_model_len"] == 2048 and found["capability_fingerprint"].startswith("sha256:")
    assert found["meta"]["served_models"] == ["static-model"]
    assert [m["id"] for m in get(f"{cluster.worker_url(0)}/v1/models")["data"]] == ["static-model"]
    generation = found["slot_generation"]
    assert served_by(cluster, 3) == {"static-a"}

    # Healthy and probed, it never expires, though it never heartbeats (TTL 3 s).
    start = probes(cluster)
    wait_until(lambda: probes(cluster) >= start + 10, 30, message="ten more probes (> the TTL)")
    assert health(cluster, "static-a") == "healthy"

    registered = cluster.add_instance()
    static.stop()  # the engine goes: out of the candidate set at its next probe
    wait_until(lambda: health(cluster, "static-a") == "unhealthy", 10, message="static-a probed out")
    for worker in range(cluster.workers):
        loads = {r["instance_id"]: r for r in cluster.loads(worker)["instances"]}
        assert (loads["static-a"]["health"], loads["static-a"]["is_alive"]) == ("unhealthy", False)
    assert served_by(cluster, 4) == {registered.instance_id}

    # An ordinary instance that goes silent is purged; the static one, down for longer, stays.
    registered.stop()
    wait_until(lambda: row(cluster, registered.instance_id) is None, 30, message="registered instance purged")
    assert health(cluster, "static-a") == "unhealthy" and row(cluster, "static-a")["slot_generation"] == generation

    static = engine(tmp_path, port, "static-a")  # the engine is back
    wait_until(lambda: health(cluster, "static-a") == "healthy", 10, message="static-a probed back in")
    assert served_by(cluster, 2) == {"static-a"}
    assert row(cluster, "static-a")["slot_generation"] == generation

    # A restarted sidecar adopts it from the shared table and keeps probing it.
    old_pid = cluster.status()["sidecar"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: cluster.status()["sidecar"]["pid"] != old_pid, 20, message="sidecar restarted")
    adopted = wait_until(lambda: (r := row(cluster, "static-a")) and r["capabilities"] and r, 10,
                         message="capabilities read again after the restart")
    assert (adopted["static"], adopted["health"], adopted["slot_generation"]) == (True, "healthy", generation)
    assert adopted["capabilities"]["model"]["identifier"] == "static-model"
    static.stop()
    wait_until(lambda: health(cluster, "static-a") == "unhealthy", 10, message="probed out after the restart")
    assert "static-a is unhealthy: its health probe failed" in cluster.launcher_log()


def test_a_static_engine_down_at_start_is_registered_out_and_comes_in_when_it_answers(make_cluster, tmp_path):
    port = free_port()
    cluster = make_cluster(workers=1, env={"PROXY_STATIC_INSTANCES": f"http://127.0.0.1:{port}",
                                           "PROXY_STATIC_PROBE_S": PROBE_S})
    name = f"hp_127.0.0.1:{port}"
    found = row(cluster, name)
    assert found is not None and (found["health"], found["static"], found["capabilities"]) == ("unhealthy", True, None)
    assert http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))[0] == 503
    static = engine(tmp_path, port, name)
    try:
        wait_until(lambda: health(cluster, name) == "healthy", 10, message="probed in once it answers")
        assert row(cluster, name)["capabilities"]["model"]["identifier"] == "static-model"
        assert served_by(cluster, 2) == {name}
    finally:
        static.stop()


def test_a_bad_static_instances_value_stops_the_start_naming_the_variable():
    env = {**os.environ, "PROXY_STATIC_INSTANCES": "https://127.0.0.1:8000", "PROXY_CP_PORT": str(free_port())}
    for argv in (["-m", "sidecar"], ["-m", "cacheroute_proxy", "run"]):
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, (argv, done.returncode, done.stderr[-2000:])
        assert "PROXY_STATIC_INSTANCES" in done.stderr and "http://" in done.stderr, done.stderr[-2000:]
