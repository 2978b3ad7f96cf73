"""Inflight seen by every worker, and returned to 0 on every way a request can end.

Real launcher, sidecar, 4 workers and simulated instances; streams are held open by the
instance (`hold_streams`) so the counts can be read while they are in flight.
"""

from __future__ import annotations

import asyncio

import aiohttp

from cacheroute_sim.scheduler.requests import scheduler_body
from tests.aio import OpenStream, get_json, meta_of
from tests.harness import SimKdn, chat_body, get, http, post, wait_until

K = 6
# Characters of one large message: far past the read high-water mark of the worker's server
# (64 KiB), where reading pauses until the body is taken.
LARGE = 1_000_000


def test_every_worker_sees_k_held_streams_then_zero(make_cluster):
    cluster = make_cluster(workers=4)
    inst = cluster.add_instance("--hold-streams")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = await asyncio.gather(*(
                OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
                for _ in range(K)))
            assert all(s.response.status == 200 for s in streams)
            for worker in range(cluster.workers):
                loads = await get_json(session, f"{cluster.worker_url(worker)}/debug/instance_loads")
                assert loads["answered_by"]["worker_index"] == worker
                row = {r["instance_id"]: r for r in loads["instances"]}[inst.instance_id]
                assert row["inflight"] == K, (worker, row)
                assert row["least_load_score"]["components"]["inflight"] == K
            inst.release()
            bodies = await asyncio.gather(*(s.finish() for s in streams))
            for body in bodies:
                assert body.endswith(b"data: [DONE]\n\n")
                assert meta_of(body)["error"] is None

    asyncio.run(scenario())
    for worker in range(cluster.workers):
        wait_until(lambda w=worker: cluster.inflight(w)[inst.instance_id] == 0, 5,
                   message=f"worker {worker} inflight back to 0")
    assert cluster.inflight()[inst.instance_id] == 0


def test_quiescent_workers_agree(make_cluster):
    cluster = make_cluster(workers=3)
    cluster.add_instance()
    cluster.add_instance()
    for _ in range(6):
        assert http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))[0] == 200
    # Quiescent: no request in flight and the sidecar has consumed every completion event.
    wait_until(lambda: cluster.status()["event_channel"]["pending_reservations"] == 0
               and cluster.status()["event_channel"]["decoding"] == 0, 5, message="timelines drained")

    def agree() -> bool:
        reports = [cluster.loads(w) for w in range(cluster.workers)] + [cluster.loads()]
        rows = [[{k: v for k, v in row.items() if k != "last_seen_ms"} for row in r["instances"]]
                for r in reports]
        assert {r["answered_by"].get("worker_index") for r in reports} == {0, 1, 2, None}
        return all(r == rows[0] for r in rows)

    wait_until(agree, 5, message="every worker and the control plane report the same rows")


def test_slot_reuse_stale_ends_are_noops(make_cluster):
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance("--hold-streams")
    old_generation = _row(cluster, inst.instance_id)["slot_generation"]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            old = [await OpenStream.open(session, url, chat_body()) for _ in range(3)]
            assert _row(cluster, inst.instance_id)["inflight"] == 3
            # The operator removes the instance and it registers again: a new generation.
            assert post(f"{cluster.cp_url}/v1/instance/unregister", {"instance_id": inst.instance_id})["ok"]
            post(f"{cluster.cp_url}/v1/instance/register",
                 {"instance_id": inst.instance_id, "host": "127.0.0.1", "port": inst.port})
            fresh = _row(cluster, inst.instance_id)
            assert fresh["slot_generation"] != old_generation and fresh["inflight"] == 0
            new = [await OpenStream.open(session, url, chat_body()) for _ in range(2)]
            assert _row(cluster, inst.instance_id)["inflight"] == 2
            inst.release()
            await asyncio.gather(*(s.finish() for s in old + new))

    asyncio.run(scenario())
    wait_until(lambda: _row(cluster, inst.instance_id)["inflight"] == 0, 5, message="inflight 0")
    status = cluster.status()
    assert status["segment"]["reconcile_corrections"] == 0


