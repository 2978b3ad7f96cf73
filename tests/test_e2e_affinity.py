"""kv_aware end to end: the host-wide affinity index every worker reads, what clears it, what
keeps it, and the strategy's credit within the balance guard; the claims that bridge the
index's lag are tests/test_e2e_claims.py's.

Real clusters (sidecar + workers), simulated instances and a simulated KDN
(tests/affinity_cluster.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.parse
from typing import Any

import pytest

from cacheroute_proxy.affinity_keys import prefix_keys, rendezvous_home
from tests.affinity_cluster import (KV_AWARE, SYSTEM, Kdn, affinity_rows, ask, heartbeat, held_streams, hold,
                                    knowledge_body, knowledge_count, prefix_body, prompt_query,
                                    resident_everywhere, served_by)
from tests.harness import get, http, post, wait_until


# --- the index: one per host, seen by every worker ---------------------------------------------------
def test_an_acknowledged_inject_is_resident_for_every_worker_and_skips_the_kdn_after(make_cluster, tmp_path):
    kdn = Kdn(tmp_path)
    try:
        cluster = make_cluster(workers=4, env=KV_AWARE)
        inst = cluster.add_instance()
        kids = ["k0001", "k0002"]
        first = ask(cluster.worker_url(0), knowledge_body(kdn, kids))
        assert first["kv_ack"]["ok"] is True and first["trace"]["kvcache_actual_path"] == "kv_injected"
        assert first["resident_kids"] == [] and kdn.injects() == 1 and inst.stats()["kv_injects"] == 1
        # Worker 0 told the sidecar; the sidecar published; every worker reads it from the segment.
        wait_until(lambda: resident_everywhere(cluster, inst.instance_id, kids), 10,
                   message="the inject resident in every worker's view")
        for worker in range(1, cluster.workers):
            meta = ask(cluster.worker_url(worker), knowledge_body(kdn, kids))
            assert meta["resident_kids"] == kids, meta
            assert meta["trace"]["kvcache_actual_path"] == "kv_resident"
        # No inject asked of the instance, no KDN transfer, for knowledge already resident.
        assert (kdn.injects(), inst.stats()["kv_injects"]) == (1, 1)
        # One more id: only it is asked for, and pulled.
        meta = ask(cluster.worker_url(2), knowledge_body(kdn, ["k0001", "k0003"]))
        assert meta["resident_kids"] == ["k0001"] and meta["trace"]["kvcache_actual_path"] == "kv_injected"
        assert (kdn.injects(), inst.stats()["kv_injects"]) == (2, 2)
        assert inst.stats()["kv_inject_pulled_ids"] == 3  # k0001, k0002, then k0003 alone
    finally:
        kdn.stop()


def test_the_model_evicts_the_least_recently_used_past_the_instance_capacity(make_cluster, tmp_path):
    kdn = Kdn(tmp_path)
    try:
        # The instance registers meta.kv_mem_gb 2.44140625: x 1024 / 1 MB a token = 2500 tokens,
        # room for two ids of 1000 tokens in the proxy's model.
        cluster = make_cluster(workers=2, env={**KV_AWARE, "PROXY_AFFINITY_KV_MB_PER_TOKEN": "1"})
        inst = cluster.add_instance("--kv-mem-gb", "2.44140625")
        for kid in ("k0001", "k0002", "k0003"):
            ask(cluster.dp_url, knowledge_body(kdn, [kid]))
        all_four = ["k0001", "k0002", "k0003", "k0004"]

        def resident() -> list[str]:
            return affinity_rows(cluster, 1, knowledge=",".join(all_four))[inst.instance_id]["resident_knowledge"]
        wait_until(lambda: resident() == ["k0002", "k0003"], 10, message="k0001 evicted")
        ask(cluster.dp_url, knowledge_body(kdn, ["k0002"]))  # used again: most recent
        ask(cluster.dp_url, knowledge_body(kdn, ["k0004"]))
        wait_until(lambda: resident() == ["k0002", "k0004"], 10, message="k0003 evicted, not k0002")
        model = cluster.status()["event_channel"]["affinity"]["instances"][inst.instance_id]
        assert (model["knowledge"], model["tokens"], model["capacity_tokens"], model["evicted"]) == \
            (2, 2000, 2500, 2)
    finally:
        kdn.stop()


@pytest.mark.slow
def test_a_reregistered_or_purged_instance_holds_nothing(make_cluster):
    cluster = make_cluster(workers=2, env=KV_AWARE)
    inst = cluster.add_instance()
    assert heartbeat(cluster, inst.instance_id, resident_keys=["k0001", "k0002"]) == (200, {"ok": True})
    wait_until(lambda: all(knowledge_count(cluster, w, inst.instance_id) == 2 for w in range(2)), 10,
               message="reported ids resident")
    # Registered again (the engine restarted: its KV went with it).
    status, _, _ = http("POST", f"{cluster.cp_url}/v1/instance/register",
                        {"instance_id": inst.instance_id, "host": "127.0.0.1", "port": inst.port})
    assert status == 200
    wait_until(lambda: all(knowledge_count(cluster, w, inst.instance_id) == 0 for w in range(2)), 10,
               message="a re-registration clears the instance's entries")
    heartbeat(cluster, inst.instance_id, resident_keys=["k0003"])
    wait_until(lambda: knowledge_count(cluster, 0, inst.instance_id) == 1, 10, message="resident again")
    # A prompt routed there is claimed at once, then confirmed: held either way.
    inst.configure(hold_streams=True)

    def prompt_blocks(worker: int) -> int:
        return affinity_rows(cluster, worker, **prompt_query())[inst.instance_id]["resident_prefix_blocks"] \
            + affinity_rows(cluster, worker, **prompt_query())[inst.instance_id]["pending_prefix_blocks"]

    async def routed_while_held() -> None:
        async with held_streams(inst) as held:
            held += await hold(cluster, 1)
            assert all(prompt_blocks(w) == 3 for w in range(2))
    asyncio.run(routed_while_held())
    slot = next(r for r in cluster.loads()["instances"] if r["instance_id"] == inst.instance_id)["slot"]
    assert post(f"{cluster.cp_url}/v1/instance/unregister", {"instance_id": inst.instance_id})["ok"]
    # The sim registers again at its next heartbeat (a new slot generation): nothing is resident,
    # in the model or in the row the slot had.
    wait_until(lambda: any(r["instance_id"] == inst.instance_id for r in cluster.loads()["instances"]),
               20, message="registered again")
    assert knowledge_count(cluster, 0, inst.instance_id) == 0
    assert prompt_blocks(0) == prompt_blocks(1) == 0  # neither confirmed nor claimed under the new generation
    affinity = cluster.status()["event_channel"]["affinity"]
    assert affinity["instances"].get(inst.instance_id, {"knowledge": 0})["knowledge"] == 0, (slot, affinity)


def test_heartbeat_resident_keys_replace_the_model_and_are_validated(make_cluster):
    cluster = make_cluster(workers=2, env=KV_AWARE)
    inst = cluster.add_instance()
    heartbeat(cluster, inst.instance_id, resident_keys=["k0001", "K0002"])
    wait_until(lambda: resident_everywhere(cluster, inst.instance_id, ["k0001", "k0002"]), 10,
               message="the instance's own account")
    heartbeat(cluster, inst.instance_id, resident_keys=["k0002"])
    wait_until(lambda: resident_everywhere(cluster, inst.instance_id, ["k0002"]), 10,
               message="replaced, not merged")
    heartbeat(cluster, inst.instance_id)  # without the field: the model stands
    assert resident_everywhere(cluster, inst.instance_id, ["k0002"])
    status, body = heartbeat(cluster, inst.instance_id, resident_keys=["ok", ""])
    assert status == 422 and "resident_keys" in str(body), body
    status, body = heartbeat(cluster, inst.instance_id, resident_keys="k0001")
    assert status == 422, body


def test_a_restarted_sidecar_keeps_the_index(make_cluster):
    cluster = make_cluster(workers=2, env=KV_AWARE)
    inst = cluster.add_instance()
    heartbeat(cluster, inst.instance_id, resident_keys=["k0001", "k0002"])
    wait_until(lambda: resident_everywhere(cluster, inst.instance_id, ["k0001", "k0002"]), 10,
               message="resident")
    sidecar_pid = cluster.status()["sidecar"]["pid"]
    os.kill(sidecar_pid, signal.SIGKILL)
    # While it is down the workers read the segment as it was; after, the new sidecar adopted it.
    assert resident_everywhere(cluster, inst.instance_id, ["k0001", "k0002"])
    wait_until(lambda: cluster.status()["sidecar"]["pid"] != sidecar_pid, 15, message="restarted")
    affinity = cluster.status()["event_channel"]["affinity"]
    assert affinity["adopted_entries"] == 2
    assert affinity["instances"][inst.instance_id]["knowledge"] == 2
    assert resident_everywhere(cluster, inst.instance_id, ["k0001", "k0002"])
    heartbeat(cluster, inst.instance_id, resident_keys=["k0001"])  # the new sidecar writes the row
    wait_until(lambda: resident_everywhere(cluster, inst.instance_id, ["k0001"]), 10,
               message="the adopted model goes on")


def test_a_per_worker_view_sees_only_what_its_worker_sent(make_cluster, tmp_path):
    kdn = Kdn(tmp_path)
    try:
        cluster = make_cluster(workers=2, env={**KV_AWARE, "PROXY_AFFINITY_VIEW": "per_worker"})
        inst = cluster.add_instance()
        ask(cluster.worker_url(0), knowledge_body(kdn, ["k0001"]))
        mine = affinity_rows(cluster, 0, knowledge="k0001")[inst.instance_id]
        theirs = affinity_rows(cluster, 1, knowledge="k0001")[inst.instance_id]
        assert mine["resident_knowledge"] == ["k0001"] and theirs["resident_knowledge"] == []
        assert theirs["pending_knowledge"] == []  # nor did worker 0's claim reach worker 1
        # The sidecar's host-wide model heard it all the same (what the shared view would read).
        wait_until(lambda: cluster.status()["event_channel"]["affinity"]["instances"]
                   .get(inst.instance_id, {}).get("knowledge") == 1, 10, message="the sidecar's model")
        meta = ask(cluster.worker_url(1), knowledge_body(kdn, ["k0001"]))
        assert meta["resident_kids"] == [] and inst.stats()["kv_injects"] == 2  # worker 1 asked again
        meta = ask(cluster.worker_url(0), knowledge_body(kdn, ["k0001"]))
        assert meta["resident_kids"] == ["k0001"] and inst.stats()["kv_injects"] == 2
    finally:
        kdn.stop()


# --- the strategy: the lowest predicted time to first token, and the guard -------------------------------
# least_load's score = inflight alone, so the guard's fallback is easy to read.
INFLIGHT_ONLY = {**KV_AWARE, "PROXY_LEAST_LOAD_WEIGHTS": '{"inflight": 1, "active_prepare": 0, '
                 '"active_ready": 0, "prepare_queue_depth": 0, "ready_queue_depth": 0, '
                 '"pending_prefill_count": 0, "active_decode_count": 0, "predicted_total_backlog_ms": 0}'}


def predicted(cluster, worker: int) -> dict[str, dict[str, Any]]:
    """Each instance's predicted time to first token, in parts, for the shared prompt."""
    return {iid: row["predicted_ttft_ms"] for iid, row in affinity_rows(cluster, worker, **prompt_query()).items()}


