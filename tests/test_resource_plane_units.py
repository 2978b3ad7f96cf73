"""The sidecar's resource and topology plane in units: how a resource snapshot is normalised
(every odd value the original Proxy handled), the topology merge rule, health transitions in
the registry (on a real segment), pool_resource from real snapshots, and
PROXY_STATIC_INSTANCES parsing."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from cacheroute_proxy import instance_wire as wire
from cacheroute_proxy.config import ConfigError, Settings
from cacheroute_proxy.routing.load_view import LoadView
from sidecar import pool_resource
from sidecar.registry import InstanceRegistry
from sidecar.resource_snapshot import InstanceResource, normalise, number
from sidecar.topology import Topology, is_better
from shm_schema import read_all
from tests.shm_helpers import fresh_segment

NO_METADATA = wire.ReportMetadata()


def resource(snapshot: dict[str, Any], metadata: wire.ReportMetadata = NO_METADATA) -> InstanceResource:
    return normalise(snapshot, metadata, reported_at=1000.0)


def gpus(*entries: Any, timestamp_ms: int | None = None) -> InstanceResource:
    snapshot: dict[str, Any] = {"devices": {"gpu": list(entries)}}
    if timestamp_ms is not None:
        snapshot["timestamp_ms"] = timestamp_ms
    return resource(snapshot)


# --- normalisation ------------------------------------------------------------------------------
def test_a_full_agent_snapshot_is_normalised_and_kept_raw() -> None:
    snapshot = msgspec.to_builtins(wire.ResourceSnapshotV1(
        timestamp_ms=5_000, agent_version="0.1.0", instance_id="a",
        devices=wire.Devices(
            cpu=wire.CpuReading(utilization_pct=12.5, load1=0.5),
            memory=wire.MemoryReading(used_mb=1000, total_mb=4000, free_mb=3000),
            gpu=[wire.GpuReading(index=0, utilization_pct_avg=40, utilization_pct_current=50,
                                 utilization_pct_max=70, utilization_sample_count=5,
                                 utilization_window_ms=2000, utilization_sample_ok=True,
                                 utilization_source="nvml", utilization_sample_timestamp_ms=4_900,
                                 memory_used_mb=100, memory_total_mb=24000),
                 wire.GpuReading(index=1, utilization_pct_avg=60, utilization_pct_current=30,
                                 utilization_pct_max=90, utilization_sample_count=3,
                                 utilization_window_ms=1000, utilization_sample_ok=True,
                                 utilization_sample_timestamp_ms=4_800,
                                 memory_used_mb=300, memory_total_mb=24000)],
            network=[wire.NetworkReading(iface="eth0", rx_mbps=10, tx_mbps=20, speed_mbps=10000),
                     wire.NetworkReading(iface="eth1", rx_mbps=99, tx_mbps=99)]),
        capacity_hint=wire.CapacityHint(memory_free_ratio=0.75, admission_state="accepting")))
    metadata = wire.ReportMetadata(reported_instance_id="a", report_monotonic_ms=123.9,
                                   report_wall_time_ms=5_010, agent_snapshot_timestamp_ms=5_000)
    got = msgspec.to_builtins(resource(snapshot, metadata))
    assert got == {
        "cpu_util": 12.5, "memory_used_mb": 1000.0, "memory_total_mb": 4000.0, "memory_free_mb": 3000.0,
        "memory_free_ratio": 0.75, "gpu_util_avg": 50.0, "gpu_util_current": 40.0, "gpu_util_max": 90.0,
        "gpu_sample_count": 8, "gpu_sample_age_ms": 100, "gpu_sample_source": "nvml",
        "gpu_sample_quality": "ok", "gpu_sample_window_ms": 2000, "gpu_mem_used_mb": 400.0,
        "gpu_mem_total_mb": 48000.0, "network_rx_mbps": 10.0, "network_tx_mbps": 20.0,
        "admission_state": "accepting", "resource_ts_ms": 5_000, "resource_reported_at": 1000.0,
        "resource_report_monotonic_ms": 123, "resource_report_wall_time_ms": 5_010,
        "reported_instance_id": "a", "raw_resource": snapshot,
    }


@pytest.mark.parametrize("value, expected", [
    (None, None), ("N/A", None), (" [N/A] ", None), ("[Not Supported]", None), ("not supported", None),
    ("", None), ("  ", None), ("nan", None), ("NaN", None), ("inf", None), ("-Infinity", None),
    (float("nan"), None), (float("inf"), None), (True, None), (False, None), ([1], None), ({"v": 1}, None),
    ("abc", None), (0, 0.0), ("0", 0.0), (" 42.5 ", 42.5), (7, 7.0), (-3.25, -3.25),
])
def test_a_reading_is_a_finite_number_or_null(value: Any, expected: float | None) -> None:
    assert number(value) == expected
    assert resource({"devices": {"cpu": {"utilization_pct": value}}}).cpu_util == expected


def test_nothing_known_is_all_null_never_zero() -> None:
    empty = resource({})
    assert all(value is None for name, value in msgspec.structs.asdict(empty).items()
               if name not in ("raw_resource", "resource_reported_at"))
    assert empty.raw_resource == {} and empty.resource_reported_at == 1000.0


@pytest.mark.parametrize("snapshot", [
    {"devices": "cpu"}, {"devices": None}, {"devices": {"cpu": [1], "memory": "x", "gpu": {"a": 1},
                                                        "network": "eth0"}},
    {"devices": {"gpu": [1, "x", None], "network": [1, {"rx_mbps": 5}]}},
    {"capacity_hint": ["accepting"], "timestamp_ms": "soon"},
])
def test_a_snapshot_of_the_wrong_shape_gives_nulls_not_errors(snapshot: dict[str, Any]) -> None:
    got = resource(snapshot)
    assert (got.cpu_util, got.memory_used_mb, got.gpu_util_avg, got.gpu_mem_used_mb,
            got.network_rx_mbps, got.admission_state, got.resource_ts_ms) == (None,) * 7
    assert got.raw_resource == snapshot


def test_gpu_utilization_comes_from_the_first_parseable_key() -> None:
    assert gpus({"utilization_pct_avg": 10, "utilization_pct": 99}).gpu_util_avg == 10
    assert gpus({"utilization_pct_avg": "N/A", "utilization_pct": 20}).gpu_util_avg == 20
    assert gpus({"utilization_gpu_pct": 30, "gpu_util": 99}).gpu_util_avg == 30
    assert gpus({"gpu_util": "40", "util": 99}).gpu_util_avg == 40
    assert gpus({"util": 50}).gpu_util_avg == 50
    assert gpus({"utilization_current": 1, "gpu_util_current": 2}).gpu_util_current == 1
    assert gpus({"gpu_util_current": 2}).gpu_util_current == 2
    assert gpus({"utilization_pct_max": "nan", "gpu_util_max": 3}).gpu_util_max == 3
    assert gpus({"temperature_c": 70}).gpu_util_avg is None


@pytest.mark.parametrize("marks", [
    {"utilization_sample_ok": False}, {"utilization_sample_quality": "invalid"},
    {"utilization_sample_quality": "FAILED"}, {"utilization_sample_quality": "error"},
    {"utilization_sample_quality": "command_error"}, {"gpu_sample_quality": "parse_error"},
    {"utilization_sample_quality": " Unsupported "},
])
def test_a_gpu_whose_sample_is_not_ok_is_left_out_of_the_utilization(marks: dict[str, Any]) -> None:
    bad = {"utilization_pct_avg": 0, "utilization_pct_current": 0, "utilization_pct_max": 100,
           "memory_used_mb": 500, **marks}
    good = {"utilization_pct_avg": 80, "utilization_pct_current": 60, "utilization_pct_max": 90,
            "memory_used_mb": 100}
    got = gpus(bad, good)
    assert (got.gpu_util_avg, got.gpu_util_current, got.gpu_util_max) == (80, 60, 90)
    assert got.gpu_mem_used_mb == 600  # memory is still the machine's
    alone = gpus(bad)
    assert (alone.gpu_util_avg, alone.gpu_util_max) == (None, None)
    stated = marks.get("utilization_sample_quality")
    assert alone.gpu_sample_quality == (stated if stated is not None else None)


def test_gpu_sample_bookkeeping() -> None:
    got = gpus({"gpu_sample_count": "4", "gpu_sample_window_ms": 500, "gpu_sample_source": " dcgm ",
                "utilization_sample_timestamp_ms": 900, "utilization_sample_ok": True},
               {"utilization_sample_count": 2, "utilization_window_ms": 1500, "source": "smi",
                "utilization_sample_timestamp_ms": 950},
               timestamp_ms=1_000)
    assert (got.gpu_sample_count, got.gpu_sample_window_ms, got.gpu_sample_source) == (6, 1500, "dcgm")
    assert got.gpu_sample_age_ms == 50  # from the newest sample
    assert got.gpu_sample_quality == "ok"  # the first stated quality, no utilization known
    assert gpus({"utilization_sample_timestamp_ms": 2_000}, timestamp_ms=1_000).gpu_sample_age_ms == 0
    assert gpus({"utilization_sample_timestamp_ms": 2_000}).gpu_sample_age_ms is None


def test_gpu_memory_sums_what_is_known_and_is_null_when_nothing_is() -> None:
    got = gpus({"memory_used_mb": 100, "memory_total_mb": "N/A"}, {"memory_used_mb": 50})
    assert (got.gpu_mem_used_mb, got.gpu_mem_total_mb) == (150, None)
    assert gpus().gpu_mem_used_mb is None
    assert gpus({"memory_used_mb": 0}).gpu_mem_used_mb == 0  # a measured zero


def test_network_is_the_first_interface_only() -> None:
    got = resource({"devices": {"network": [{"rx_mbps": "N/A", "tx_mbps": 3}, {"rx_mbps": 9}]}})
    assert (got.network_rx_mbps, got.network_tx_mbps) == (None, 3)
    assert resource({"devices": {"network": []}}).network_rx_mbps is None


def test_admission_state_and_metadata_are_kept_as_given() -> None:
    got = resource({"capacity_hint": {"admission_state": "Degraded", "memory_free_ratio": "0.5"}},
                   wire.ReportMetadata(report_wall_time_ms=12.7))
    assert (got.admission_state, got.memory_free_ratio, got.resource_report_wall_time_ms) == ("Degraded", 0.5, 12)


def test_the_metadata_and_the_snapshot_are_validated_on_decode() -> None:
    body = b'{"instance_id":"a","snapshot":{"x":1},"metadata":{"reported_instance_id":"a","extra":1}}'
    req = msgspec.json.decode(body, type=wire.ResourceSnapshotRequest)
    assert req.metadata.reported_instance_id == "a" and req.snapshot == {"x": 1}
    for bad, field in ((b'{"instance_id":"a","snapshot":[1]}', "$.snapshot"),
                       (b'{"instance_id":"a"}', "snapshot"),
                       (b'{"instance_id":"a","snapshot":{},"metadata":{"report_wall_time_ms":"x"}}',
                        "$.metadata.report_wall_time_ms")):
        with pytest.raises(msgspec.ValidationError, match=field.replace("$", r"\$")):
            msgspec.json.decode(bad, type=wire.ResourceSnapshotRequest)


# --- the topology merge rule ----------------------------------------------------------------------
def test_higher_bandwidth_wins_then_lower_latency() -> None:
    assert is_better({"bandwidth_mbps": 2000, "latency_ms": 9}, {"bandwidth_mbps": 1000, "latency_ms": 1})
    assert not is_better({"bandwidth_mbps": 1000, "latency_ms": 9}, {"bandwidth_mbps": 1000, "latency_ms": 1})
    assert is_better({"bandwidth_mbps": 1000, "latency_ms": 0}, {"bandwidth_mbps": 1000, "latency_ms": 1})
    assert is_better({"bandwidth_mbps": 1}, {})  # missing bandwidth counts as 0
    assert is_better({"latency_ms": 5}, {})  # missing latency counts as 1e9
    assert not is_better({}, {})  # a full tie keeps the link already chosen
    assert not is_better({"bandwidth_mbps": "N/A"}, {"bandwidth_mbps": 0})


def test_each_report_replaces_its_own_links_and_the_merge_keeps_the_best() -> None:
    topo = Topology()
    assert topo.report("a", {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 2},
                             "kdn-2": {"bandwidth_mbps": 100}, "junk": 5, "also": [1]}) == 2
    assert topo.report("b", {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 1}}) == 1
    merged = topo.merged()
    assert merged == {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 1, "reported_by": "b"},
                      "kdn-2": {"bandwidth_mbps": 100, "reported_by": "a"}}
    assert topo.per_instance()["a"]["kdn-1"] == {"bandwidth_mbps": 1000, "latency_ms": 2}  # untagged
    version = topo.version
    topo.report("a", {"kdn-1": {"bandwidth_mbps": 1000, "latency_ms": 2}, "kdn-2": {"bandwidth_mbps": 100}})
    assert topo.version == version  # the same map again changes nothing
    topo.report("a", {"kdn-3": {"bandwidth_mbps": 5}})  # replaces a's map: kdn-2 is gone
    assert set(topo.merged()) == {"kdn-1", "kdn-3"} and topo.version == version + 1
    topo.forget("b")  # the next best takes over, or the key goes
    assert topo.merged() == {"kdn-3": {"bandwidth_mbps": 5, "reported_by": "a"}}
    topo.forget("a")
    topo.forget("nobody")
    assert topo.merged() == {} and topo.per_instance() == {}
    merged = topo.merged()
    merged["x"] = {}  # a copy: callers cannot change the store
    assert topo.merged() == {}


# --- health in the registry --------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _registry(seg: Any, clock: Clock) -> InstanceRegistry:
    return InstanceRegistry(seg, ttl_s=10, purge_grace_s=5, clock=clock)


def _slot(seg: Any, instance_id: str) -> Any:
    return {s.instance_id: s for s in read_all(seg)}[instance_id]


def test_healthy_false_takes_it_out_without_purge_and_healthy_true_brings_it_back(caplog) -> None:
    clock = Clock()
    with fresh_segment() as seg:
        registry = _registry(seg, clock)
        record = registry.register(wire.RegisterRequest(host="127.0.0.1", port=9001, instance_id="a"))
        generation = record.generation
        caplog.set_level(logging.INFO, "cacheroute.sidecar.registry")
        for _ in range(2):
            assert registry.heartbeat(wire.HeartbeatRequest("a", healthy=False)) == {"ok": True}
        assert (record.health, _slot(seg, "a").alive, _slot(seg, "a").unhealthy) == ("unhealthy", False, True)
        for _ in range(5):  # heartbeats go on for longer than TTL + grace: still registered
            clock.now += 4
            registry.heartbeat(wire.HeartbeatRequest("a", healthy=False))
            registry.sweep()
        assert registry.get("a") is record and record.health == "unhealthy"
        assert _slot(seg, "a").generation == generation
        # A snapshot refreshes liveness but does not overrule the instance's own word.
        assert registry.report_resource(wire.ResourceSnapshotRequest("a", {"cpu": 1}))
        assert record.health == "unhealthy" and record.resource is not None
        registry.heartbeat(wire.HeartbeatRequest("a"))  # healthy absent: back
        assert (record.health, _slot(seg, "a").alive, _slot(seg, "a").unhealthy) == ("healthy", True, False)
        registry.heartbeat(wire.HeartbeatRequest("a", healthy=False))
        registry.heartbeat(wire.HeartbeatRequest("a", healthy=True))
        assert record.health == "healthy" and _slot(seg, "a").generation == generation
        said = [r.getMessage() for r in caplog.records]
        assert sum("is unhealthy" in line for line in said) == 2  # once per transition
        assert sum("healthy again" in line for line in said) == 2


def test_an_unhealthy_instance_that_goes_silent_expires_and_is_purged() -> None:
    clock = Clock()
    with fresh_segment() as seg:
        registry = _registry(seg, clock)
        registry.register(wire.RegisterRequest(host="127.0.0.1", port=9001, instance_id="a"))
        registry.heartbeat(wire.HeartbeatRequest("a", healthy=False))
        clock.now += 11
        registry.sweep()
        assert registry.get("a").health == "expired" and not _slot(seg, "a").unhealthy
        # A snapshot is a sign of life: an expired instance comes back with it.
        registry.report_resource(wire.ResourceSnapshotRequest("a", {}))
        assert registry.get("a").health == "healthy"
        clock.now += 11
        registry.sweep()
        clock.now += 6
        registry.sweep()
        assert registry.get("a") is None and read_all(seg) == ()


def test_a_resource_snapshot_for_an_unknown_instance_changes_nothing() -> None:
    with fresh_segment() as seg:
        registry = _registry(seg, Clock())
        assert registry.report_resource(wire.ResourceSnapshotRequest("ghost", {"x": 1})) is False
        assert registry.records() == []


def test_static_instances_are_never_expired_or_purged_and_follow_their_probe() -> None:
    clock = Clock()
    with fresh_segment() as seg:
        registry = _registry(seg, clock)
        record = registry.register(wire.RegisterRequest(host="127.0.0.1", port=8000, instance_id="s"),
                                   healthy=False, static=True)
        assert (record.health, _slot(seg, "s").alive, _slot(seg, "s").unhealthy) == ("unhealthy", False, True)
        registry.probe_result("s", True)
        assert record.health == "healthy" and _slot(seg, "s").alive
        clock.now += 100
        registry.sweep()
        assert record.health == "healthy"  # no TTL for what is probed
        registry.probe_result("s", False, "connection refused")
        clock.now += 100
        registry.sweep()
        assert registry.get("s") is record and record.health == "unhealthy"
        registry.register(wire.RegisterRequest(host="127.0.0.1", port=8000, instance_id="s"))
        assert record.static  # an upsert does not make it an ordinary instance


def test_removing_an_instance_calls_the_hooks() -> None:
    clock = Clock()
    with fresh_segment() as seg:
        registry = _registry(seg, clock)
        gone: list[str] = []
        registry.on_removed.append(gone.append)
        for port, iid in ((9001, "a"), (9002, "b")):
            registry.register(wire.RegisterRequest(host="127.0.0.1", port=port, instance_id=iid))
        registry.unregister("a")
        clock.now += 16
        registry.sweep()
        registry.sweep()
        assert gone == ["a", "b"]


def test_a_restarted_registry_reads_each_health_from_the_slots() -> None:
    clock = Clock()
    with fresh_segment() as seg:
        first = _registry(seg, clock)
        for port, iid in ((9001, "ok"), (9002, "sick"), (9003, "silent")):
            first.register(wire.RegisterRequest(host="127.0.0.1", port=port, instance_id=iid))
        first.heartbeat(wire.HeartbeatRequest("sick", healthy=False))
        clock.now += 11
        first.heartbeat(wire.HeartbeatRequest("ok"))
        first.heartbeat(wire.HeartbeatRequest("sick", healthy=False))
        first.sweep()
        second = _registry(seg, clock)
        assert second.rebuild() == 3
        assert {r.instance_id: r.health for r in second.records()} == \
            {"ok": "healthy", "sick": "unhealthy", "silent": "expired"}


# --- pool_resource from real snapshots -------------------------------------------------------------
def _snapshot(admission: str, cpu: float, mem_used: float, mem_total: float, gpu: Any = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"cpu": {"utilization_pct": cpu},
                               "memory": {"used_mb": mem_used, "total_mb": mem_total},
                               "network": [{"rx_mbps": 10, "tx_mbps": "N/A"}]}
    if gpu is not None:
        devices["gpu"] = gpu
    return {"timestamp_ms": 1, "devices": devices,
            "capacity_hint": {"admission_state": admission, "memory_free_ratio": 1 - mem_used / mem_total}}


def test_pool_resource_utilization_and_admission_from_snapshots() -> None:
    clock = Clock()
    with fresh_segment() as seg:
        registry = _registry(seg, clock)
        for i in range(3):
            registry.register(wire.RegisterRequest(host="127.0.0.1", port=9000 + i, instance_id=f"i{i}"))
        inputs = pool_resource.PoolInputs("p", capacity=4, ttl_s=10)

        def report(iid: str, snapshot: dict[str, Any], age_s: float = 0.0) -> None:
            now = clock.now
            clock.now -= age_s
            assert registry.report_resource(wire.ResourceSnapshotRequest(iid, snapshot))
            clock.now = now

        def pool() -> Any:
            return msgspec.to_builtins(pool_resource.build(inputs, registry.records(), LoadView(seg), now=clock.now))

        assert pool()["utilization"]["cpu_avg"] is None and pool()["metric_source"]["utilization"] == "unavailable"
        report("i0", _snapshot("accepting", 10, 100, 1000, gpu=[{"utilization_pct_avg": 50, "memory_used_mb": 10,
                                                                  "memory_total_mb": 100}]), age_s=2)
        report("i1", _snapshot("Degraded", 30, 300, 1000, gpu=[{"utilization_pct_avg": "N/A",
                                                                "utilization_sample_ok": False}]), age_s=4)
        got = pool()
        assert got["instances"] == {"total": 3, "alive": 3, "stale": 0, "with_resource": 2,
                                    "missing_resource": 1, "accepting": 1, "degraded": 1, "rejecting": 0}
        assert got["pool_admission_state"] == "degraded"
        assert got["pool_admission_reason"] == "1 accepting, 1 degraded, 0 rejecting, 3 alive"
        assert got["metric_quality"]["resource"] == "partial"
        assert got["load"]["inflight_total"] == 0 and got["load"]["queue_pressure"] == 0.0
        assert got["metric_source"]["utilization"] == "instance_resource_snapshot"
        util = got["utilization"]
        assert (util["cpu_avg"], util["cpu_max"], util["memory_used_mb"], util["memory_used_ratio"]) == \
            (20.0, 30.0, 400.0, 0.2)
        assert (util["gpu_util_avg"], util["gpu_util_max"], util["gpu_mem_used_ratio"]) == (50.0, 50.0, 0.1)
        assert util["memory_free_ratio_min"] == 0.7
        assert util["network_rx_mbps_total"] == 20.0 and util["network_tx_mbps_total"] is None
        assert got["resource_freshness_s"] == {"min": 2.0, "avg": 3.0, "max": 4.0}

        for iid in ("i0", "i1", "i2"):
            report(iid, _snapshot("accepting", 10, 100, 1000))
        assert pool()["pool_admission_state"] == "accepting"
        for iid in ("i0", "i1", "i2"):
            report(iid, _snapshot("rejecting", 10, 100, 1000))
        assert pool()["pool_admission_state"] == "rejecting"
        # An instance out for its own health is not alive: its report no longer counts.
        registry.heartbeat(wire.HeartbeatRequest("i2", healthy=False))
        got = pool()
        assert (got["instances"]["alive"], got["instances"]["rejecting"], got["instances"]["stale"]) == (2, 2, 1)

        clock.now += 11  # every instance silent past the TTL
        registry.sweep()
        got = pool()
        assert (got["instances"]["alive"], got["instances"]["stale"]) == (0, 3)
        assert got["pool_admission_state"] == "rejecting"
        assert got["pool_admission_reason"] == "0 accepting, 0 degraded, 0 rejecting, 0 alive"
        assert got["load"]["inflight_total"] is None and got["metric_quality"]["load"] == "missing"
        assert got["utilization"]["cpu_avg"] is None  # the dead instances' reports do not count


# --- PROXY_STATIC_INSTANCES ----------------------------------------------------------------------------
def test_static_instances_parse_with_default_ids() -> None:
    settings = Settings.from_env({"PROXY_STATIC_INSTANCES": " http://127.0.0.1:8000=vllm-a ,"
                                  "http://localhost:8001/, http://[::1]:8002"})
    assert [(t.url, t.instance_id) for t in settings.static_targets] == [
        ("http://127.0.0.1:8000", "vllm-a"), ("http://localhost:8001", "hp_localhost:8001"),
        ("http://[::1]:8002", "hp_::1:8002")]
    assert Settings().static_targets == () and Settings().static_probe_s == 2.0


@pytest.mark.parametrize("value, says", [
    ("https://127.0.0.1:8000", "http://"), ("127.0.0.1:8000", "http://"), ("http://:8000", "no host"),
    ("http://127.0.0.1:99999", "port"), ("http://127.0.0.1:8000/v1", "path"),
    ("http://127.0.0.1:8000?x=1", "path"), ("http://u:p@127.0.0.1:8000", "password"),
    ("http://a_b:1", "host 'a_b' is not a host name, an IPv4 address or an IPv6 address"), ("http://127.0.0.1:8000=", "empty id"),
    ("http://127.0.0.1:8000=a,http://127.0.0.1:8001=a", "twice"),
    ("http://127.0.0.1:8000,http://127.0.0.1:8000", "twice"),
    ("http://127.0.0.1:8000=" + "x" * 113, "112 bytes"),
])
def test_a_bad_static_instance_fails_at_start_naming_the_variable(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"^PROXY_STATIC_INSTANCES: .*{says}"):
        Settings.from_env({"PROXY_STATIC_INSTANCES": value})


def test_the_probe_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="^PROXY_STATIC_PROBE_S"):
        Settings.from_env({"PROXY_STATIC_PROBE_S": "0"})
    with pytest.raises(ConfigError, match="PROXY_STATIC_PROBE_S"):
        Settings.from_env({"PROXY_STATIC_PROBE_S": "soon"})
