"""bench/harness (backends, contenders, wrk, cpu) and bench/peers: every contender routes over the
same simulated instances, the load generators count what they must (and flag what fails), CPU/RSS are charged
to the right process tree, and everything started is stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from cacheroute_sim.processes import ROOT
from bench.harness.wrk import run_wrk, wrk_post_script
from bench.harness.backends import FakeInstances, InstanceSpec, SimInstances
from bench.harness.contenders import (
    DirectContender,
    NginxContender,
    ProxyContender,
    RelayFloorContender,
    RouterContender,
    router_available,
)
from bench.harness.processes import http_json
from bench.peers import measure, stream_load, summary
from bench.peers.plan import KNOWN, RunConfig, chosen, instances_for

# One parallel test worker runs them all: they share the module's simulated instances.
pytestmark = pytest.mark.xdist_group(__name__)

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream": False}
needs_wrk = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed")
needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed")


# --- pure parts ----------------------------------------------------------------------------------
def test_summary_medians_pairs_and_ratios() -> None:
    runs = [{"scenario": "c1", "p50_ms": p, "added_p50_ms": p - 1, "errors": 0, "repeat": i}
            for i, p in enumerate([3.0, 1.0, 2.0])]
    runs.append({"scenario": "c32", "rps": 100.0, "cpu_s_per_1k": 0.5, "errors": 2,
                 "error_kinds": {"status": 2}, "rss_mb": 50.0, "repeat": 0})
    entry = summary.contender_entry({"name": "x", "kind": "proxy"}, runs)
    assert entry["median"]["c1_p50_ms"] == 2.0 and entry["median"]["added_p50_ms"] == 1.0
    assert entry["median"]["rss_mb"] == 50.0 and entry["errors"] == 2 and entry["flagged"]
    base = summary.contender_entry({"name": "nginx", "kind": "nginx"},
                                   [{"scenario": "c32", "rps": 400.0, "errors": 0}])
    ratios = summary.ratios_to([entry, base], "nginx")
    assert ratios["x"]["rps_c32"] == 0.25 and ratios["nginx"]["rps_c32"] == 1.0
    assert ratios["x"]["ttft_p50_ms"] is None  # unknown stays unknown
    assert any("FLAGGED x" in n and "status" in n for n in summary.flag_notes([entry, base]))
    assert "| x |" in summary.table({"contenders": [entry, base], "ratios_to_nginx": ratios})


def test_plan_always_has_the_direct_baseline_and_rejects_unknown_names() -> None:
    names = [p.name for p in chosen(RunConfig(out="-", contenders=["nginx"]))]
    assert names == ["direct", "nginx"]
    names = [p.name for p in chosen(RunConfig(out="-", contenders=["nginx", "direct", "nginx"]))]
    assert names == ["direct", "nginx"]
    assert {"proxy-w1-rr", "proxy-w4-ll", "vllm-router-rr", "vllm-router-p2"} <= set(KNOWN)
    with pytest.raises(ValueError, match="unknown contender"):
        chosen(RunConfig(out="-", contenders=["haproxy"]))


def test_the_default_run_is_issue_15s_set_on_both_backends() -> None:
    cfg = RunConfig(out="-")
    plans = {p.name: p for p in chosen(cfg)}
    assert list(plans) == ["direct", "proxy-w2-ll", "nginx", "vllm-router-p2", "relay-floor-w2"]
    assert (plans["relay-floor-w2"].kind, plans["relay-floor-w2"].workers) == ("floor", 2)
    assert (plans["proxy-w2-ll"].workers, plans["proxy-w2-ll"].strategy) == (2, "least_load")
    assert (plans["nginx"].workers, plans["nginx"].strategy) == (2, "least_conn")
    assert plans["vllm-router-p2"].strategy == "power_of_two"
    assert KNOWN["vllm-router-rr"].strategy == "round_robin"  # still there, by --contenders
    assert cfg.backends == ["sim", "starlette"]
    assert isinstance(instances_for("starlette", cfg), FakeInstances)
    assert isinstance(instances_for("sim", cfg), SimInstances)
    with pytest.raises(ValueError, match="unknown backend"):
        instances_for("vllm", cfg)


def test_stream_tally_counts_only_streams_that_reached_done() -> None:
    tally = stream_load.Tally(ok=3, status=1, socket=0, truncated=2, ttft_s=[0.001, 0.002, 0.003])
    result = stream_load.summarize(tally, 2.0)
    assert result["streams_per_s"] == 1.5 and result["errors"] == 3
    assert result["error_kinds"] == {"status": 1, "socket": 0, "truncated": 2}
    assert result["ttft_p50_ms"] == 2.0


# --- real processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def instances() -> Iterator[SimInstances]:
    with SimInstances([InstanceSpec(max_concurrency=64)] * 2) as sims:
        yield sims
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in sims.pids())


@needs_wrk
def test_wrk_counts_requests_and_non_2xx(instances: SimInstances, tmp_path: Path) -> None:
    ok = wrk_post_script(tmp_path / "ok.lua", measure.chat_body(4), "/v1/chat/completions")
    result = run_wrk(instances.urls[0], ok, 2, 1)
    assert result["requests"] > 0 and result["errors"] == 0, result
    assert [p for p, _ in result["percentiles_ms"]][:5] == [1, 5, 10, 25, 50]
    bad = wrk_post_script(tmp_path / "bad.lua", '{"not": "a chat"}', "/v1/chat/completions")
    result = run_wrk(instances.urls[0], bad, 1, 1)
    assert result["requests"] > 0 and result["error_kinds"]["status"] == result["requests"]


def test_proxy_contender_routes_over_the_shared_instances(instances: SimInstances) -> None:
    with ProxyContender("proxy-test", instances, workers=2, strategy="round_robin") as proxy:
        served = set()
        for _ in range(6):
            status, body = http_json("POST", f"{proxy.url}/v1/chat/completions", BODY)
            assert status == 200, body
            served.add(body["_cacheroute_meta"]["trace"]["instance_id"])
        assert served == set(instances.ids)  # both instances, registered by the contender
        tree = psutil.Process(proxy.pids()[0]).children(recursive=True)
        assert len(tree) >= 3 and proxy.rss_mb() > 50  # sidecar + 2 workers charged to it
        before = proxy.cpu_seconds_by_role()
        assert set(before) == {"launcher", "sidecar", "workers"}, before
        point = measure.stream_point(proxy, 4, 1.0, 3)
        split = point["cpu_s_by_role"]
        assert split["workers"] > 0 and split["sidecar"] > 0  # both do work per stream
        assert sum(split.values()) == pytest.approx(point["cpu_s"], abs=0.05)
        assert set(point["cpu_s_per_1k_by_role"]) == set(split)
        stream = stream_load.run_process(proxy.url, 4, 1.0, 3)
        assert stream["streams_ok"] > 0 and stream["errors"] == 0, stream
        shm = proxy.supervisor.shm_name
    assert proxy.pids() == [] and not os.path.exists(f"/dev/shm{shm}")
    assert not any(p.is_running() and p.status() != "zombie" for p in tree)


@needs_nginx
def test_nginx_contender_is_a_private_foreground_nginx(instances: SimInstances) -> None:
    with NginxContender("nginx-test", instances) as nginx:
        assert "least_conn;" in nginx.config_text() and "keepalive 64;" in nginx.config_text()
        for _ in range(4):
            assert http_json("POST", f"{nginx.url}/v1/chat/completions", BODY)[0] == 200
        master = psutil.Process(nginx.pids()[0])
        assert len(master.children()) == 2  # worker_processes 2
        stream = stream_load.run_process(nginx.url, 4, 1.0, 3)
        assert stream["streams_ok"] > 0 and stream["errors"] == 0, stream
    assert not master.is_running() or master.status() == "zombie"


def test_stream_client_flags_truncated_streams(tmp_path: Path) -> None:
    # An instance that cuts every stream after one chunk: nothing may count as ok.
    spec = InstanceSpec(extra_args=("--drop-after-chunks", "1"))
    with SimInstances([spec], log_dir=tmp_path) as sims:
        result = stream_load.run_process(DirectContender("d", sims).url, 2, 1.0, 3)
    assert result["streams_ok"] == 0 and result["errors"] > 0, result
    assert result["error_kinds"]["truncated"] + result["error_kinds"]["socket"] == result["errors"]


@pytest.mark.skipif(router_available() is not None, reason="vllm-router not installed")
def test_router_contender_routes_to_the_sim_instances(instances: SimInstances) -> None:
    with RouterContender("router-test", instances) as router:
        assert http_json("POST", f"{router.url}/v1/chat/completions", BODY)[0] == 200
        assert router.cpu_seconds() >= 0 and router.rss_mb() > 0


# --- the command line ------------------------------------------------------------------------------
def _bench_peers(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.peers", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, check=False)


def test_cli_refuses_an_unknown_contender_without_a_traceback() -> None:
    done = _bench_peers("--contenders", "haproxy", "--out", "/dev/null", timeout=60)
    assert done.returncode == 2 and "unknown contender" in done.stderr
    assert "Traceback" not in done.stderr


@needs_wrk
@needs_nginx
@pytest.mark.slow
@pytest.mark.parametrize("isolate,backend", [(False, "starlette"), (True, "sim")],
                         ids=["shared-starlette", "isolate-sim"])
def test_quick_run_writes_the_shared_schema(tmp_path: Path, isolate: bool, backend: str) -> None:
    out = tmp_path / "peers.json"
    done = _bench_peers("--quick", "--contenders", "nginx", "--backend", backend, "--out", str(out),
                        *(["--isolate"] if isolate else []), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"command", "started_at", "machine", "versions", "method", "backends",
            "notes"} <= set(data)
    assert list(data["backends"]) == [backend]
    result = data["backends"][backend]
    assert {"instances", "contenders", "ratios_to_nginx", "ratios_to_router", "targets",
            "repeat_ratios", "notes"} <= set(result)
    assert result["instances"] == {"kind": backend, "count": 2}
    # Without the proxy and the router, no target can be judged: none may pass.
    assert result["targets"] and all(t["passed"] is None for t in result["targets"])
    by_name = {c["name"]: c for c in result["contenders"]}
    assert set(by_name) == {"direct", "nginx"}
    nginx = by_name["nginx"]
    assert nginx["kind"] == "nginx" and nginx["workers"] == 2 and nginx["strategy"] == "least_conn"
    assert {r["scenario"] for r in nginx["runs"]} == {"c1", "c32", "stream32", "stream256"}
    assert all(r["repeat"] == 0 for r in nginx["runs"])
    m = nginx["median"]
    assert m["rps_c32"] > 0 and m["streams_per_s_c32"] > 0 and m["added_p50_ms"] is not None
    assert m["cpu_s_per_1k_req"] > 0 and m["rss_mb"] > 0 and nginx["errors"] == 0
    assert result["ratios_to_nginx"]["nginx"]["rps_c32"] == 1.0
    # direct: its own c1 point plus the baseline measured right before nginx's
    assert sum(r["scenario"] == "c1" for r in by_name["direct"]["runs"]) == 2
    stream = next(r for r in nginx["runs"] if r["scenario"] == "stream32")
    assert stream["ttft_samples_ms"] and stream["ttft_p50_ms"] > 0
    long = next(r for r in nginx["runs"] if r["scenario"] == "stream256")
    assert long["tokens"] == long["streams_ok"] * 256 > 0 and long["cpu_s_per_1m_tokens"] > 0
    assert all(r["cpu_s"] > 0 and r["rss_mb"] > 0 for r in nginx["runs"])  # charged to nginx
    assert "| nginx |" in done.stdout and f"## backend: {backend}" in done.stdout


def test_relay_floor_relays_answers_and_streams_in_turn_from_two_processes(
        instances: SimInstances) -> None:
    for i in range(len(instances.urls)):
        instances.reset_stats(i)
    with RelayFloorContender("floor-test", instances) as floor:
        for _ in range(6):
            status, body = http_json("POST", f"{floor.url}/v1/chat/completions", BODY)
            assert status == 200 and body["object"] == "chat.completion", body
            assert "_cacheroute_meta" not in body  # nothing of the product between the two
        served = [instances.stats(i)["completed"] for i in range(2)]
        assert sum(served) == 6 and min(served) > 0, served  # each process takes them in turn
        stream = stream_load.run_process(floor.url, 4, 1.0, 3)
        assert stream["streams_ok"] > 0 and stream["errors"] == 0, stream
        root = psutil.Process(floor.pids()[0])
        relays = root.children()
        assert len(relays) == 2 and floor.cpu_seconds() > 0  # both charged to the contender
    assert floor.pids() == []
    assert not any(p.is_running() and p.status() != "zombie" for p in relays)


def test_contenders_route_over_the_starlette_fake(tmp_path: Path) -> None:
    with FakeInstances([InstanceSpec(max_concurrency=64)] * 2, log_dir=tmp_path) as fakes:
        with ProxyContender("proxy-fake", fakes, workers=1, strategy="least_load") as proxy:
            served = set()
            for _ in range(6):
                status, body = http_json("POST", f"{proxy.url}/v1/chat/completions", BODY)
                assert status == 200 and body["object"] == "chat.completion", body
                served.add(body["_cacheroute_meta"]["trace"]["instance_id"])
            assert served == set(fakes.ids)
            stream = stream_load.run_process(proxy.url, 4, 1.0, 3)
            assert stream["streams_ok"] > 0 and stream["errors"] == 0, stream
        if shutil.which("nginx"):
            with NginxContender("nginx-fake", fakes) as nginx:
                assert http_json("POST", f"{nginx.url}/v1/chat/completions", BODY)[0] == 200
        if router_available() is None:
            with RouterContender("router-fake", fakes, policy="power_of_two") as router:
                assert http_json("POST", f"{router.url}/v1/chat/completions", BODY)[0] == 200


def test_sim_instance_answers_the_vllm_health_probe(instances: SimInstances) -> None:
    # vllm-router waits for GET /health on every worker before it routes anything.
    assert http_json("GET", f"{instances.urls[0]}/health")[0] == 200