def test_client_disconnect_mid_stream_releases(make_cluster):
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance("--hold-streams")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = [await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
                       for _ in range(3)]
            assert _row(cluster, inst.instance_id)["inflight"] == 3
            for s in streams:
                s.close()

    asyncio.run(scenario())
    wait_until(lambda: _row(cluster, inst.instance_id)["inflight"] == 0, 3, message="inflight 0")
    # The proxy closed its upstream connections too: the instance stopped generating.
    wait_until(lambda: inst.stats()["disconnected"] == 3 and inst.stats()["active"] == 0, 3,
               message="instance saw the disconnects")


def test_a_client_that_leaves_a_large_request_during_relay_releases_it(make_cluster):
    """1 MB messages: a stream whose client leaves after its first bytes, and a non-streaming
    request whose client leaves while the instance has not answered. Each is released at once
    and its upstream connection closed, as with a small body."""
    cluster = make_cluster(workers=2)
    # A 1 MB prompt is 250,000 tokens: time scale 0.001 keeps its simulated prefill short.
    inst = cluster.add_instance("--hold-streams", time_scale=0.001)
    url = f"{cluster.dp_url}/v1/chat/completions"

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            stream = await OpenStream.open(session, url, chat_body("s" * LARGE))
            assert stream.response.status == 200 and stream.received
            assert _row(cluster, inst.instance_id)["inflight"] == 1
            stream.close()
            await asyncio.to_thread(_released, cluster, inst, disconnected=1)

            inst.configure(hang=True)  # accepted, never answered
            whole = asyncio.ensure_future(session.post(url, json=chat_body("w" * LARGE, stream=False)))
            await asyncio.to_thread(wait_until, lambda: inst.stats()["inflight"] == 1, 10,
                                    message="the instance has the request")
            assert _row(cluster, inst.instance_id)["inflight"] == 1
            whole.cancel()  # the client goes away
            await asyncio.to_thread(_released, cluster, inst, disconnected=2)

    asyncio.run(scenario())


def test_a_client_that_leaves_a_large_request_while_it_waits_releases_it(make_cluster, tmp_path):
    """1 MB requests whose clients leave while they wait: one in the ready queue behind a held
    stream (READY_CONCURRENCY=1), one in prepare while its KV pull hangs at the KDN. Each
    leaves its lane at once and never reaches the instance."""
    kdn = SimKdn(tmp_path)
    try:
        kid = kdn.kv_ready_id()
        kdn.hang_injects()
        cluster = make_cluster(workers=1, env={"READY_CONCURRENCY": "1"})
        inst = cluster.add_instance("--hold-streams", time_scale=0.001)
        url = f"{cluster.dp_url}/v1/chat/completions"
        kvcache = scheduler_body(5, user_prompt="k" * LARGE)
        kvcache["Service"].update(Enable_know_injection=True, Injection_type="kvcache",
                                  Knowledge_List=[kid], Knowledge_length=600)
        kvcache["Task"]["KDN_server_addr"] = kdn.addr

        def lanes() -> dict:
            row = _row(cluster, inst.instance_id)
            return {k: row[k] for k in ("inflight", "active_prepare", "prepare_queue_depth",
                                        "active_ready", "ready_queue_depth")}

        held_only = {"inflight": 1, "active_prepare": 0, "prepare_queue_depth": 0,
                     "active_ready": 1, "ready_queue_depth": 0}

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                held = await OpenStream.open(session, url, chat_body())  # the one ready place
                queued = asyncio.ensure_future(session.post(url, json=chat_body("q" * LARGE)))
                await asyncio.to_thread(wait_until, lambda: lanes()["ready_queue_depth"] == 1, 10,
                                        message="the large request queued")
                queued.cancel()
                await asyncio.to_thread(wait_until, lambda: lanes() == held_only, 3,
                                        message="the queued request gone")

                preparing = asyncio.ensure_future(session.post(url, json=kvcache))
                await asyncio.to_thread(wait_until, lambda: kdn.held() == 1
                                        and lanes()["active_prepare"] == 1, 10,
                                        message="the KV pull hangs at the KDN")
                preparing.cancel()
                await asyncio.to_thread(wait_until, lambda: lanes() == held_only, 3,
                                        message="the preparing request gone")
                kdn.release()
                inst.release()
                await held.finish()

        asyncio.run(scenario())
        wait_until(lambda: lanes() == dict.fromkeys(held_only, 0), 5, message="every lane 0")
        assert inst.stats()["total"] == 1  # only the held stream reached the instance
    finally:
        kdn.stop()


