"""Tests of the simulated KDN (cacheroute_sim/kdn/).

The pure parts (store generation and loading, the transfer model, knob validation) are tested
in-process; the wire behaviour (search, inject, link serialization, faults, topology) against
real ``python -m cacheroute_sim.kdn`` subprocesses on free ports, stopped by pid in fixture teardowns.
Timing assertions use bounds wide enough for a loaded machine on the slow side; the fast side
is exact, since a simulated wait can never be shorter than asked.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheroute_sim.kdn.config import ConfigError, Knobs
from cacheroute_sim.kdn.store import StoreError, generate_store, load_store
from tests.sim_harness import (
    ROOT,
    TIMER_EARLY_S,
    SimProcess,
    http,
    poll_until,
    quiet,
    run,
    running_sim,
)

# One parallel test worker runs them all: they share the module's simulated KDN.
pytestmark = pytest.mark.xdist_group(__name__)

# 4 ids: tokens = chars / 4, KV keys = ceil(tokens / 256).
KNOWLEDGE = [
    {"id": "Alpha", "content": "a" * 4000, "kv_ready": True},   # 1000 tokens, 4 keys
    {"id": "beta", "content": "b" * 400, "kv_ready": False},    # 100 tokens
    {"id": "gamma", "content": "g" * 8000, "kv_ready": True},   # 2000 tokens, 8 keys
    {"id": "tiny", "content": "t" * 40, "kv_ready": True},      # 10 tokens, 1 key
]
ACK_KEYS = ["ok", "injected_kids", "text_only_kids", "miss_kids", "keys_injected",
            "payload_bytes", "payload_files", "network_sim_enabled", "detail"]
# 1000 bytes of KV per token over 80 Mbps at full efficiency = 10 000 bytes/ms:
# alpha (1000 tokens) takes 100 ms, gamma (2000 tokens) 200 ms.
FAST_LINK = {"kv_bytes_per_token": 1000, "bandwidth_mbps": 80.0, "link_efficiency": 1.0,
             "rtt_ms": 0.0}
SLACK = 0.1  # seconds a loaded machine may add to a simulated wait


def inject_body(kids: list[str], **extra: Any) -> dict[str, Any]:
    return {"request_id": 7, "model": "m", "knowledge_ids": kids, "redis_host": "10.0.0.1",
            "redis_port": 6379, "redis_db": 0, "redis_password": None, **extra}


def timed(method: str, url: str, body: Any = None) -> tuple[float, int, Any]:
    t0 = time.monotonic()
    status, _, reply = http(method, url, body)
    return time.monotonic() - t0, status, reply


# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def knowledge_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kdn") / "knowledge.json"
    path.write_text(json.dumps(KNOWLEDGE))
    return path


@pytest.fixture(scope="module")
def shared_kdn(knowledge_file: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[SimProcess]:
    log = tmp_path_factory.mktemp("kdn") / "kdn.log"
    with running_sim(log, "--knowledge", str(knowledge_file), "--rtt-ms", "0",
                     "--kdn-id", "kdn-test", module="cacheroute_sim.kdn") as kdn:
        yield kdn


@pytest.fixture
def kdn(shared_kdn: SimProcess) -> Iterator[SimProcess]:
    """The shared KDN with start-time knobs, nothing in flight and zeroed counters."""
    with quiet(shared_kdn, ("held", "active_transfers", "queued_transfers"), timeout_s=5):
        yield shared_kdn


# --------------------------------------------------------------------------- pure parts

def test_transfer_model_matches_the_proxy_iws_defaults() -> None:
    knobs = Knobs()
    # 0.096 MB/token at 82.5 % of 1000 Mbps: the Proxy's kv_transfer.
    assert knobs.transfer_ms(2048 * knobs.kv_bytes_per_token) == pytest.approx(
        2048 * 0.096 / (1000 / 8 * 0.825) * 1000)
    assert Knobs(**FAST_LINK).transfer_ms(1_000_000) == pytest.approx(100.0)  # type: ignore[arg-type]


def test_knob_updates_are_validated() -> None:
    knobs = Knobs().updated({"rtt_ms": 5, "fail_status": 503, "fault_on": "search"})
    assert (knobs.rtt_ms, knobs.fail_status, knobs.fault_on) == (5.0, 503, "search")
    assert knobs.faults("search") and not knobs.faults("inject")
    for bad in ({"rtt_ms": -1}, {"bandwidth_mbps": 0}, {"link_efficiency": 1.5},
                {"fail_status": 200}, {"hang": "yes"}, {"fault_on": "both"}, {"nope": 1},
                {"kv_bytes_per_token": -1}):
        with pytest.raises(ConfigError):
            Knobs().updated(bad)


def test_generated_store_is_deterministic_and_shaped() -> None:
    store = generate_store(200, 0.5, seed=0)
    again = generate_store(200, 0.5, seed=0)
    other = generate_store(200, 0.5, seed=1)
    items, miss = store.lookup([f"k{i:04d}" for i in range(201)])
    assert len(items) == 200 and miss == ["k0200"]
    assert [(i.content, i.kv_ready) for i in items] == [
        (i.content, i.kv_ready) for i in again.lookup([x.id for x in items])[0]]
    assert [i.content for i in items] != [i.content for i in other.lookup([x.id for x in items])[0]]
    short = [i.tokens for n, i in enumerate(items) if n % 4 == 0]
    long = [i.tokens for n, i in enumerate(items) if n % 4 != 0]
    assert all(50 <= t <= 300 for t in short) and all(1000 <= t <= 3000 for t in long)
    assert 60 <= sum(i.kv_ready for i in items) <= 140
    assert generate_store(10, 0.0, 0).summary()["kv_ready"] == 0
    assert generate_store(10, 1.0, 0).summary()["kv_ready"] == 10


def test_load_store_lowercases_and_rejects_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"id": " MiXed ", "content": "x"}]))
    store = load_store(good)
    assert store.get("mixed") is not None and store.get("mixed").kv_ready is False  # type: ignore[union-attr]
    for i, (content, words) in enumerate([
            ([{"id": "A", "content": "x"}, {"id": "a", "content": "y"}], "duplicate"),
            ([{"id": "a", "content": "x", "colour": 1}], "colour"),
            ([{"id": " ", "content": "x"}], "empty id"),
            ({"id": "a"}, "Expected `array`")]):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps(content))
        with pytest.raises(StoreError, match=words):
            load_store(bad)
    with pytest.raises(StoreError, match="cannot read"):
        load_store(tmp_path / "missing.json")


# --------------------------------------------------------------------------------- search

def test_search_items_miss_and_case_insensitivity(kdn: SimProcess) -> None:
    status, _, reply = http("POST", kdn.url + "/knowledge/search/text",
                            {"knowledge_ids": ["ALPHA", " Beta ", "nope", "gamma", "alpha"]})
    assert status == 200 and reply["miss"] == ["nope"]
    # Request order, duplicates kept, ids lower-cased; no need_fields: every field.
    assert [i["id"] for i in reply["items"]] == ["alpha", "beta", "gamma", "alpha"]
    alpha, beta = reply["items"][0], reply["items"][1]
    assert alpha == {"id": "alpha", "knowledge_id": "alpha", "content": "a" * 4000,
                     "length": 4000, "rel_path": "blocks/alpha.txt", "kv_ready": True,
                     "kv_rel_dir": "alpha", "kv_dumped_keys": 4,
                     "kv_updated_at": alpha["kv_updated_at"]}
    assert isinstance(alpha["kv_updated_at"], int) and alpha["kv_updated_at"] > 0
    assert beta["kv_ready"] is False
    assert beta["kv_rel_dir"] is beta["kv_dumped_keys"] is beta["kv_updated_at"] is None
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert (st["searches"], st["search_items"], st["search_misses"]) == (1, 4, 1)


def test_search_need_fields_and_bad_bodies(kdn: SimProcess) -> None:
    need = ["content", "length", "rel_path", "kv_ready", "kv_rel_dir", "kv_dumped_keys",
            "kv_updated_at"]
    _, _, full = http("POST", kdn.url + "/knowledge/search/text",
                      {"knowledge_ids": ["tiny"], "need_fields": need})
    assert list(full["items"][0]) == ["id", "knowledge_id", *need]
    _, _, some = http("POST", kdn.url + "/knowledge/search/text",
                      {"knowledge_ids": ["tiny"], "need_fields": ["kv_ready", "length"]})
    assert some == {"items": [{"id": "tiny", "knowledge_id": "tiny", "length": 40,
                               "kv_ready": True}], "miss": []}
    assert http("POST", kdn.url + "/knowledge/search/text", {"knowledge_ids": []})[2] == {
        "items": [], "miss": []}
    for body, detail in [({"knowledge_ids": "alpha"}, "must be a list"),
                         ({"knowledge_ids": [1]}, "must be strings"),
                         ({"knowledge_ids": ["a"], "need_fields": "content"}, "need_fields"),
                         ([1], "JSON object")]:
        status, _, reply = http("POST", kdn.url + "/knowledge/search/text", body)
        assert status == 400 and detail in reply["error"], reply
    status, _, reply = http("POST", kdn.url + "/knowledge/search/text", raw=b"{nope")
    assert (status, reply) == (400, {"error": "invalid_json"})


def test_search_latency_follows_rtt(kdn: SimProcess) -> None:
    url, body = kdn.url + "/knowledge/search/text", {"knowledge_ids": ["beta"]}
    fast, _, _ = timed("POST", url, body)
    http("POST", kdn.url + "/sim/config", {"rtt_ms": 150})
    slow, status, _ = timed("POST", url, body)
    assert status == 200
    assert fast < 0.1 and 0.15 - TIMER_EARLY_S <= slow < 0.15 + SLACK, (fast, slow)


def test_search_latency_follows_reply_size(kdn: SimProcess) -> None:
    # 0.32 Mbps at full efficiency = 40 bytes per ms.
    http("POST", kdn.url + "/sim/config", {"bandwidth_mbps": 0.32, "link_efficiency": 1.0})
    url = kdn.url + "/knowledge/search/text"
    small, _, _ = timed("POST", url, {"knowledge_ids": ["beta"], "need_fields": ["content"]})
    big, _, reply = timed("POST", url, {"knowledge_ids": ["gamma"], "need_fields": ["content"]})
    expected = len(json.dumps(reply, separators=(",", ":"))) / 40 / 1000  # ~0.2 s
    assert expected - TIMER_EARLY_S <= big < expected + SLACK, (big, expected)
    assert small < 0.03 + SLACK and big - small > 0.15
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert st["search_bytes"] > 8000


# --------------------------------------------------------------------------------- inject

def test_inject_ack_splits_kv_ready_text_only_and_miss(kdn: SimProcess) -> None:
    # Default bytes per token; a fat link so the 288 MB move takes ~3 ms, not ~3 s.
    http("POST", kdn.url + "/sim/config", {"bandwidth_mbps": 1e6})
    status, headers, ack = http("POST", kdn.url + "/knowledge/inject_ready_kv",
                                inject_body(["GAMMA", "beta", "nope", "alpha"]))
    assert status == 200 and headers["content-type"] == "application/json"
    assert list(ack) == ACK_KEYS
    per_token = Knobs().kv_bytes_per_token
    assert ack == {"ok": True, "injected_kids": ["gamma", "alpha"], "text_only_kids": ["beta"],
                   "miss_kids": ["nope"], "keys_injected": 12,
                   "payload_bytes": 3000 * per_token, "payload_files": 12,
                   "network_sim_enabled": True, "detail": ""}
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert (st["injects"], st["injected_kids"], st["text_only_kids"], st["miss_kids"],
            st["keys_injected"], st["payload_bytes"]) == (1, 2, 1, 1, 12, 3000 * per_token)
    assert st["links"] == {"10.0.0.1:6379": {"transfers": 1, "bytes": 3000 * per_token,
                                              "active": 0, "queued": 0}}
    assert st["last_inject"] == {"request_id": 7, "model": "m",
                                 "knowledge_ids": ["gamma", "beta", "nope", "alpha"],
                                 "redis_host": "10.0.0.1", "redis_port": 6379, "redis_db": 0,
                                 "redis_password_set": False}


def test_inject_without_kv_ready_ids_moves_nothing(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", FAST_LINK)
    elapsed, status, ack = timed("POST", kdn.url + "/knowledge/inject_ready_kv",
                                 inject_body(["beta", "nope"]))
    assert status == 200 and elapsed < 0.1
    assert (ack["ok"], ack["injected_kids"], ack["text_only_kids"], ack["miss_kids"],
            ack["payload_bytes"], ack["keys_injected"]) == (True, [], ["beta"], ["nope"], 0, 0)
    assert http("GET", kdn.url + "/sim/stats")[2]["links"] == {}


def test_inject_rejects_empty_and_malformed_requests(kdn: SimProcess) -> None:
    url = kdn.url + "/knowledge/inject_ready_kv"
    for body in (inject_body([]), {"request_id": 1, "model": "m"}):
        assert http("POST", url, body)[::2] == (400, {"ok": False,
                                                      "detail": "knowledge_ids is empty"})
    for body, detail in [(inject_body("alpha"), "must be a list"),  # type: ignore[arg-type]
                         (inject_body(["alpha"], redis_port="6379"), "redis_port"),
                         (inject_body(["alpha"], redis_port=70000), "redis_port"),
                         (inject_body(["alpha"], redis_db=-1), "redis_db"),
                         (inject_body(["alpha"], redis_host=""), "redis_host")]:
        status, _, reply = http("POST", url, body)
        assert status == 400 and reply["ok"] is False and detail in reply["detail"], reply
    assert http("POST", url, raw=b"[")[::2] == (400, {"ok": False, "detail": "invalid_json"})
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert (st["injects"], st["invalid"]) == (0, 8)


def test_inject_time_is_bytes_over_bandwidth_plus_rtt(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", FAST_LINK)
    url = kdn.url + "/knowledge/inject_ready_kv"
    one, _, ack = timed("POST", url, inject_body(["alpha"]))
    assert ack["payload_bytes"] == 1_000_000
    two, _, ack = timed("POST", url, inject_body(["gamma"]))
    assert ack["payload_bytes"] == 2_000_000
    assert 0.1 - TIMER_EARLY_S <= one < 0.1 + SLACK and 0.2 - TIMER_EARLY_S <= two < 0.2 + SLACK, (one, two)
    http("POST", kdn.url + "/sim/config", {"rtt_ms": 100})
    with_rtt, _, _ = timed("POST", url, inject_body(["alpha"]))
    assert 0.2 - TIMER_EARLY_S <= with_rtt < 0.2 + SLACK, with_rtt
    # Half the bandwidth, twice the time.
    http("POST", kdn.url + "/sim/config", {"rtt_ms": 0, "bandwidth_mbps": 40})
    halved, _, _ = timed("POST", url, inject_body(["alpha"]))
    assert 0.2 - TIMER_EARLY_S <= halved < 0.2 + SLACK, halved


def test_transfers_to_one_redis_target_are_serialized(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", FAST_LINK)
    url = kdn.url + "/knowledge/inject_ready_kv"

    async def go() -> tuple[list[float], float, dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()

            async def inject(host: str) -> float:
                async with s.post(url, json=inject_body(["gamma"], redis_host=host)) as r:
                    assert r.status == 200 and (await r.json())["ok"] is True
                return time.monotonic() - t0

            same = [asyncio.create_task(inject("10.0.0.1")) for _ in range(3)]
            other = asyncio.create_task(inject("10.0.0.2"))
            await asyncio.sleep(0.1)  # all four are in: two on a link, two queued
            async with s.get(kdn.url + "/sim/stats") as r:
                mid = await r.json()
            return sorted(await asyncio.gather(*same)), await other, mid

    same, other, mid = run(go())
    assert (mid["active_transfers"], mid["queued_transfers"]) == (2, 2), mid
    assert mid["links"]["10.0.0.1:6379"]["queued"] == 2
    # 200 ms each, one after the other on 10.0.0.1; 10.0.0.2 runs in parallel.
    for i, done in enumerate(same, start=1):
        assert 0.2 * i - TIMER_EARLY_S <= done < 0.2 * i + SLACK, same
    assert 0.2 - TIMER_EARLY_S <= other < 0.2 + SLACK, other
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert st["max_active_transfers"] == 2 and st["active_transfers"] == 0
    assert st["links"]["10.0.0.1:6379"]["transfers"] == 3
    assert st["links"]["10.0.0.2:6379"]["bytes"] == 2_000_000


# ---------------------------------------------------------------------------------- knobs

def test_fail_status_applies_to_the_selected_routes(kdn: SimProcess) -> None:
    search_url = kdn.url + "/knowledge/search/text"
    inject_url = kdn.url + "/knowledge/inject_ready_kv"
    search = {"knowledge_ids": ["alpha"]}
    http("POST", kdn.url + "/sim/config", {"fail_status": 503, "fault_on": "inject"})
    assert http("POST", search_url, search)[0] == 200
    status, _, ack = http("POST", inject_url, inject_body(["alpha"]))
    assert status == 503 and list(ack) == ACK_KEYS
    assert ack["ok"] is False and ack["injected_kids"] == [] and "503" in ack["detail"]
    http("POST", kdn.url + "/sim/config", {"fault_on": "search"})
    assert http("POST", search_url, search)[0] == 503
    assert http("POST", inject_url, inject_body(["tiny"]))[0] == 200
    http("POST", kdn.url + "/sim/config", {"fault_on": "all", "fail_status": 500})
    assert http("POST", search_url, search)[0] == http("POST", inject_url,
                                                       inject_body(["tiny"]))[0] == 500
    assert http("GET", kdn.url + "/sim/stats")[2]["failed"] == 4
    assert http("POST", kdn.url + "/sim/config", {"fail_status": None})[2]["fail_status"] is None
    assert http("POST", search_url, search)[0] == 200


def test_hang_holds_until_release(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", {"hang": True, "fault_on": "inject"})
    results: list[tuple[float, int, Any]] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: results.append(
        timed("POST", kdn.url + "/knowledge/inject_ready_kv", inject_body(["tiny"]))))
    worker.start()
    poll_until(lambda: http("GET", kdn.url + "/sim/stats")[2]["held"] == 1)
    assert http("POST", kdn.url + "/knowledge/search/text",
                {"knowledge_ids": ["tiny"]})[0] == 200  # searches are not held
    time.sleep(0.2)
    assert not results
    assert http("POST", kdn.url + "/sim/release")[2] == {"released": 1}
    worker.join(5)
    assert results and results[0][1] == 200 and results[0][2]["injected_kids"] == ["tiny"]
    assert time.monotonic() - t0 >= 0.2


def test_config_routes(kdn: SimProcess) -> None:
    _, _, start = http("GET", kdn.url + "/sim/config")
    assert start == {"rtt_ms": 0.0, "bandwidth_mbps": 1000.0, "link_efficiency": 0.825,
                     "kv_bytes_per_token": 96000, "fail_status": None, "hang": False,
                     "fault_on": "all"}
    assert http("POST", kdn.url + "/sim/config", {"rtt_ms": 3})[2]["rtt_ms"] == 3.0
    for bad in ({"rtt_ms": -1}, {"nope": 1}, [1]):
        status, _, reply = http("POST", kdn.url + "/sim/config", bad)
        assert status == 400 and reply["error"] == "invalid_request"
    assert http("GET", kdn.url + "/sim/config")[2]["rtt_ms"] == 3.0  # bad updates change nothing
    assert http("POST", kdn.url + "/sim/config/reset")[2] == start


def test_topology_and_health(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", {"rtt_ms": 100})
    status, _, hello = http("POST", kdn.url + "/v1/topology/hello", {"instance_id": "x"})
    assert status == 200 and hello["ok"] is True and hello["kdn_id"] == "kdn-test"
    assert (hello["host"], hello["port"]) == ("127.0.0.1", kdn.port)
    elapsed, status, ping = timed("GET", kdn.url + "/v1/topology/ping")
    assert (status, ping) == (200, {"ok": True}) and 0.1 - TIMER_EARLY_S <= elapsed < 0.1 + SLACK
    assert http("GET", kdn.url + "/healthz")[2] == {"ok": True, "kdn_id": "kdn-test", "items": 4}


def test_stats_reset_keeps_gauges_and_zeroes_counters(kdn: SimProcess) -> None:
    http("POST", kdn.url + "/knowledge/inject_ready_kv", inject_body(["tiny"]))
    http("POST", kdn.url + "/knowledge/search/text", {"knowledge_ids": ["tiny"]})
    _, _, st = http("GET", kdn.url + "/sim/stats")
    assert (st["injects"], st["searches"], st["links"]["10.0.0.1:6379"]["transfers"]) == (1, 1, 1)
    _, _, st = http("POST", kdn.url + "/sim/stats/reset")
    assert (st["injects"], st["searches"], st["payload_bytes"], st["links"]) == (0, 0, 0, {})
    assert st["store"] == {"items": 4, "kv_ready": 3, "tokens": 3110, "kv_ready_tokens": 3010}


# ------------------------------------------------------------------------------------ CLI

def test_generated_store_and_time_scale(tmp_path: Path) -> None:
    with running_sim(tmp_path / "gen.log", "--time-scale", "0.1", "--rtt-ms", "1000",
                     module="cacheroute_sim.kdn") as kdn:
        assert http("GET", kdn.url + "/healthz")[2]["items"] == 200
        kids = [f"K{i:04d}" for i in range(201)]
        elapsed, _, reply = timed("POST", kdn.url + "/knowledge/search/text",
                                  {"knowledge_ids": kids, "need_fields": ["kv_ready", "length"]})
        # rtt 1000 ms x 0.1; without content the reply is a few kB, ~0 ms at 1 Gbps.
        assert 0.1 - TIMER_EARLY_S <= elapsed < 0.1 + SLACK, elapsed
        assert reply["miss"] == ["k0200"] and len(reply["items"]) == 200
        expected = generate_store(200, 0.5, seed=0).lookup([k.lower() for k in kids[:200]])[0]
        assert [(i["kv_ready"], i["length"]) for i in reply["items"]] == [
            (e.kv_ready, e.length) for e in expected]
        assert http("GET", kdn.url + "/sim/config")[2]["rtt_ms"] == 1000.0
        assert kdn.terminate() == 0, kdn.log()


@pytest.mark.timeout(20)
def test_sigterm_with_a_hung_request_exits_zero(tmp_path: Path) -> None:
    with running_sim(tmp_path / "term.log", "--hang", "--shutdown-grace", "0.3",
                     module="cacheroute_sim.kdn") as kdn:
        worker = threading.Thread(target=http, args=(
            "POST", kdn.url + "/knowledge/search/text", {"knowledge_ids": ["k0001"]}),
            daemon=True)
        worker.start()
        poll_until(lambda: http("GET", kdn.url + "/sim/stats")[2]["held"] == 1)
        t0 = time.monotonic()
        assert kdn.terminate() == 0, kdn.log()
        assert time.monotonic() - t0 < 3
        worker.join(3)


def test_bad_knowledge_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "k.json"
    bad.write_text(json.dumps([{"id": "a", "content": "x"}, {"id": "A", "content": "y"}]))
    done = subprocess.run([sys.executable, "-m", "cacheroute_sim.kdn", "--knowledge", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 2 and "duplicate knowledge id 'a'" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "cacheroute_sim.kdn", "--rtt-ms", "-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 2 and "rtt_ms must be >= 0" in done.stderr, done.stderr
