"""Processes that die: a worker SIGKILLed with open streams, a sidecar killed and restarted,
the launcher's Ctrl-C leaving nothing behind, and a launcher that sleeps until a child dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import psutil

from tests.aio import OpenStream
from tests.harness import chat_body, get, http, wait_until


def test_sigkill_worker_with_open_streams(make_cluster):
    cluster = make_cluster(workers=4)
    inst = cluster.add_instance("--hold-streams")
    pids = cluster.worker_pids()
    per_worker = {0: 1, 1: 2, 2: 1, 3: 0}

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = []
            for worker, count in per_worker.items():
                for _ in range(count):
                    streams.append(await OpenStream.open(
                        session, f"{cluster.worker_url(worker)}/v1/chat/completions", chat_body()))
            assert cluster.inflight()[inst.instance_id] == 4
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            wait_until(lambda: cluster.inflight()[inst.instance_id] == 2, 2.0,
                       message="counts drop by exactly the dead worker's share")
            assert time.monotonic() - killed_at < 2.0
            wait_until(lambda: cluster.worker_pids()[1] != pids[1], 2.0 - (time.monotonic() - killed_at) + 1.0,
                       message="launcher replaced worker 1")
            # Every worker, including the replacement, reads the same corrected count.
            for worker in range(cluster.workers):
                assert cluster.inflight(worker)[inst.instance_id] == 2
            inst.release()
            for s in streams:
                try:
                    await s.finish(10)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass  # the dead worker's clients see their connection cut

    asyncio.run(scenario())
    wait_until(lambda: cluster.inflight()[inst.instance_id] == 0, 5, message="inflight 0")
    status = cluster.status()
    assert status["reaper"]["reaped"] == 1 and status["reaper"]["subtracted"] == 2, status["reaper"]
    assert len(status["workers"]) == 4 and all(w["alive"] for w in status["workers"])


def test_a_worker_is_watched_as_it_starts_and_reaped_as_it_exits(make_cluster):
    """The sidecar watches each worker's exit (its pidfd) from the moment the worker claims its
    row (the worker rings it then): a SIGKILLed worker is reaped at once -- here before its
    replacement starts (3 s) and long before the reaper's next look at the rows (a minute) --
    and the replacement is watched as soon as it starts."""
    cluster = make_cluster(workers=2, env={"PROXY_REAPER_INTERVAL_S": "60",
                                           "PROXY_WORKER_RESTART_BACKOFF_S": "3"})

    def reaper() -> dict:
        return cluster.status()["reaper"]

    wait_until(lambda: reaper()["watched"] == 2, 10, message="both workers watched")
    pid = cluster.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: reaper()["reaped"] == 1, 2.5, interval=0.02, message="reaped at once")
    assert reaper()["last_reaped"][-1]["pid"] == pid
    wait_until(lambda: cluster.worker_pids()[0] != pid, 20, message="worker0 restarted")
    wait_until(lambda: reaper()["watched"] == 2, 10, message="the replacement watched")


def test_an_idle_launcher_sleeps_and_a_dying_worker_wakes_it(make_cluster):
    """Idle, the launcher's loop barely wakes (it used to look at its children ten times a
    second); a worker's death (SIGCHLD) wakes it at once, well before its idle nap would end."""
    cluster = make_cluster(workers=1)
    launcher = psutil.Process(cluster.launcher.pid)
    time.sleep(1.0)  # past the launch's own readiness polling
    before = launcher.num_ctx_switches().voluntary
    time.sleep(3.0)
    assert launcher.num_ctx_switches().voluntary - before <= 5
    pid = cluster.worker_pids()[0]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: f"worker0 (pid {pid}) killed by SIGKILL" in cluster.launcher_log(), 5,
               interval=0.02, message=cluster.launcher_log()[-2000:])
    assert time.monotonic() - killed_at < 1.0, "seen when it died, not at the next nap's end"
    wait_until(lambda: cluster.worker_pids()[0] != pid, 10, message="worker0 restarted")