def _released(cluster, inst, disconnected: int) -> None:
    """Inflight back to 0 within 3 s, and the instance saw `disconnected` disconnects."""
    wait_until(lambda: _row(cluster, inst.instance_id)["inflight"] == 0, 3, message="inflight 0")
    wait_until(lambda: inst.stats()["disconnected"] == disconnected and inst.stats()["active"] == 0,
               3, message="the instance saw the disconnect")


def test_upstream_errors_keep_status_and_release(make_cluster):
    cluster = make_cluster(workers=2, env={"PROXY_UPSTREAM_FIRST_BYTE_TIMEOUT_S": "1",
                                           "PROXY_UPSTREAM_IDLE_TIMEOUT_S": "1"})
    inst = cluster.add_instance()
    chat = f"{cluster.dp_url}/v1/chat/completions"

    inst.configure(fail_status=503, fail_rate=1.0)
    status, body, headers = http("POST", chat, chat_body())
    assert status == 503 and body["error"]["code"] == 503, body
    assert headers["x-cacheroute-instance"] == inst.instance_id
    status, body, _ = http("POST", f"{cluster.dp_url}/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 503
    inst.configure(fail_status=None)

    inst.configure(hang=True)
    status, body, _ = http("POST", chat, chat_body(), timeout=10)
    assert status == 504 and body["error"] == "upstream_timeout", body
    inst.configure(hang=False)

    inst.configure(stall_after_chunks=2)
    status, text, _ = http("POST", chat, chat_body(max_tokens=6), timeout=10)
    assert status == 200 and "upstream_idle_timeout" in meta_of(text.encode())["error"]
    assert not text.endswith("data: [DONE]\n\n")
    inst.configure(stall_after_chunks=None)

    inst.configure(drop_after_chunks=2)
    status, text, _ = http("POST", chat, chat_body(max_tokens=6), timeout=10)
    assert status == 200 and meta_of(text.encode())["error"].startswith("upstream_failed")
    inst.configure(drop_after_chunks=None)

    status, body, _ = http("POST", chat, chat_body(stream=False))
    assert status == 200 and body["_cacheroute_meta"]["error"] is None
    wait_until(lambda: all(cluster.inflight(w)[inst.instance_id] == 0 for w in range(2)), 5,
               message="inflight 0 on every worker")
    inst.release()


def test_instance_down_is_502_and_releases(make_cluster):
    cluster = make_cluster(workers=1)
    inst = cluster.add_instance()
    inst.stop()  # unregisters on SIGTERM; register a dead address by hand instead
    post(f"{cluster.cp_url}/v1/instance/register",
         {"instance_id": "ghost", "host": "127.0.0.1", "port": inst.port})
    status, body, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body())
    assert status == 502 and body["error"] == "upstream_unavailable", body
    assert cluster.inflight()["ghost"] == 0


def _row(cluster, instance_id: str) -> dict:
    return {r["instance_id"]: r for r in get(f"{cluster.cp_url}/debug/instance_loads")["instances"]}[instance_id]