def test_a_holder_wins_until_its_queue_costs_more_than_the_prefill_it_saves(make_cluster):
    # One ready slot an instance: a request held decoding there makes the next one wait for it.
    cluster = make_cluster(workers=2, env={**KV_AWARE, "READY_CONCURRENCY": "1"})
    a, b = cluster.add_instance(), cluster.add_instance()
    warm = served_by(cluster, prefix_body("first"))
    cold = b.instance_id if warm == a.instance_id else a.instance_id
    wait_until(lambda: affinity_rows(cluster, 1, **prompt_query())[warm]["resident_prefix_blocks"] == 3,
               10, message="the system prompt's blocks resident where it went")
    # Idle: the warm instance wins every time (least_load alone would alternate the tie): it
    # queues nothing and prefills less.
    wait_until(lambda: predicted(cluster, 0)[warm]["queue"] == predicted(cluster, 0)[cold]["queue"] == 0, 10,
               message="both idle")
    parts = predicted(cluster, 0)
    assert parts[warm]["prefill"] < parts[cold]["prefill"] and parts[warm]["total"] < parts[cold]["total"]
    traces = [ask(cluster.dp_url, prefix_body(f"again {i}"))["trace"] for i in range(4)]
    assert [(t["instance_id"], t["affinity_guard"]) for t in traces] == [(warm, False)] * 4
    assert all(t["affinity_saved_ms"] > 0 and t["route_predicted_ttft_ms"] > 0 for t in traces)
    warm_sim = a if warm == a.instance_id else b
    warm_sim.configure(hold_streams=True)

    async def scenario() -> None:
        async with held_streams(warm_sim) as held:
            # A long answer decoding on warm holds its only slot: the next request would queue
            # behind it for longer than the prefill the cache saves.
            held += await hold(cluster, 1, max_tokens=2000)
            assert held[0].response.headers["x-cacheroute-instance"] == warm
            wait_until(lambda: predicted(cluster, 1)[warm]["total"] > predicted(cluster, 1)[cold]["total"], 10,
                       message="the warm instance's queue outweighs its saving")
            parts = predicted(cluster, 1)
            assert parts[warm]["queue"] > parts[cold]["prefill"] - parts[warm]["prefill"]
            trace = ask(cluster.dp_url, prefix_body("third", stream=False))["trace"]
            assert (trace["instance_id"], trace["affinity_guard"]) == (cold, False)
    asyncio.run(scenario())


