"""Registration with the Scheduler control plane, from the sidecar.

Real supervisor, sidecar and workers (the harness), simulated instances, and a real
`python -m cacheroute_sim.scheduler` process on a free port. The simulated Scheduler tells the proxy to
heartbeat every 0.2 s so the tests see many heartbeats quickly; it validates every body against
the protocol (a malformed one would show up as `invalid` in its stats).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheroute_proxy.config import Settings
from sidecar.scheduler_http import SchedulerHttp
from sidecar.scheduler_link import DisabledLink, make_link
from tests.aio import OpenStream
from tests.harness import Process, chat_body, free_port, get, http, post, wait_until
from tests.test_http1_client import OK_JSON, Answer, Server, run

PROXY_ID = "px-under-test"
HEARTBEAT_S = 0.2


class SimScheduler:
    """A simulated Scheduler process; `start` again on the same port = a restarted Scheduler."""

    def __init__(self, log_dir: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = args
        self._log_dir = log_dir
        self.process: Process | None = None
        self.starts = 0

    def start(self) -> "SimScheduler":
        self.starts += 1
        argv = ["-m", "cacheroute_sim.scheduler", "--port", str(self.port),
                "--heartbeat-interval", str(HEARTBEAT_S), *self._args]
        self.process = Process(argv, {}, self._log_dir / f"scheduler-{self.port}-{self.starts}.log")
        wait_until(lambda: get(f"{self.url}/healthz", timeout=1)["ok"], 20,
                   message=f"sim scheduler on {self.port} up")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def configure(self, **knobs: Any) -> Any:
        return post(f"{self.url}/sim/config", knobs)

    def debug(self) -> dict[str, Any]:
        return get(f"{self.url}/debug/proxies")

    def proxy(self, proxy_id: str = PROXY_ID) -> dict[str, Any] | None:
        return {p["proxy_id"]: p for p in self.debug()["proxies"]}.get(proxy_id)

    def calls(self) -> dict[str, Any]:
        return self.debug()["calls"]


@pytest.fixture
def schedulers(tmp_path: Path):
    made: list[SimScheduler] = []

    def make(*args: str, port: int | None = None, start: bool = True) -> SimScheduler:
        sched = SimScheduler(tmp_path, *args, port=port)
        made.append(sched)
        return sched.start() if start else sched

    yield make
    for sched in made:
        sched.stop()


def link_env(scheduler_url: str, **extra: str) -> dict[str, str]:
    return {"SCHEDULER_CP_URL": scheduler_url, "PROXY_ID": PROXY_ID,
            "PROXY_SCHEDULER_BACKOFF_MAX_S": "1", **extra}


def link_status(cluster) -> dict[str, Any]:
    return cluster.status()["scheduler"]


def heartbeats_after(sched: SimScheduler, count: int) -> Any:
    """Wait for `count` more heartbeats carrying a pool_resource; return the latest one."""
    start = (sched.proxy() or {}).get("heartbeats", 0)
    wait_until(lambda: (sched.proxy() or {}).get("heartbeats", 0) >= start + count, 30,
               message=f"{count} more heartbeats")
    return sched.proxy()["last_pool_resource"]


# --- registration once, with the right identity, and pool_resource from the shared table ------------
def test_registers_once_for_four_workers_and_reports_shared_inflight(make_cluster, schedulers):
    sched = schedulers()
    cluster = make_cluster(workers=4, env=link_env(sched.url))
    inst = cluster.add_instance("--hold-streams")

    wait_until(lambda: sched.proxy() and sched.proxy()["heartbeats"] >= 3, 30,
               message=f"proxy registered and heartbeating\n{cluster.launcher_log()[-2000:]}")
    row = sched.proxy()
    assert (row["host"], row["port"]) == ("127.0.0.1", cluster.dp_port)  # the shared port
    reg = row["registration"]
    assert reg["endpoints"] == ["chat/completions", "completions"]
    assert reg["meta"] == {"version": "proxy_v1"}
    assert (reg["max_capacity"], reg["kv_mem_per_instance_gb"], reg["kv_cache_update_policy"]) == (8, 128.0, "lru")

    pool = heartbeats_after(sched, 2)
    assert pool["proxy_id"] == PROXY_ID and pool["schema_version"] == 1
    assert pool["instances"]["total"] == pool["instances"]["alive"] == 1
    assert pool["load"]["inflight_total"] == 0 and pool["load"]["capacity"] == 8
    # No instance sends resource snapshots: utilization unknown, never 0; admission degraded.
    assert set(pool["utilization"].values()) == {None}
    assert pool["metric_quality"]["resource"] == "missing"
    assert pool["pool_admission_state"] == "degraded"
    assert pool["pool_admission_reason"] == "0 accepting, 0 degraded, 0 rejecting, 1 alive"

    held = 5

    async def hold_streams() -> None:
        async with aiohttp.ClientSession() as session:
            streams = await asyncio.gather(*(
                OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
                for _ in range(held)))
            assert all(s.response.status == 200 for s in streams)
            workers = {s.worker.split("-")[0] for s in streams}
            seen = [cluster.inflight(w)[inst.instance_id] for w in range(cluster.workers)]
            assert seen == [held] * cluster.workers, seen
            pool = heartbeats_after(sched, 2)
            assert pool["load"]["inflight_total"] == held, (workers, pool["load"])
            assert pool["load"]["load_ratio"] == held / 8
            # The control plane shows what the next heartbeat carries.
            local = get(f"{cluster.cp_url}/debug/pool_resource")["pool_resource"]
            assert (local["proxy_id"], local["load"]["inflight_total"]) == (PROXY_ID, held)
            inst.release()
            await asyncio.gather(*(s.finish() for s in streams))

    asyncio.run(hold_streams())
    wait_until(lambda: heartbeats_after(sched, 1)["load"]["inflight_total"] == 0, 30,
               message="inflight_total back to 0")

    calls = sched.calls()
    assert calls["register_calls"] == 1 and calls["registered"] == 1, calls  # once, not per worker
    assert calls["invalid"] == 0 and calls["heartbeats_unknown"] == 0, calls
    status = link_status(cluster)
    assert status["registered"] and status["re_registrations"] == 0, status
    assert status["proxy_id"] == PROXY_ID and status["consecutive_failures"] == 0

    # A clean stop unregisters.
    assert cluster.stop() == 0
    calls = sched.calls()
    assert calls["unregister_calls"] == 1 and calls["unregistered"] == 1, calls
    assert sched.proxy() is None


def test_stopping_the_proxy_leaves_the_scheduler_before_the_workers_drain(make_cluster, schedulers):
    """SIGINT to the supervisor: the sidecar unregisters at once (SIGUSR1), while a worker is
    still draining a stream that the drain then lets finish."""
    sched = schedulers()
    cluster = make_cluster(workers=2, env=link_env(sched.url))
    inst = cluster.add_instance("--hold-streams")
    wait_until(lambda: (sched.proxy() or {}).get("heartbeats", 0) >= 1, 30, message="registered")

    async def stop_while_streaming() -> bytes:
        async with aiohttp.ClientSession() as session:
            stream = await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body())
            assert stream.response.status == 200
            os.kill(cluster.launcher.pid, signal.SIGINT)
            await asyncio.to_thread(wait_until, lambda: sched.calls()["unregistered"] == 1, 15,
                                    message=f"unregistered while draining\n{cluster.launcher_log()[-2000:]}")
            assert cluster.launcher.running()  # the worker holding the stream is still draining
            inst.release()
            return await stream.finish()

    body = asyncio.run(stop_while_streaming())
    assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    assert cluster.launcher.stop(signal.SIGINT, timeout=45) == 0
    assert "leaving the Scheduler before the workers drain" in cluster.launcher_log()
    assert sched.calls()["unregister_calls"] == 1  # not again at the sidecar's own stop


def test_a_sidecar_restarting_under_live_workers_stays_registered(make_cluster, schedulers):
    """SIGTERM to the sidecar alone (a `systemctl restart` of its unit): the workers keep
    serving, so the proxy does not leave the Scheduler; the new sidecar registers again (an
    upsert) and heartbeats on."""
    sched = schedulers()
    cluster = make_cluster(workers=2, env=link_env(sched.url))
    cluster.add_instance()
    wait_until(lambda: (sched.proxy() or {}).get("heartbeats", 0) >= 1, 30, message="registered")
    old = cluster.status()["sidecar"]["pid"]
    os.kill(old, signal.SIGTERM)
    wait_until(lambda: cluster.status()["sidecar"]["pid"] != old, 30, message="sidecar restarted")
    heartbeats_after(sched, 2)
    calls = sched.calls()
    assert calls["unregister_calls"] == 0 and calls["register_calls"] == 2, calls
    assert "staying registered with the Scheduler" in cluster.launcher_log()
    assert http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))[0] == 200


# --- a Scheduler that is down, restarted, or hanging ------------------------------------------------
def test_scheduler_down_at_start_then_registers_when_it_comes_up(make_cluster, schedulers):
    sched = schedulers(start=False)  # nothing listens on its port yet
    cluster = make_cluster(workers=2, env=link_env(sched.url))
    cluster.add_instance()
    for _ in range(4):  # the proxy serves normally without its Scheduler
        status, _, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
        assert status == 200
    wait_until(lambda: link_status(cluster)["consecutive_failures"] >= 2, 20,
               message="registration attempts failing")
    status = link_status(cluster)
    assert not status["registered"] and status["last_error"], status

    sched.start()
    wait_until(lambda: sched.proxy() is not None, 20,
               message=f"registered once the Scheduler is up\n{cluster.launcher_log()[-2000:]}")
    wait_until(lambda: link_status(cluster)["registered"], 10, message="link registered")
    status = link_status(cluster)
    assert status["consecutive_failures"] == 0 and status["last_error"] is None, status
    assert sched.calls()["registered"] == 1
    # Failures were logged, but not once per attempt (at most one summary per 30 s).
    warnings = cluster.launcher_log().count("Scheduler registration failed")
    assert 1 <= warnings <= 2, warnings


def test_reregisters_after_heartbeat_404_and_after_a_real_restart(make_cluster, schedulers):
    sched = schedulers()
    links = {"kdn://127.0.0.1:9101": {"bandwidth_mbps": 1000, "latency_ms": 0.5}}
    cluster = make_cluster(workers=2, env=link_env(sched.url, PROXY_KDN_LINKS_JSON=json.dumps(links)))
    wait_until(lambda: sched.proxy() and sched.proxy()["heartbeats"] >= 2, 30,
               message="registered and heartbeating")
    assert sched.proxy()["registration"]["meta"] == {"version": "proxy_v1", "kdn_links": links}

    # The Scheduler forgets every proxy: the next heartbeat is 404, the proxy registers again.
    post(f"{sched.url}/sim/restart", {})
    wait_until(lambda: sched.proxy() is not None, 20, message="registered again after the 404")
    calls = sched.calls()
    assert calls["heartbeats_unknown"] >= 1 and calls["registered"] == 2, calls
    wait_until(lambda: link_status(cluster)["re_registrations"] == 1, 10, message="re-registration counted")

    # A real restart: the process is gone for a while (connection refused), then comes back
    # empty; the proxy must register with the new process, not heartbeat into a 404 forever.
    sched.stop()
    wait_until(lambda: link_status(cluster)["consecutive_failures"] >= 1, 20, message="failures seen")
    sched.start()
    wait_until(lambda: sched.proxy() is not None and sched.proxy()["heartbeats"] >= 2, 30,
               message="registered with the restarted Scheduler")
    assert sched.calls()["registered"] == 1
    status = link_status(cluster)
    assert status["registered"] and status["re_registrations"] >= 2, status


@pytest.mark.slow
def test_hanging_scheduler_delays_neither_startup_nor_the_control_plane(make_cluster, schedulers):
    sched = schedulers("--hang")
    # A long call timeout: if anything waited for the Scheduler, it would wait visibly long.
    cluster = make_cluster(workers=2, env=link_env(sched.url, PROXY_SCHEDULER_TIMEOUT_S="120"))
    wait_until(lambda: sched.calls()["held"] >= 1, 20, message="register call hanging")
    # While the register call hangs: instances register, the control plane answers, requests flow.
    cluster.add_instance()
    assert http("GET", f"{cluster.cp_url}/healthz")[0] == 200
    answer = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))
    assert answer[0] == 200, answer
    assert sched.calls()["held"] >= 1 and not link_status(cluster)["registered"]

    sched.configure(hang=False)
    post(f"{sched.url}/sim/release", {})
    wait_until(lambda: link_status(cluster)["registered"], 20, message="registered after release")

    # Hanging again at shutdown: the unregister gives up after its short timeout, the stop is clean.
    sched.configure(hang=True)
    assert cluster.stop() == 0
    assert sched.calls()["unregister_calls"] == 1
    assert "Scheduler unregister failed" in cluster.launcher_log()


# --- the keep-alive race with a Scheduler on uvicorn's defaults --------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_heartbeats_at_the_servers_keepalive_never_fail(make_cluster, schedulers):
    """The simulated Scheduler on uvicorn's defaults: a 5 s keep-alive, and a 5 s heartbeat
    interval in its register reply. A pooled connection kept for the whole interval would be
    closed by uvicorn just as the next heartbeat goes out on it; over a minute, not one
    heartbeat fails and the proxy never registers again."""
    sched = schedulers("--heartbeat-interval", "5")
    cluster = make_cluster(workers=1, env=link_env(sched.url))
    wait_until(lambda: link_status(cluster)["registered"], 30, message="registered")
    heartbeats = 13  # at 5 s each: over 60 s

    def done() -> bool:
        status = link_status(cluster)
        return status["failures_total"] > 0 or status["heartbeats_ok"] >= heartbeats

    wait_until(done, heartbeats * 5 + 30, interval=0.5, message=f"{heartbeats} heartbeats")
    status = link_status(cluster)
    assert status["heartbeat_interval_s"] == 5.0
    assert status["failures_total"] == 0 and status["re_registrations"] == 0, json.dumps(status)
    assert status["registrations"] == 1 and status["heartbeats_ok"] >= heartbeats, json.dumps(status)
    calls = sched.calls()
    assert calls["register_calls"] == 1 and calls["heartbeats_unknown"] == 0, calls


def closing_kept_connections(after_close: bytes = b"", answered: int | None = None) -> Answer:
    """A Scheduler that answers the first call on each connection (the first `answered` calls
    in all, if given) and closes the connection exactly when a later call arrives on it,
    having written `after_close` first (b"": nothing, the keep-alive race)."""
    kept: list[asyncio.StreamWriter] = []
    calls = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if writer in kept or (answered is not None and calls > answered):
            writer.write(after_close)
            writer.close()
            return
        kept.append(writer)
        writer.write(OK_JSON)
    return answer


def test_a_call_on_a_kept_connection_closed_as_it_arrives_is_sent_once_more_on_a_new_one():
    """The keep-alive race, scripted: the second heartbeat goes out on the kept connection and
    the Scheduler closes it unanswered; it is sent again on a new connection and answered."""
    async def main() -> tuple[int, int, int]:
        async with Server(closing_kept_connections()) as server:
            link = SchedulerHttp(f"http://127.0.0.1:{server.port}", 5.0)
            for _ in range(2):
                assert await link.post("/v1/proxy/heartbeat", b"{}") == (200, b'{"ok": true}')
            link.close()
            return server.connections, len(server.requests), link.resent

    assert run(main()) == (2, 3, 1)


@pytest.mark.parametrize("after_close", [b"", b"HTTP/1.1 200 OK\r\nContent-Le"], ids=["fresh", "started"])
def test_a_call_is_sent_again_only_once_and_never_when_its_answer_had_started(after_close):
    """Sent again once: when the new connection fails too, the call fails. And a call whose
    answer had started (a byte of it) is never sent again: the Scheduler may have acted on it."""
    async def main() -> tuple[int, int]:
        async with Server(closing_kept_connections(after_close, answered=1)) as server:
            link = SchedulerHttp(f"http://127.0.0.1:{server.port}", 5.0)
            assert await link.post("/v1/proxy/register", b"{}") == (200, b'{"ok": true}')
            with pytest.raises(OSError):
                await link.post("/v1/proxy/heartbeat", b"{}")
            link.close()
            return server.connections, link.resent

    assert run(main()) == ((2, 1) if after_close == b"" else (1, 0))


def test_https_and_credentials_in_the_url(tmp_path, monkeypatch):
    """SCHEDULER_CP_URL may be https (verified against the trusted CAs: here a self-signed
    certificate made trusted through SSL_CERT_FILE) and may carry user:password (sent as Basic)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(OK_JSON)

    async def main() -> bytes:
        server = Server(answer)
        server_socket = await asyncio.start_server(server._handle, "127.0.0.1", 0, ssl=context)
        port = server_socket.sockets[0].getsockname()[1]
        try:
            link = SchedulerHttp(f"https://sched%40ops:p%3Ass@127.0.0.1:{port}/base/", 5.0)
            assert await link.post("/v1/proxy/register", b'{"a": 1}') == (200, b'{"ok": true}')
            link.close()
        finally:
            server_socket.close()
        return server.requests[0]

    request = run(main())
    assert request.startswith(b"POST /base/v1/proxy/register HTTP/1.1\r\n"), request
    assert b"\r\nAuthorization: Basic " + base64.b64encode(b"sched@ops:p:ss") + b"\r\n" in request
    assert request.endswith(b'\r\n\r\n{"a": 1}')


