"""The resource and topology plane through a real cluster (launcher, sidecar, workers):
resource snapshots, `/debug/instance_resources`, list rows with `resource` and `health`,
topology report and merge, `pool_resource` from real snapshots, the routes every worker
answers by asking the sidecar, and the heartbeat's `healthy` flag."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

import aiohttp
import msgspec

from cacheroute_proxy import instance_wire as wire
from cacheroute_proxy.auth import TokenGuard
from cacheroute_proxy.config import Settings
from proxy_workers.sidecar_reads import sidecar_read
from starlette.applications import Starlette
from starlette.routing import Route
from tests.aio import OpenStream
from tests.harness import Agent, Engine, Process, chat_body, free_port, get, http, listed, post, wait_until

TOKEN = "resource-plane-token"
# What `/v1/instance/list` rows had before this plane: a client of them must keep finding these.
LIST_KEYS = {"instance_id", "host", "port", "endpoints", "tags", "weight", "meta", "capabilities",
             "capability_fingerprint", "registered_at", "last_seen_at", "load", "slot",
             "slot_generation", "is_alive"}


def agent_snapshot(cpu: float, admission: str = "accepting", **extra: Any) -> dict[str, Any]:
    """A request body as an agent encodes it with the product's own types."""
    snapshot = wire.ResourceSnapshotV1(
        timestamp_ms=1_000, devices=wire.Devices(
            cpu=wire.CpuReading(utilization_pct=cpu),
            memory=wire.MemoryReading(used_mb=500, total_mb=1000, free_mb=500),
            gpu=[wire.GpuReading(utilization_pct_avg=60, memory_used_mb=10, memory_total_mb=100)],
            network=[wire.NetworkReading(iface="eth0", rx_mbps=1.5, tx_mbps=2.5)]),
        capacity_hint=wire.CapacityHint(memory_free_ratio=0.5, admission_state=admission))
    body = msgspec.to_builtins(wire.resource_snapshot_request(
        extra.pop("instance_id", "r1"), snapshot, wire.ReportMetadata(reported_instance_id="r1")))
    body["snapshot"].update(extra)
    return body


def register(cp_url: str, instance_id: str, port: int, headers: dict[str, str] | None = None) -> None:
    post(f"{cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": port, "instance_id": instance_id},
         headers=headers)


