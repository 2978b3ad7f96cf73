"""The scheduling brain end to end: predicted pressure from the sidecar's timelines, host-wide
READY_CONCURRENCY, knowledge injection through a simulated KDN, and a sidecar outage."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import psutil

from tests.aio import OpenStream, meta_of
from tests.harness import Process, SimKdn, chat_body, free_port, get, http, post, wait_until


def _row(cluster, instance_id: str, worker: int | None = None) -> dict:
    return {r["instance_id"]: r for r in cluster.loads(worker)["instances"]}[instance_id]


def test_seed_scenario_predicted_pressure_steers_least_load(make_cluster):
    """1 request/s of overlapping long requests: the instantaneous queue reads 0 while the
    predicted pressure does not, and least_load avoids the larger predicted backlog."""
    cluster = make_cluster(workers=2, strategy="least_load")
    a, b = cluster.add_instance(time_scale=1.0), cluster.add_instance(time_scale=1.0)

    async def scenario() -> tuple[str, str, str, list[dict]]:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            # A long prompt: ~3000 tokens of prefill (4.4 s predicted) ...
            long_req = await session.post(url, json=chat_body("x" * 12_000, max_tokens=20))
            await asyncio.sleep(1.0)
            # ... then, a second later, a short prompt with a long decode on the other instance.
            short_req = await session.post(url, json=chat_body("hi", max_tokens=150))
            await asyncio.sleep(1.0)
            rows = [_row(cluster, i.instance_id, w) for w in (0, 1) for i in (a, b)]
            third = await session.post(url, json=chat_body("hello", max_tokens=5))
            picks = [r.headers["x-cacheroute-instance"] for r in (long_req, short_req, third)]
            for r in (long_req, short_req, third):
                await r.read()
            return picks[0], picks[1], picks[2], rows

    long_on, short_on, third_on, rows = asyncio.run(scenario())
    assert long_on != short_on  # the second request avoided the busy instance (inflight)
    for row in rows:
        # Nothing waits in a queue right now ...
        assert row["prepare_queue_depth"] == 0 and row["ready_queue_depth"] == 0, row
        assert row["inflight"] == 1
    by_instance = {row["instance_id"]: row for row in rows}
    long_row, short_row = by_instance[long_on], by_instance[short_on]
    # ... but the sidecar's timeline knows one is still in a long prefill, one is decoding.
    assert long_row["pending_prefill_count"] == 1 and long_row["predicted_total_backlog_ms"] > 1000
    assert short_row["active_decode_count"] == 1 and short_row["predicted_total_backlog_ms"] < 500
    score = long_row["least_load_score"]
    assert score["weighted_components"]["predicted_total_backlog_ms"] > 1.0
    assert score["source"]["pending_prefill_count"] == "sidecar_reservation_timeline"
    # Equal inflight, equal instantaneous queue: the predicted layer decides.
    assert third_on == short_on


def test_ready_concurrency_is_host_wide(make_cluster):
    cluster = make_cluster(workers=4, env={"READY_CONCURRENCY": "2"})
    inst = cluster.add_instance("--max-concurrency", "8")

    async def scenario() -> list[int]:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"

            async def one(n: int) -> int:
                async with session.post(url, json=chat_body(f"q{n}", max_tokens=6)) as resp:
                    await resp.read()
                    return resp.status
            return await asyncio.gather(*(one(n) for n in range(24)))

    statuses = asyncio.run(scenario())
    assert statuses == [200] * 24
    stats = inst.stats()
    assert stats["max_active"] == 2, stats  # reached, and never exceeded, across 4 workers
    assert stats["total"] == 24
    wait_until(lambda: all(_row(cluster, inst.instance_id, w)["active_ready"] == 0
                           and _row(cluster, inst.instance_id, w)["inflight"] == 0 for w in range(4)),
               5, message="lanes back to 0")


def test_sidecar_outage_pressure_goes_stale_routing_goes_on(make_cluster):
    cluster = make_cluster(workers=2, strategy="least_load",
                           env={"PROXY_SNAPSHOT_STALE_MS": "400", "PROXY_WORKER_RESTART_BACKOFF_S": "2"})
    inst = cluster.add_instance("--hold-streams", "--heartbeat-interval", "0.5")
    sidecar_pid = cluster.status()["sidecar"]["pid"]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            held = [await OpenStream.open(session, url, chat_body()) for _ in range(2)]
            wait_until(lambda: _row(cluster, inst.instance_id, 0)["active_decode_count"] == 2, 3,
                       message="decoding seen by the timeline")
            os.kill(sidecar_pid, signal.SIGKILL)
            report = wait_until(lambda: (r := cluster.loads(0))["metric_source"]["predicted_pressure"] == "stale"
                                and r, 3, message="pressure reported stale")
            row = report["instances"][0]
            assert row["pending_prefill_count"] is None and row["active_decode_count"] is None
            assert row["inflight"] == 2 and row["least_load_score"]["total"] is not None
            inst.configure(hold_streams=False)
            status, body, _ = http("POST", url, chat_body(stream=False))  # routing goes on
            assert status == 200, body
            # The supervisor restarts the sidecar; the workers re-announce their live requests.
            wait_until(lambda: cluster.status()["sidecar"]["pid"] != sidecar_pid, 10, message="restarted")
            wait_until(lambda: cluster.loads(1)["metric_source"]["predicted_pressure"] == "fresh"
                       and _row(cluster, inst.instance_id, 1)["active_decode_count"] == 2, 5,
                       message="pressure back, rebuilt from the requests in flight")
            channel = cluster.status()["event_channel"]
            assert channel["epoch"] == 2 and channel["decoding"] == 2
            inst.release()
            await asyncio.gather(*(s.finish() for s in held))

    asyncio.run(scenario())
    wait_until(lambda: cluster.status()["event_channel"]["decoding"] == 0, 5, message="drained")


def test_knowledge_text_and_kvcache_paths(make_cluster, tmp_path):
    kdn_port = free_port()
    kdn = Process(["-m", "cacheroute_sim.kdn", "--port", str(kdn_port), "--time-scale", "0.05"], {},
                  tmp_path / "kdn.log")
    try:
        wait_until(lambda: get(f"http://127.0.0.1:{kdn_port}/healthz", timeout=1), 15, message="kdn up")
        cluster = make_cluster(workers=2)
        inst = cluster.add_instance()
        store = get(f"http://127.0.0.1:{kdn_port}/sim/stats")
        assert store  # the KDN answers its stats
        body = {"Request_ID": 7, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 3,
                                            "max_tokens": 4, "stream": True},
                "Service": {"Enable_know_injection": True, "Injection_type": "text",
                            "Knowledge_List": ["K0000", "k0001", "nope"], "Knowledge_length": 600},
                "Task": {"KDN_server_addr": f"127.0.0.1:{kdn_port}"}}
        status, text, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=20)
        meta = meta_of(text.encode())
        assert status == 200 and meta["error"] is None, meta
        assert meta["miss_kids"] == ["nope"]
        assert sorted(meta["kv_ready_kids"] + meta["text_only_kids"]) == ["K0000", "k0001"]
        assert meta["trace"]["injection_mode"] == "text" and meta["kv_ack"] == {}

        body["Service"]["Injection_type"] = "kvcache"
        status, text, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=20)
        meta = meta_of(text.encode())
        assert status == 200 and meta["error"] is None, meta
        if meta["kv_ready_kids"]:
            assert meta["kv_ack"]["ok"] is True and meta["trace"]["kvcache_actual_path"] == "kv_injected"
            assert inst.stats()["kv_injects"] == 1 and inst.stats()["kv_prefix_hits"] == 1
        else:
            assert meta["kv_ack"]["detail"] == "no kv_ready_kids"
        assert "predict_error_ms" in meta["trace"] and "predict_service_ms" in meta["trace"]

        # The KDN down: the request still succeeds, without knowledge, and says why.
        kdn.stop()
        status, text, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", body, timeout=20)
        meta = meta_of(text.encode())
        assert status == 200 and meta["error"].startswith("prepare_failed"), meta
        assert cluster.inflight()[inst.instance_id] == 0
    finally:
        kdn.stop()


def test_queue_bound_answers_429_with_retry_after(make_cluster):
    cluster = make_cluster(workers=1, env={"READY_CONCURRENCY": "1", "PROXY_MAX_QUEUE_PER_INSTANCE": "2"})
    inst = cluster.add_instance("--hold-streams")

    async def scenario() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            first = await OpenStream.open(session, url, chat_body())  # admitted, held
            waiting = [asyncio.ensure_future(session.post(url, json=chat_body())) for _ in range(2)]
            await asyncio.sleep(0.5)
            async with session.post(url, json=chat_body()) as refused:
                result = [(refused.status, refused.headers.get("Retry-After"))]
                await refused.read()
            assert _row(cluster, inst.instance_id)["ready_queue_depth"] == 2
            inst.configure(hold_streams=False)
            inst.release()
            await first.finish()
            for w in waiting:
                response = await w
                result.append((response.status, None))
                await response.read()
            return result

    outcome = asyncio.run(scenario())
    assert outcome[0] == (429, "1")
    assert [s for s, _ in outcome[1:]] == [200, 200]
    wait_until(lambda: _row(cluster, inst.instance_id)["inflight"] == 0
               and _row(cluster, inst.instance_id)["ready_queue_depth"] == 0, 5, message="drained")


def test_admission_wait_has_a_deadline(make_cluster):
    cluster = make_cluster(workers=1, env={"READY_CONCURRENCY": "1", "PROXY_QUEUE_TIMEOUT_S": "1"})
    inst = cluster.add_instance("--hold-streams")

    async def scenario() -> tuple[int, str | None, dict]:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            held = await OpenStream.open(session, url, chat_body())
            started = time.monotonic()
            async with session.post(url, json=chat_body()) as waited:
                body = await waited.json()
                outcome = (waited.status, waited.headers.get("Retry-After"), body)
            assert 0.9 < time.monotonic() - started < 5
            inst.release()
            await held.finish()
            return outcome

    status, retry_after, body = asyncio.run(scenario())
    assert (status, retry_after, body["error"]) == (503, "2", "queue_timeout")
    wait_until(lambda: _row(cluster, inst.instance_id)["inflight"] == 0
               and _row(cluster, inst.instance_id)["ready_queue_depth"] == 0
               and _row(cluster, inst.instance_id)["active_ready"] == 0, 5, message="nothing leaked")


def test_text_bypass_is_seen_in_the_meta(make_cluster, tmp_path):
    """A kvcache request whose KV pull hangs at the KDN blocks its instance's release order; a
    text request behind it passes it (text_bypass), and each meta says how it was released."""
    kdn = SimKdn(tmp_path)
    try:
        kid = kdn.kv_ready_id()
        kdn.hang_injects()
        cluster = make_cluster(workers=1, env={"PROXY_READY_RELEASE_POLICY": "text_bypass"})
        cluster.add_instance()

        def body(injection: str) -> dict:
            return {"Request_ID": 9, "Prompt": {"model": "m", "user_prompt": "Who?", "token_length": 3,
                                                "max_tokens": 2, "stream": True},
                    "Service": {"Enable_know_injection": True, "Injection_type": injection,
                                "Knowledge_List": [kid], "Knowledge_length": 600},
                    "Task": {"KDN_server_addr": kdn.addr}}

        async def scenario() -> tuple[dict, dict]:
            url = f"{cluster.dp_url}/v1/chat/completions"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                head = asyncio.create_task(session.post(url, json=body("kvcache")))
                await asyncio.to_thread(wait_until, lambda: kdn.held() == 1, 10,
                                        message="the KV pull hangs at the KDN")
                async with session.post(url, json=body("text")) as passing:
                    text_meta = meta_of(await passing.read())
                kdn.release()
                async with await head as blocked:
                    return meta_of(await blocked.read()), text_meta

        kv_meta, text_meta = asyncio.run(scenario())
        kv, text = kv_meta["trace"], text_meta["trace"]
        assert (kv["prepare_seq"], text["prepare_seq"]) == (1, 2)
        assert (text["ready_release_seq"], text["ready_release_policy"], text["ready_bypass"],
                text["ready_blocked_seq"]) == (1, "text_bypass", True, 1)
        assert (kv["ready_release_seq"], kv["ready_bypass"]) == (2, False) and "ready_blocked_seq" not in kv
        assert text["forward_end_ms"] < kv["ready_enqueue_ms"]  # it was served while the head waited
    finally:
        kdn.stop()


def test_a_worker_holding_a_quiet_stream_barely_wakes(make_cluster):
    """A stream the instance holds writes no event: the worker's event channel ticks twice a
    second for it (to re-announce it to a restarted sidecar), not fifty times."""
    cluster = make_cluster(workers=1, strategy="least_load")
    inst = cluster.add_instance("--hold-streams")
    worker = psutil.Process(cluster.worker_pids()[0])

    async def scenario() -> int:
        async with aiohttp.ClientSession() as session:
            held = await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
            await asyncio.to_thread(wait_until, lambda: _row(cluster, inst.instance_id)["active_decode_count"] == 1,
                                    5, message="the stream decoding")
            await asyncio.sleep(0.5)
            before = worker.num_ctx_switches().voluntary
            await asyncio.sleep(3.0)
            woke = worker.num_ctx_switches().voluntary - before
            inst.release()
            await held.finish()
            return woke

    assert asyncio.run(scenario()) <= 30  # a tick every 20 ms: 150 and more


def test_a_place_freed_by_one_worker_rings_the_worker_whose_request_waits_for_it(make_cluster):
    """READY_CONCURRENCY is host-wide: worker 0 holds the one ready place, worker 1's request
    waits for it. The waiting head tries a few times a second, not every few ms; when worker 0
    frees the place it rings worker 1's bell and the request is admitted."""
    cluster = make_cluster(workers=2, env={"PROXY_INSTANCE_STRATEGY": "least_load", "READY_CONCURRENCY": "1"})
    inst = cluster.add_instance("--hold-streams", time_scale=0.001)

    def admission(worker: int) -> dict:
        return get(f"{cluster.worker_url(worker)}/healthz")["admission"]

    async def scenario() -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as session:
            held = await OpenStream.open(session, f"{cluster.worker_url(0)}/v1/chat/completions", chat_body())
            queued = asyncio.ensure_future(session.post(f"{cluster.worker_url(1)}/v1/chat/completions",
                                                        json=chat_body(stream=False)))
            await asyncio.to_thread(wait_until, lambda: _row(cluster, inst.instance_id)["ready_queue_depth"] == 1,
                                    10, message="worker 1's request waits for the ready place")
            tries = admission(1)["tries"]
            await asyncio.sleep(1.5)
            waited = admission(1)["tries"] - tries
            inst.release()
            await held.finish()
            answer = await asyncio.wait_for(queued, 10)
            await answer.read()
            return answer.status, {"tries while waiting 1.5 s": waited}, {**admission(0), "w1": admission(1)}

    status, waited, bells = asyncio.run(scenario())
    assert status == 200
    assert waited["tries while waiting 1.5 s"] <= 25, waited  # polling every 5 ms: about 300
    assert bells["rings_sent"] >= 1 and bells["w1"]["rings_heard"] >= 1, bells