def test_the_guard_makes_kv_aware_choose_as_least_load_when_inflight_spreads_too_far(make_cluster):
    """A prompt with a home: the guard's bound is the prompt one (the other one stays at its
    default, past the spread this makes)."""
    cluster = make_cluster(workers=2, env={**INFLIGHT_ONLY, "PROXY_KV_AWARE_PROMPT_BALANCE_ABS": "0.5",
                                           "PROXY_KV_AWARE_BALANCE_REL": "1"})
    a, b = cluster.add_instance(), cluster.add_instance()
    warm = served_by(cluster, prefix_body("first"))
    cold = b.instance_id if warm == a.instance_id else a.instance_id
    wait_until(lambda: affinity_rows(cluster, 0, **prompt_query())[warm]["resident_prefix_blocks"] == 3,
               10, message="resident")
    loads = get(f"{cluster.worker_url(0)}/debug/instance_loads?{urllib.parse.urlencode(prompt_query())}")
    assert loads["kv_aware"]["guard"]["fired"] is False and "spread 0" in loads["kv_aware"]["guard"]["reason"]
    warm_sim = a if warm == a.instance_id else b
    warm_sim.configure(hold_streams=True)

    async def scenario() -> None:
        async with held_streams(warm_sim) as held:
            held += await hold(cluster, 1)  # goes warm (spread 0: no guard)
            assert held[0].response.headers["x-cacheroute-instance"] == warm
            loads = get(f"{cluster.worker_url(1)}/debug/instance_loads?"
                        f"{urllib.parse.urlencode(prompt_query())}")
            guard = loads["kv_aware"]["guard"]
            assert guard["fired"] is True and "least_load" in guard["reason"], guard
            assert guard["balance_abs"] == 0.5  # the prompt's bound, not PROXY_KV_AWARE_BALANCE_ABS
            # warm is predicted the faster (its slots are free, it holds the prompt), but the
            # inflight spread is past the bound: least_load's choice, the idle cold instance.
            rows = {r["instance_id"]: r["affinity"] for r in loads["instances"]}
            assert rows[warm]["predicted_ttft_ms"]["total"] < rows[cold]["predicted_ttft_ms"]["total"]
            trace = ask(cluster.dp_url, prefix_body("second", stream=False))["trace"]
            assert (trace["instance_id"], trace["affinity_guard"]) == (cold, True)
    asyncio.run(scenario())