def rows(cp_url: str, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    return {r["instance_id"]: r for r in get(f"{cp_url}/v1/instance/list?include_dead=true", headers=headers)}


# --- resource snapshots ------------------------------------------------------------------------------
def test_resource_snapshots_feed_the_list_the_debug_route_and_pool_resource(make_cluster):
    cluster = make_cluster(workers=1, env={"PROXY_INSTANCE_TTL_S": "2", "PROXY_INSTANCE_PURGE_GRACE_S": "600"})
    cp = cluster.cp_url
    register(cp, "r1", 9501)
    register(cp, "r2", 9502)
    assert rows(cp)["r1"]["resource"] is None  # nothing reported yet

    url = f"{cp}/v1/instance/resource_snapshot"
    body = agent_snapshot(25.0, agent_note="kept as sent")
    assert post(url, body) == {"ok": True}
    row = rows(cp)["r1"]
    assert LIST_KEYS <= set(row) and row["health"] == "healthy" and row["static"] is False
    assert row["resource"]["cpu_util"] == 25.0 and row["resource"]["gpu_util_avg"] == 60.0
    assert row["resource"]["network_tx_mbps"] == 2.5 and row["resource"]["reported_instance_id"] == "r1"
    assert row["resource"]["raw_resource"] == body["snapshot"]

    shown = {r["instance_id"]: r for r in get(f"{cp}/debug/instance_resources")["instances"]}
    assert set(shown["r1"]) == {"instance_id", "host", "port", "last_seen_at", "resource"}
    assert "raw_resource" not in shown["r1"]["resource"] and shown["r1"]["resource"]["cpu_util"] == 25.0
    assert shown["r2"]["resource"] is None

    # Refused bodies change nothing.
    assert post(url, agent_snapshot(1.0, instance_id="ghost")) == {"ok": False, "error": "unknown_instance"}
    status, reply, _ = http("POST", url, {"instance_id": "r1", "snapshot": [1, 2]})
    assert (status, reply["error"]) == (422, "invalid_payload") and "$.snapshot" in reply["detail"]
    status, reply, _ = http("POST", url, agent_snapshot(1.0, padding="x" * (70 * 1024)))
    assert status == 413 and "snapshot" in reply["detail"], reply
    status, _, _ = http("POST", url, raw=msgspec.json.encode(agent_snapshot(1.0)),
                        headers={"Content-Type": "text/plain"})
    assert status == 415
    assert rows(cp)["r1"]["resource"]["cpu_util"] == 25.0

    # pool_resource and its sources from the stored snapshots.
    post(url, agent_snapshot(75.0, admission="degraded", instance_id="r2"))
    pool = get(f"{cp}/debug/pool_resource")["pool_resource"]
    assert pool["instances"]["with_resource"] == 2 and pool["instances"]["degraded"] == 1
    assert pool["utilization"]["cpu_avg"] == 50.0 and pool["utilization"]["cpu_max"] == 75.0
    assert pool["utilization"]["memory_used_ratio"] == 0.5 and pool["pool_admission_state"] == "degraded"
    sources = get(f"{cp}/debug/pool_resource_sources")
    assert set(sources) == {"ok", "metric_source", "metric_quality", "null_semantics"}
    assert sources["metric_source"]["utilization"] == "instance_resource_snapshot"
    assert sources["metric_quality"]["resource"] == "complete"
    assert sources["null_semantics"] == "0 means measured zero; null means unavailable, not wired, or unknown"

    # A snapshot is a sign of life: an expired instance is back with its next one.
    wait_until(lambda: rows(cp)["r1"]["health"] == "expired", 15, message="r1 expired (TTL 2 s)")
    assert post(url, agent_snapshot(5.0)) == {"ok": True}
    assert rows(cp)["r1"]["health"] == "healthy" and rows(cp)["r1"]["is_alive"] is True


# --- topology -------------------------------------------------------------------------------------------
def test_topology_reports_merge_per_kdn_key_and_leave_with_their_instance(make_cluster):
    cluster = make_cluster(workers=1)
    cp = cluster.cp_url
    report = f"{cp}/v1/topology/report"
    assert get(f"{cp}/v1/topology/kdn_links") == {"kdn_links": {}}
    assert post(report, {"instance_id": "nobody", "links": {"k": {}}}) == {"ok": False, "error": "unknown_instance"}
    register(cp, "a", 9601)
    register(cp, "b", 9602)
    assert post(report, {"instance_id": "a", "links": {
        "kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 3, "iface": "eth0", "measured_by": "a"},
        "kdn://127.0.0.1:9101": {"bandwidth_mbps": 1000, "latency_ms": 3}, "bogus": "not an object"}}) == \
        {"ok": True, "merged_links": 2}
    assert post(report, {"instance_id": "b", "links": {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 1}}}) == \
        {"ok": True, "merged_links": 1}
    merged = get(f"{cp}/v1/topology/kdn_links")["kdn_links"]
    assert merged == {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 1, "reported_by": "b"},
                      "kdn://127.0.0.1:9101": {"bandwidth_mbps": 1000, "latency_ms": 3, "reported_by": "a"}}
    both = get(f"{cp}/v1/topology/kdn_links?per_instance=true")
    assert both["kdn_links"] == merged and set(both["per_instance"]) == {"a", "b"}
    assert both["per_instance"]["a"]["kdn-1"]["latency_ms"] == 3 and "bogus" not in both["per_instance"]["a"]
    assert cluster.status()["topology_kdn_links"] == 2

    status, reply, _ = http("POST", report, {"instance_id": "a", "links": ["kdn-1"]})
    assert (status, reply["error"]) == (422, "invalid_payload") and "$.links" in reply["detail"]
    assert post(f"{cp}/v1/instance/unregister", {"instance_id": "b"}) == {"ok": True}
    merged = get(f"{cp}/v1/topology/kdn_links")["kdn_links"]
    assert merged["kdn-1"]["reported_by"] == "a" and merged["kdn-1"]["latency_ms"] == 3
    assert post(report, {"instance_id": "a", "links": {}}) == {"ok": True, "merged_links": 0}
    assert get(f"{cp}/v1/topology/kdn_links") == {"kdn_links": {}}
    assert cluster.status()["topology_kdn_links"] == 0