def test_a_quiet_sidecar_republishes_four_times_per_staleness_bound(make_cluster):
    """With nothing to report, the sidecar wakes only for its snapshot heartbeat, every quarter
    of PROXY_SNAPSHOT_STALE_MS: a few publishes a second, and a worker never reads it as stale."""
    cluster = make_cluster(workers=1, env={"PROXY_INSTANCE_STRATEGY": "least_load",
                                           "PROXY_SNAPSHOT_STALE_MS": "1200"})
    cluster.add_instance()
    wait_until(lambda: cluster.status()["event_channel"]["doorbell"]["sleeping"], 10,
               message="the idle sidecar asleep")
    published = cluster.status()["event_channel"]["snapshots_published"]
    started, ages = time.monotonic(), []
    while time.monotonic() - started < 3.0:
        ages.append(cluster.loads(0)["snapshot_age_ms"])
        time.sleep(0.05)
    window = time.monotonic() - started
    published = cluster.status()["event_channel"]["snapshots_published"] - published
    assert all(age is not None and age < 1200 for age in ages), ages
    assert 3 <= published <= window / 0.3 + 2, published


def test_an_idle_sidecar_sleeps_and_a_request_rings_it_awake(make_cluster):
    """At rest the sidecar stops polling the rings (its doorbell says it sleeps); a request's
    events ring it, and its timeline hears of the request: the snapshot goes on being fresh."""
    cluster = make_cluster(workers=2, env={"PROXY_INSTANCE_STRATEGY": "least_load"})
    cluster.add_instance()

    def doorbell() -> dict:
        return cluster.status()["event_channel"]["doorbell"]
    wait_until(lambda: doorbell()["sleeping"], 10, message="the idle sidecar asleep")
    rings, consumed = doorbell()["rings"], cluster.status()["event_channel"]["events_consumed"]
    assert http("POST", f"{cluster.worker_url(1)}/v1/chat/completions", chat_body())[0] == 200
    wait_until(lambda: doorbell()["rings"] > rings, 10, message="a worker rang")
    # reserve, first token, complete: each taken, none left waiting for a periodic wake
    wait_until(lambda: cluster.status()["event_channel"]["events_consumed"] >= consumed + 3, 10,
               message="the request's events consumed")
