"""kv_aware's claims end to end: a routing decision is pending residency for every worker at
once (so sequential repeats inject or prefill once), a request waits for the pull another claim
is making, and a claim goes when it stops being true (a failed inject as its prepare stage
ends; what the index never confirms, evicted first, ACKNOWLEDGED_CLAIM_S after the ack or the
answer).

Real clusters (sidecar + workers), simulated instances and a simulated KDN
(tests/affinity_cluster.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.affinity_cluster import (KV_AWARE, Kdn, affinity_rows, ask, held_streams, hold, knowledge_body,
                                    prefix_body, prompt_query, resident_everywhere, served_by)
from tests.aio import OpenStream, meta_of
from tests.harness import get, post, wait_until


@pytest.mark.parametrize("tokens", [1000, 100], ids=["chunks", "shorter_than_a_chunk"])
def test_sequential_repeats_of_one_knowledge_id_inject_it_once(make_cluster, tmp_path, tokens):
    """Also knowledge shorter than one KV chunk (no aligned tokens: the instance pulls its KV all
    the same), whose acknowledged inject the index once did not record."""
    kdn = Kdn(tmp_path)
    try:
        cluster = make_cluster(workers=4, env=KV_AWARE)
        cluster.add_instance()
        cluster.add_instance()
        served = [ask(cluster.dp_url, knowledge_body(kdn, ["k0007"], tokens))["trace"]["instance_id"]
                  for _ in range(12)]
        assert len(set(served)) == 1, served
        assert kdn.injects() == 1 and sum(i.stats()["kv_injects"] for i in cluster.instances) == 1
    finally:
        kdn.stop()


def test_sequential_repeats_of_one_system_prompt_are_prefilled_once(make_cluster):
    cluster = make_cluster(workers=4, env=KV_AWARE)
    for _ in range(2):
        cluster.add_instance("--prefix-caching")
    served = [served_by(cluster, prefix_body(f"question {i}")) for i in range(12)]
    assert len(set(served)) == 1, served
    stats = {i.instance_id: i.stats() for i in cluster.instances}
    holder = stats[served[0]]
    # The first request computed the system prompt; the other eleven found it cached.
    assert holder["prefix_cache_hits"] >= 11 * 128, holder
    assert sum(s["prefix_cache_queries"] for iid, s in stats.items() if iid != served[0]) == 0


def test_a_routing_decision_is_pending_for_every_worker_at_once_until_the_ack_confirms_it(make_cluster, tmp_path):
    kdn = Kdn(tmp_path)
    try:
        # The KDN holds the inject until released: the window between the choice and the ack.
        post(f"http://{kdn.addr}/sim/config", {"hang": True, "fault_on": "inject"})
        cluster = make_cluster(workers=4, env=KV_AWARE)
        a, b = cluster.add_instance(), cluster.add_instance()

        def pending_on() -> dict[str, list[str]]:
            """Per worker, the instances that hold k0009 pending."""
            return {w: sorted(iid for iid, row in affinity_rows(cluster, w, knowledge="k0009").items()
                              if row["pending_knowledge"] == ["k0009"]) for w in range(cluster.workers)}

        async def scenario() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                request = asyncio.ensure_future(session.post(f"{cluster.worker_url(0)}/v1/chat/completions",
                                                             json={**knowledge_body(kdn, ["k0009"])}))
                await asyncio.to_thread(wait_until, lambda: get(f"http://{kdn.addr}/sim/stats")["held"] == 1,
                                        10, message="the inject held at the KDN")
                seen = pending_on()
                post(f"http://{kdn.addr}/sim/release", {})
                response = await request
                text = await response.read()
                return {"seen": seen, "meta": meta_of(text)}
        outcome = asyncio.run(scenario())
        chosen = outcome["meta"]["trace"]["instance_id"]
        # While the inject was in flight, every worker already saw the decision.
        assert outcome["seen"] == {w: [chosen] for w in range(cluster.workers)}
        # Confirmed by the index once the inject was acknowledged: resident, no longer pending.
        wait_until(lambda: resident_everywhere(cluster, chosen, ["k0009"]), 10, message="confirmed")
        assert pending_on() == {w: [] for w in range(cluster.workers)}
        assert {a.instance_id, b.instance_id} >= {chosen}
    finally:
        kdn.stop()


def test_a_request_whose_knowledge_another_is_pulling_there_waits_for_that_pull(make_cluster, tmp_path):
    """Two requests for one id on two workers: the second goes where the first's pull is in
    flight (its claim) and waits for it instead of pulling the same KV again."""
    kdn = Kdn(tmp_path)
    try:
        post(f"http://{kdn.addr}/sim/config", {"hang": True, "fault_on": "inject"})
        cluster = make_cluster(workers=2, env=KV_AWARE)
        cluster.add_instance()
        cluster.add_instance()
        held = lambda: get(f"http://{kdn.addr}/sim/stats")["held"]  # noqa: E731

        async def scenario() -> list[dict[str, Any]]:
            async with aiohttp.ClientSession() as session:
                async def ask_via(worker: int) -> dict[str, Any]:
                    async with session.post(f"{cluster.worker_url(worker)}/v1/chat/completions",
                                            json=knowledge_body(kdn, ["k0013"])) as response:
                        return meta_of(await response.read())
                first = asyncio.ensure_future(ask_via(0))
                await asyncio.to_thread(wait_until, lambda: held() == 1, 10, message="the first pull held")
                # Priced by predicted TTFT (a fresh snapshot), not by least_load's inflight alone.
                await asyncio.to_thread(wait_until, lambda: all(
                    row["predicted_ttft_ms"]["total"] is not None
                    for row in affinity_rows(cluster, 1, knowledge="k0013").values()), 10, message="predicted")
                second = asyncio.ensure_future(ask_via(1))
                await asyncio.sleep(0.3)  # well inside its wait: twice the ~0.9 s transfer predicted
                assert held() == 1 and not second.done()
                post(f"http://{kdn.addr}/sim/release", {})
                return [await first, await second]
        first, second = asyncio.run(scenario())
        assert first["trace"]["instance_id"] == second["trace"]["instance_id"]
        assert first["trace"]["kvcache_actual_path"] == "kv_injected"
        assert second["trace"]["kvcache_actual_path"] == "kv_resident"
        assert kdn.injects() == 1
    finally:
        kdn.stop()


def test_a_failed_inject_withdraws_the_claim_as_its_prepare_stage_ends(make_cluster, tmp_path):
    """Withdrawn while its request still streams, not when the answer ends: no other request is
    routed to, or waits on, a pull that is not coming."""
    kdn = Kdn(tmp_path)
    try:
        post(f"http://{kdn.addr}/sim/config", {"fail_status": 503, "fault_on": "inject"})
        cluster = make_cluster(workers=2, env=KV_AWARE)
        for _ in range(2):
            cluster.add_instance("--stall-after-chunks", "1")

        async def views_while_streaming() -> list[dict[str, dict[str, Any]]]:
            async with aiohttp.ClientSession() as session:
                stream = await OpenStream.open(session, f"{cluster.worker_url(0)}/v1/chat/completions",
                                               knowledge_body(kdn, ["k0011"]))
                try:
                    assert stream.response.status == 200 and stream.received
                    views = await asyncio.to_thread(lambda: [affinity_rows(cluster, w, knowledge="k0011")
                                                             for w in range(cluster.workers)])
                    assert not stream.response.content.at_eof()  # the request still holds its lease
                    return views
                finally:
                    stream.close()
        views = asyncio.run(views_while_streaming())
        assert get(f"http://{kdn.addr}/sim/stats")["failed"] == 1  # the one inject failed
        for rows in views:
            assert all(r["pending_knowledge"] == [] and r["resident_knowledge"] == [] for r in rows.values()), rows
    finally:
        kdn.stop()


def test_an_acknowledged_claim_the_index_never_confirms_stops_drawing_requests(make_cluster, tmp_path):
    """The instance acknowledged the inject, but the knowledge does not fit its KV (the model
    evicts it at once): the claim goes within ACKNOWLEDGED_CLAIM_S, not after
    PROXY_AFFINITY_PENDING_S, so no request is sent there for KV it no longer holds."""
    kdn = Kdn(tmp_path)
    try:
        # meta.kv_mem_gb 0.48828125 x 1024 / 1 MB a token = 500 tokens: less than the id's 1000.
        cluster = make_cluster(workers=2, env={**KV_AWARE, "PROXY_AFFINITY_KV_MB_PER_TOKEN": "1"})
        inst = cluster.add_instance("--kv-mem-gb", "0.48828125")
        meta = ask(cluster.worker_url(0), knowledge_body(kdn, ["k0021"]))
        assert meta["kv_ack"]["ok"] is True and meta["trace"]["kvcache_actual_path"] == "kv_injected"

        def held_or_claimed() -> list[tuple[list[str], list[str]]]:
            rows = [affinity_rows(cluster, w, knowledge="k0021")[inst.instance_id] for w in range(cluster.workers)]
            return [(row["resident_knowledge"], row["pending_knowledge"]) for row in rows]
        wait_until(lambda: held_or_claimed() == [([], [])] * cluster.workers, 5,
                   message="neither resident nor claimed")
    finally:
        kdn.stop()


def test_a_prefix_is_resident_once_sent_not_once_its_answer_ends(make_cluster):
    """vLLM keeps a prompt's blocks as soon as its prefill computed them: requests sharing the
    prefix that arrive while the first one's answer is still streaming must see it resident."""
    cluster = make_cluster(workers=2, env=KV_AWARE)
    inst = cluster.add_instance()
    inst.configure(hold_streams=True)

    def resident_blocks(worker: int) -> int:
        return affinity_rows(cluster, worker, **prompt_query())[inst.instance_id]["resident_prefix_blocks"]

    async def scenario() -> None:
        async with held_streams(inst) as held:
            held += await hold(cluster, 1)  # its first chunk arrived; the rest of the answer is held
            for worker in range(cluster.workers):
                wait_until(lambda: resident_blocks(worker) == 3, 10,
                           message=f"worker {worker} sees the prefix resident while its answer streams")
    asyncio.run(scenario())


def test_a_taken_prompt_the_index_never_confirms_stops_drawing_requests(make_cluster):
    """The instance took the prompt, but its blocks do not fit its cache (the model evicts them
    at once): the claim goes ACKNOWLEDGED_CLAIM_S after the answer, not after
    PROXY_AFFINITY_PENDING_S."""
    # meta.kv_mem_gb 0.09765625 x 1024 / 1 MB a token = 100 tokens: less than one 64-token block x 3.
    cluster = make_cluster(workers=2, env={**KV_AWARE, "PROXY_AFFINITY_KV_MB_PER_TOKEN": "1"})
    inst = cluster.add_instance("--kv-mem-gb", "0.09765625")
    assert served_by(cluster, prefix_body("first")) == inst.instance_id

    def held_or_claimed() -> list[tuple[int, int]]:
        rows = [affinity_rows(cluster, w, **prompt_query())[inst.instance_id] for w in range(cluster.workers)]
        return [(row["resident_prefix_blocks"], row["pending_prefix_blocks"]) for row in rows]
    wait_until(lambda: held_or_claimed() == [(0, 0)] * cluster.workers, 5, message="neither resident nor claimed")