# --- the same answer from every worker ----------------------------------------------------------------
SIDECAR_ROUTES = ("/debug/instance_resources", "/debug/instance_resources?include_dead=false",
                  "/debug/pool_resource", "/debug/pool_resource_sources", "/v1/topology/kdn_links",
                  "/v1/topology/kdn_links?per_instance=true")


def _comparable(path: str, answer: Any) -> Any:
    if path.startswith("/debug/pool_resource") and "pool_resource" in answer:
        pool = dict(answer["pool_resource"])
        pool.pop("generated_at")  # computed at each call
        pool.pop("resource_freshness_s")  # ages with the clock
        return pool
    return answer


def test_every_worker_answers_the_sidecars_routes_as_the_sidecar_does(make_cluster, tmp_path):
    token_file = tmp_path / "cp.token"
    token_file.write_text(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cluster = make_cluster(workers=3, env={"PROXY_CP_TOKEN_FILE": str(token_file),
                                           "PROXY_DEBUG_REQUIRES_TOKEN": "1"})
    cp = cluster.cp_url
    for iid, port in (("r1", 9701), ("r2", 9702)):
        register(cp, iid, port, headers=auth)
        post(f"{cp}/v1/instance/resource_snapshot", agent_snapshot(10.0, instance_id=iid), headers=auth)
    post(f"{cp}/v1/topology/report", {"instance_id": "r1", "links": {"kdn-1": {"bandwidth_mbps": 10}}},
         headers=auth)
    for path in SIDECAR_ROUTES:
        expected = _comparable(path, get(f"{cp}{path}", headers=auth))
        for worker in range(cluster.workers):
            status, answer, headers = http("GET", f"{cluster.worker_url(worker)}{path}", headers=auth)
            assert status == 200 and headers["x-cacheroute-worker"].startswith(f"w{worker}-"), (path, answer)
            assert _comparable(path, answer) == expected, (worker, path)
        # The worker asks with the caller's token; without one it is refused like the sidecar does.
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, answer, _ = http("GET", f"{cluster.worker_url(0)}{path}", headers=headers)
            assert (status, answer["error"]) == (401, "unauthorized"), (path, headers)
    assert get(f"{cluster.dp_url}/v1/topology/kdn_links", headers=auth)["kdn_links"]["kdn-1"]["reported_by"] == "r1"


def _call(app: Starlette, path: str) -> tuple[int, dict[str, Any]]:
    """One GET through an ASGI app, without a server."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "root_path": "", "app": app}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], msgspec.json.decode(body)


def test_a_worker_says_502_or_504_when_the_sidecar_does_not_answer():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog, and nothing ever answers
    try:
        for port, status, code in ((free_port(), 502, "sidecar_unreachable"),
                                   (silent.getsockname()[1], 504, "sidecar_timeout")):
            settings = Settings(cp_port=port)
            app = Starlette(routes=[Route("/debug/pool_resource", sidecar_read(settings, TokenGuard(None), 0.5))])
            got_status, body = _call(app, "/debug/pool_resource")
            assert (got_status, body["error"]) == (status, code), body
            assert f"127.0.0.1:{port}" in body["detail"]
    finally:
        silent.close()


# --- fast health: the heartbeat's `healthy` -----------------------------------------------------------------
def test_healthy_false_takes_an_instance_out_at_once_and_true_brings_it_back(make_cluster):
    cluster = make_cluster(workers=2)
    # Its own heartbeats would say "healthy"; this test speaks for it instead.
    held = cluster.add_instance("--hold-streams", "--heartbeat-interval", "300")
    other = cluster.add_instance()
    heartbeat = f"{cluster.cp_url}/v1/instance/heartbeat"

    def loads_rows(worker: int | None) -> dict[str, dict[str, Any]]:
        return {r["instance_id"]: r for r in cluster.loads(worker)["instances"]}

    def served_by(n: int) -> set[str]:
        seen = set()
        for _ in range(n):
            status, _, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
            assert status == 200
            seen.add(headers["x-cacheroute-instance"])
        return seen

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = []
            while len([s for s in streams if s.response.headers.get("x-cacheroute-instance") == held.instance_id]) < 2:
                streams.append(await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body()))
                assert len(streams) < 20, "round robin never reached the held instance"
            on_held = sum(s.response.headers.get("x-cacheroute-instance") == held.instance_id for s in streams)
            generation = loads_rows(None)[held.instance_id]["slot_generation"]

            assert post(heartbeat, {"instance_id": held.instance_id, "healthy": False}) == {"ok": True}
            for worker in (None, *range(cluster.workers)):
                row = loads_rows(worker)[held.instance_id]
                assert (row["health"], row["is_alive"]) == ("unhealthy", False), (worker, row)
                assert row["inflight"] == on_held and row["slot_generation"] == generation, (worker, row)
            listed = rows(cluster.cp_url)[held.instance_id]
            assert (listed["health"], listed["is_alive"], listed["slot_generation"]) == ("unhealthy", False, generation)
            assert held.instance_id not in {r["instance_id"] for r in get(f"{cluster.cp_url}/v1/instance/list")}
            assert served_by(6) == {other.instance_id}

            assert post(heartbeat, {"instance_id": held.instance_id}) == {"ok": True}  # healthy absent
            for worker in (None, *range(cluster.workers)):
                assert loads_rows(worker)[held.instance_id]["health"] == "healthy"
            assert loads_rows(None)[held.instance_id]["slot_generation"] == generation
            held.release()
            for stream in streams:
                assert (await stream.finish()).endswith(b"data: [DONE]\n\n")

    asyncio.run(scenario())
    assert held.instance_id in served_by(6)
    wait_until(lambda: all(cluster.inflight(w)[held.instance_id] == 0 for w in (None, *range(cluster.workers))),
               10, message="inflight back to 0 everywhere")
    assert "is unhealthy: its heartbeat says healthy: false" in cluster.launcher_log()


# --- the instance agent as this plane's client ------------------------------------------------------------
def test_the_agents_reports_and_health_land_in_the_plane(make_cluster, tmp_path):
    cluster = make_cluster(workers=2)
    kdn_port = free_port()
    kdn = Process(["-m", "cacheroute_sim.kdn", "--host", "127.0.0.1", "--port", str(kdn_port)], {},
                  tmp_path / "kdn.log")
    engine = Engine(tmp_path).start()
    agent = Agent(cluster, engine, "--kdn-targets", f"127.0.0.1:{kdn_port}", "--resource-interval", "0.5")
    iid = agent.instance_id
    try:
        wait_until(lambda: (listed(cluster, iid) or {}).get("resource"), 30, message=f"a snapshot\n{agent.log()}")
        resource = {r["instance_id"]: r for r in get(f"{cluster.cp_url}/debug/instance_resources")["instances"]}[iid]
        assert resource["resource"]["cpu_util"] is not None and resource["resource"]["memory_total_mb"] > 0
        assert resource["resource"]["reported_instance_id"] == iid
        assert get(f"{cluster.worker_url(1)}/debug/pool_resource")["pool_resource"]["instances"]["with_resource"] == 1
        links = wait_until(lambda: get(f"{cluster.cp_url}/v1/topology/kdn_links")["kdn_links"], 30,
                           message=f"the agent's links\n{agent.log()}")
        assert links[f"kdn://127.0.0.1:{kdn_port}"]["reported_by"] == iid
        assert cluster.status()["topology_kdn_links"] == len(links) >= 1

        engine.stop()  # the agent says so in its next heartbeat: out at once, still registered
        wait_until(lambda: (listed(cluster, iid) or {}).get("health") == "unhealthy", 15,
                   message=f"the agent's healthy: false\n{agent.log()}")
        assert get(f"{cluster.worker_url(0)}/v1/topology/kdn_links")["kdn_links"] == links  # not purged
        engine.start()
        wait_until(lambda: (listed(cluster, iid) or {}).get("health") == "healthy", 30,
                   message=f"healthy again\n{agent.log()}")
    finally:
        agent.process.stop(signal.SIGTERM)
        engine.stop()
        kdn.stop()
    assert listed(cluster, iid) is None, agent.log()
    assert get(f"{cluster.cp_url}/v1/topology/kdn_links")["kdn_links"] == {}  # its links left with it