def test_the_service_a_request_reserves_skips_the_prompt_blocks_its_instance_holds(make_cluster):
    """The sidecar learns an instance's pace from predicted against observed first tokens: a
    request whose prompt the instance holds must be predicted as the short prefill it is, or the
    instance that holds the most looks the fastest and draws every prompt."""
    cluster = make_cluster(workers=1, env=KV_AWARE)
    cluster.add_instance("--prefix-caching")
    first = ask(cluster.dp_url, prefix_body("first", stream=False))["trace"]
    held = ask(cluster.dp_url, prefix_body("second", stream=False))["trace"]
    assert held["instance_id"] == first["instance_id"]
    assert held["affinity_saved_ms"] > 0
    assert held["predict_service_ms"] < first["predict_service_ms"] - held["affinity_saved_ms"] / 2


def _system_prompts_homed_on(instance_id: str, ids: list[str], count: int) -> list[str]:
    """`count` system prompts whose rendezvous home among `ids` is `instance_id`."""
    prompts = []
    for n in range(200):
        system = f"Corpus {n}. " + SYSTEM
        first = prefix_keys(f"<|system|>{system}<|user|>", 64, 1)[0]
        if ids[rendezvous_home(first, ids)] == instance_id:
            prompts.append(system)
            if len(prompts) == count:
                return prompts
    raise AssertionError("no prompts homed there")