def test_sidecar_killed_and_restarted_keeps_counters(make_cluster):
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance("--hold-streams", "--heartbeat-interval", "0.5", "--max-concurrency", "3")
    old_sidecar = cluster.status()["sidecar"]["pid"]

    def modelled_slots() -> int | None:
        timeline = cluster.status()["event_channel"]["timelines"].get(inst.instance_id)
        return None if timeline is None else timeline["slots"]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.dp_url}/v1/chat/completions"
            held = [await OpenStream.open(session, url, chat_body()) for _ in range(2)]
            # The instance registered max_num_seqs 3 (below READY_CONCURRENCY 8).
            wait_until(lambda: modelled_slots() == 3, 5, message="timeline with the instance's 3 slots")
            os.kill(old_sidecar, signal.SIGKILL)
            # Workers keep routing from the last published directory while it is down.
            inst.release()
            status, _, _ = http("POST", url, chat_body(stream=False))
            assert status == 200
            await asyncio.gather(*(s.finish() for s in held))
            inst.configure(hold_streams=True)
            held = [await OpenStream.open(session, url, chat_body()) for _ in range(2)]
            new_status = wait_until(lambda: cluster.status(), 10, message="sidecar restarted")
            assert new_status["sidecar"]["pid"] != old_sidecar
            assert new_status["sidecar"]["epoch"] == 2
            # The restarted sidecar re-attached: it adopted the instance and the live counts.
            assert cluster.inflight()[inst.instance_id] == 2
            # Its slot count came back from the shared table, not from a re-registration.
            wait_until(lambda: modelled_slots() == 3, 5, message="3 slots after the restart")
            inst.release()
            await asyncio.gather(*(s.finish() for s in held))

    asyncio.run(scenario())
    wait_until(lambda: cluster.inflight()[inst.instance_id] == 0, 5, message="inflight 0")
    # The instance's next heartbeat is accepted after it resends its capabilities.
    wait_until(lambda: get(f"{cluster.cp_url}/v1/instance/list")[0]["capability_fingerprint"], 5,
               message="capabilities re-sent after the sidecar restart")


def test_ctrl_c_leaves_no_process_and_no_segment(make_cluster):
    cluster = make_cluster(workers=2)
    cluster.add_instance()
    status = cluster.status()
    pids = [status["sidecar"]["pid"], *(w["pid"] for w in status["workers"])]
    assert cluster.stop() == 0
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(f"/dev/shm{cluster.shm_name}")


def test_stopped_worker_is_not_reaped_and_resumes_without_double_subtraction(make_cluster):
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance("--hold-streams")
    pid = cluster.worker_pids()[1]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = [await OpenStream.open(session, f"{cluster.worker_url(1)}/v1/chat/completions",
                                             chat_body()) for _ in range(2)]
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(3.0)  # far past the reaper's interval and any heartbeat window
                status = cluster.status()
                assert status["reaper"]["reaped"] == 0
                stopped = [w for w in status["workers"] if w["pid"] == pid]
                assert stopped and stopped[0]["alive"] and stopped[0]["heartbeat_age_ms"] >= 2000
                assert cluster.inflight(0)[inst.instance_id] == 2  # its share is still counted
                # The other worker keeps serving meanwhile.
                inst.configure(hold_streams=False)
                assert http("POST", f"{cluster.worker_url(0)}/v1/chat/completions",
                            chat_body(stream=False))[0] == 200
            finally:
                os.kill(pid, signal.SIGCONT)
            inst.release()
            await asyncio.gather(*(s.finish() for s in streams))

    asyncio.run(scenario())
    wait_until(lambda: cluster.inflight()[inst.instance_id] == 0, 5, message="inflight 0")
    time.sleep(0.6)  # a few reaper ticks and an audit chance
    status = cluster.status()
    assert status["reaper"]["reaped"] == 0 and status["reaper"]["subtracted"] == 0
    assert status["reaper"]["corrections"] == 0
    assert cluster.worker_pids()[1] == pid  # never replaced


def test_sidecar_restart_under_load_fails_no_request(make_cluster):
    cluster = make_cluster(workers=2, strategy="least_load")
    instances = [cluster.add_instance("--heartbeat-interval", "0.5") for _ in range(2)]
    sidecar_pid = cluster.status()["sidecar"]["pid"]

    async def scenario() -> list[int]:
        statuses: list[int] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            async def client(n: int) -> None:
                while not stop.is_set():
                    body = chat_body(f"c{n}", stream=n % 2 == 0, max_tokens=4)
                    async with session.post(f"{cluster.dp_url}/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)
            clients = [asyncio.ensure_future(client(n)) for n in range(4)]
            await asyncio.sleep(1.0)
            os.kill(sidecar_pid, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # until the restarted sidecar serves again
                await asyncio.sleep(0.3)
                try:
                    if cluster.status()["sidecar"]["pid"] != sidecar_pid:
                        break
                except (OSError, AssertionError):
                    continue
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*clients)
        return statuses

    statuses = asyncio.run(scenario())
    assert len(statuses) > 20 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert cluster.status()["sidecar"]["epoch"] == 2
    wait_until(lambda: all(cluster.inflight()[i.instance_id] == 0 for i in instances), 5, message="inflight 0")