# --- KDN links: PROXY_KDN_LINKS_JSON overlaid by the instances' topology reports ----------------------
def test_kdn_links_are_overlaid_by_topology_and_patched_only_when_they_change(make_cluster, schedulers):
    sched = schedulers()
    static = {"kdn://a:1": {"bandwidth_mbps": 100}, "kdn://b:2": {"bandwidth_mbps": 10}}
    cluster = make_cluster(workers=1, env=link_env(sched.url, PROXY_KDN_LINKS_JSON=json.dumps(static)))
    heartbeats_after(sched, 3)
    assert sched.proxy()["registration"]["meta"]["kdn_links"] == static
    assert sched.proxy()["meta_patches"] == 0  # the register carried them; nothing changed since

    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": 9500, "instance_id": "i1"})
    measured = {"kdn://b:2": {"bandwidth_mbps": 1000, "latency_ms": 1.0}, "kdn://c:3": {"bandwidth_mbps": 5}}
    assert post(f"{cluster.cp_url}/v1/topology/report", {"instance_id": "i1", "links": measured}) == \
        {"ok": True, "merged_links": 2}
    overlaid = {**static, **{key: {**link, "reported_by": "i1"} for key, link in measured.items()}}
    wait_until(lambda: sched.proxy()["meta"]["kdn_links"] == overlaid, 20, message="links patched")
    heartbeats_after(sched, 3)
    assert sched.proxy()["meta_patches"] == 1

    # The instance leaves: its links go, and the Scheduler hears the static ones again.
    assert post(f"{cluster.cp_url}/v1/instance/unregister", {"instance_id": "i1"}) == {"ok": True}
    wait_until(lambda: sched.proxy()["meta"]["kdn_links"] == static, 20, message="links withdrawn")
    heartbeats_after(sched, 3)
    assert sched.proxy()["meta_patches"] == 2

    # Registering again (the Scheduler forgot us) carries what is current.
    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": 9500, "instance_id": "i1"})
    post(f"{cluster.cp_url}/v1/topology/report", {"instance_id": "i1", "links": measured})
    wait_until(lambda: sched.proxy()["meta"]["kdn_links"] == overlaid, 20, message="links patched again")
    post(f"{sched.url}/sim/restart", {})
    wait_until(lambda: sched.proxy() is not None, 20, message="registered again")
    assert sched.proxy()["registration"]["meta"]["kdn_links"] == overlaid