def _homes_moved(cluster) -> int:
    """How many prompts the sidecar homes away from their rendezvous home now."""
    return get(f"{cluster.cp_url}/debug/status")["event_channel"]["prompt_homes"]["moved"]


def test_prompts_whose_home_cache_cannot_hold_them_move_to_an_instance_that_can(make_cluster):
    """Two equally popular prompts homed on each instance, so by their traffic nothing would
    move; but `a` registers a KV capacity that holds less than one of them beside a block for
    each of its 4 slots. The sidecar moves both of a's prompts to `b`, and no more."""
    cluster = make_cluster(workers=2, env=KV_AWARE)
    # Every prompt of _system_prompts_homed_on sends as many blocks as this one.
    blocks = len(prefix_keys(f"<|system|>Corpus 100. {SYSTEM}<|user|>q0", 64, 32))
    a = cluster.add_instance("--prefix-caching", "--max-concurrency", "4",
                             "--kv-capacity-tokens", str((4 + blocks - 1) * 64))
    b = cluster.add_instance("--prefix-caching", "--max-concurrency", "4")
    ids = [a.instance_id, b.instance_id]
    first = _system_prompts_homed_on(a.instance_id, ids, 2)
    prompts = first + _system_prompts_homed_on(b.instance_id, ids, 2)
    assert {len(prefix_keys(f"<|system|>{p}<|user|>q0", 64, 32)) for p in prompts} == {blocks}

    def body(system: str, n: int) -> dict[str, Any]:
        return {"model": "sim", "stream": True, "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{n}"}]}

    for n in range(40):
        served_by(cluster, body(prompts[n % 4], n))
    wait_until(lambda: _homes_moved(cluster) == 2, 10, message="both of a's prompts moved")
    time.sleep(2.5)  # more rounds move nothing back: a cannot hold a prompt
    assert _homes_moved(cluster) == 2
    assert {served_by(cluster, body(system, 100 + n)) for n, system in enumerate(first)} == {b.instance_id}


def test_the_sidecar_moves_a_prompt_home_off_the_instance_its_prompts_overload(make_cluster):
    """Three equally popular prompts whose rendezvous home is one instance: the sidecar moves one
    of them (two would overload the other instance) and every worker sends it to its new home."""
    cluster = make_cluster(workers=2, env=KV_AWARE)
    a, b = (cluster.add_instance("--prefix-caching") for _ in range(2))
    prompts = _system_prompts_homed_on(a.instance_id, [a.instance_id, b.instance_id], 3)

    def body(system: str, n: int) -> dict[str, Any]:
        return {"model": "sim", "stream": False, "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{n}"}]}

    assert {served_by(cluster, body(prompts[n % 3], n)) for n in range(36)} == {a.instance_id}
    wait_until(lambda: _homes_moved(cluster) == 1, 10, message="one prompt moved")
    time.sleep(2.5)  # more rounds move nothing more: a second move would overload b
    assert _homes_moved(cluster) == 1
    # A prompt's home is where it pays no displacement.
    homes = {system: {w: [iid for iid, row in affinity_rows(
        cluster, w, prompt=f"<|system|>{system}<|user|>x").items() if row["displace_ms"] == 0]
        for w in range(cluster.workers)} for system in prompts}
    at_b = [system for system, seen in homes.items() if seen == {0: [b.instance_id], 1: [b.instance_id]}]
    assert len(at_b) == 1, homes
    assert all(seen == {0: [a.instance_id], 1: [a.instance_id]} for system, seen in homes.items()
               if system not in at_b), homes
    assert {served_by(cluster, body(at_b[0], 100 + n)) for n in range(4)} == {b.instance_id}
