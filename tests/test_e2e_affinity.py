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

from cacheroute_proxy.affinity_keys import prefix_keys
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


@pytest.mark.parametrize("slot_guard", [True, False])
def test_the_slot_guard_sends_a_request_off_its_home_whose_engine_slots_are_all_taken(make_cluster, slot_guard):
    """Engines of one sequence slot each: while a stream holds the home's, the prediction still
    favours the home (it holds the prompt, and the held answer's predicted decode is short),
    but the request would wait there for that stream to end: with the slot guard it goes where
    a slot is free, as least_load chooses; without it, home."""
    env = {**KV_AWARE, "PROXY_KV_AWARE_SLOT_GUARD": "1" if slot_guard else "0"}
    cluster = make_cluster(workers=2, env=env)
    a, b = cluster.add_instance("--max-concurrency", "1"), cluster.add_instance("--max-concurrency", "1")
    warm = served_by(cluster, prefix_body("first"))
    cold = b.instance_id if warm == a.instance_id else a.instance_id
    wait_until(lambda: affinity_rows(cluster, 0, **prompt_query())[warm]["resident_prefix_blocks"] == 3,
               10, message="resident")
    warm_sim = a if warm == a.instance_id else b
    warm_sim.configure(hold_streams=True)

    async def scenario() -> dict[str, Any]:
        async with held_streams(warm_sim) as held:
            held += await hold(cluster, 1)
            assert held[0].response.headers["x-cacheroute-instance"] == warm
            loads = get(f"{cluster.worker_url(1)}/debug/instance_loads?{urllib.parse.urlencode(prompt_query())}")
            rows = {r["instance_id"]: r["affinity"] for r in loads["instances"]}
            assert rows[warm]["predicted_ttft_ms"]["total"] < rows[cold]["predicted_ttft_ms"]["total"]
            assert loads["kv_aware"]["guard"]["slots_taken"] == [warm]
            second = asyncio.create_task(asyncio.to_thread(ask, cluster.dp_url, prefix_body("second", stream=False)))
            if slot_guard:
                return (await second)["trace"]
            # Home: it waits there for the held stream, which ends as the sim lets it go.
            await asyncio.to_thread(wait_until, lambda: cluster.inflight()[warm] == 2, 10,
                                    message="the second request waits at home")
        return (await second)["trace"]
    trace = asyncio.run(scenario())
    assert (trace["instance_id"], trace["affinity_guard"]) == ((cold, True) if slot_guard else (warm, False))


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


def _prompt_homes(cluster) -> dict[str, Any]:
    """The sidecar's prompt homes now (/debug/status)."""
    return get(f"{cluster.cp_url}/debug/status")["event_channel"]["prompt_homes"]


def _chat(system: str, n: int) -> dict[str, Any]:
    return prefix_body(f"q{n}", stream=False, system=system)


def _first_sights(cluster, prompts: list[str]) -> list[str]:
    """Each prompt's first request, one after the other once the sidecar took the one before
    (as requests tens of milliseconds apart are): the instance each went to."""
    went = []
    for n, system in enumerate(prompts):
        went.append(served_by(cluster, _chat(system, n)))
        wait_until(lambda: _prompt_homes(cluster)["prompts"] == n + 1, 10, message="the sidecar took it")
    return went


def test_new_prompts_are_homed_by_the_work_and_every_worker_sends_each_to_its_home(make_cluster):
    """Three prompts, new to the sidecar: each first request goes to the instance it names next,
    the one furthest below its share of the work, so they split two and one without a move
    (a hash of each prompt could put all three on one instance); every worker then sends each
    prompt to its home, the one instance where it pays no displacement."""
    cluster = make_cluster(workers=2, env=KV_AWARE)
    a, b = (cluster.add_instance("--prefix-caching") for _ in range(2))
    wait_until(lambda: _prompt_homes(cluster)["next_home"] is not None, 10, message="a next home named")
    prompts = [f"Corpus {n}. " + SYSTEM for n in range(3)]
    went = _first_sights(cluster, prompts)
    assert went[1] != went[0] and sorted(map(went.count, {a.instance_id, b.instance_id})) == [1, 2], went
    for n in range(3, 36):
        assert served_by(cluster, _chat(prompts[n % 3], n)) == went[n % 3]
    wait_until(lambda: _prompt_homes(cluster)["listed"] == 3, 10, message="the homes listed")
    assert _prompt_homes(cluster)["moves"] == 0
    homes = {system: {w: [iid for iid, row in affinity_rows(
        cluster, w, **prompt_query(system)).items() if row["displace_ms"] == 0]
        for w in range(cluster.workers)} for system in prompts}
    assert homes == {system: {0: [home], 1: [home]} for system, home in zip(prompts, went)}, homes


def test_prompts_live_where_the_cache_can_hold_them(make_cluster):
    """`a` registers a KV capacity of one block beside a block for each of its 4 slots: room for
    no prompt. A prompt the sidecar homed there before it knew any prompt's size moves to `b`;
    every other is homed on `b` from its first request, and all stay there."""
    cluster = make_cluster(workers=2, env=KV_AWARE)
    a = cluster.add_instance("--prefix-caching", "--max-concurrency", "4",
                             "--kv-capacity-tokens", str((4 + 1) * 64))
    b = cluster.add_instance("--prefix-caching", "--max-concurrency", "4")
    wait_until(lambda: _prompt_homes(cluster)["next_home"] is not None, 10, message="a next home named")
    prompts = [f"Corpus {100 + n}. " + SYSTEM for n in range(4)]
    assert min(len(prefix_keys(f"<|system|>{p}", 64, 32)) for p in prompts) >= 2
    went = _first_sights(cluster, prompts)
    assert went.count(a.instance_id) <= 1, went  # once a prompt's size is known, a has no room
    for n in range(4, 40):
        served_by(cluster, _chat(prompts[n % 4], n))
    wait_until(lambda: {served_by(cluster, _chat(system, 100 + n)) for n, system in enumerate(prompts)}
               == {b.instance_id}, 10, message="every prompt served by b")
    moves = _prompt_homes(cluster)["moves"]
    time.sleep(2.5)  # more rounds move nothing back: a cannot hold a prompt
    assert _prompt_homes(cluster)["moves"] == moves
    assert {served_by(cluster, _chat(system, 200 + n)) for n, system in enumerate(prompts)} == {b.instance_id}