# --- the simulated Scheduler itself, and the switch ---------------------------------------------------
def test_sim_scheduler_validates_and_expires(schedulers):
    sched = schedulers("--ttl", "0.5")
    status, body, _ = http("POST", f"{sched.url}/v1/proxy/register", {"host": "h", "port": "80"})
    assert status == 422 and "$.port" in body["detail"], body
    status, body, _ = http("POST", f"{sched.url}/v1/proxy/register",
                           {"host": "h", "port": 80, "pool_resource": {"schema_version": 1}})
    assert status == 422 and "pool_resource" in body["detail"], body
    status, _, _ = http("POST", f"{sched.url}/v1/proxy/heartbeat", {"proxy_id": "nobody"})
    assert status == 404
    reply = post(f"{sched.url}/v1/proxy/register", {"proxy_id": "p1", "host": "h", "port": 80})
    assert reply == {"proxy_id": "p1", "heartbeat_interval_s": HEARTBEAT_S, "ttl_s": 0.5}
    assert post(f"{sched.url}/v1/proxy/heartbeat", {"proxy_id": "p1"}) == {"ok": True}
    # Silent for longer than the TTL: forgotten, so its next heartbeat is 404.
    wait_until(lambda: sched.proxy("p1") is None, 10, message="p1 expired")
    assert http("POST", f"{sched.url}/v1/proxy/heartbeat", {"proxy_id": "p1"})[0] == 404
    sched.configure(fail_status=503)
    assert http("POST", f"{sched.url}/v1/proxy/register", {"host": "h", "port": 80})[0] == 503
    calls = sched.calls()
    assert calls["invalid"] == 2 and calls["failed"] == 1 and calls["expired"] == 1, calls


def test_registration_is_off_without_scheduler_url():
    link = make_link(Settings(), lambda proxy_id: None, lambda: 0, lambda: True)  # type: ignore[arg-type,return-value]
    assert isinstance(link, DisabledLink) and link.status.describe()["enabled"] is False
