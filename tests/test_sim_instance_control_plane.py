"""Tests of the simulated Instance's control side (cacheroute_sim/instance/): registration traffic with a
fake Proxy control plane, the exit status on SIGTERM, and the KV path (prefix-hit timing, the
control plane's inject through a simulated KDN), against real processes (tests/sim_harness.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from cacheroute_proxy.instance_wire import ResourceSnapshotRequest, ResourceSnapshotV1
from sidecar.resource_snapshot import normalise

from cacheroute_sim.processes import free_port
from cacheroute_sim.instance import timing
from cacheroute_sim.instance.config import Knobs, SimConfig
from cacheroute_sim.instance.registration import register_body
from cacheroute_sim.instance.request_model import InvalidRequest, parse_kv_prefix_header
from tests.sim_harness import (
    KDN_TIMEOUT_S,
    TIME_SCALE,
    TIMER_EARLY_S,
    SimProcess,
    chat_body,
    free_port_pair,
    http,
    poll_until,
    read_events,
    run,
    running_sim,
    wait_stats,
)
from tests.background_http import BackgroundHTTPServer, answer_json
from tests.sim_harness import shared_sim, sim  # noqa: F401 - pytest fixtures

# One parallel test worker runs them all: they share the module's simulated instance and KDN.
pytestmark = pytest.mark.xdist_group(__name__)


# ------------------------------------------------------------------------- registration

class FakeControlPlane(BackgroundHTTPServer):
    """A tiny stand-in for the Proxy control plane; records calls, scripts heartbeat replies."""

    def __init__(self, port: int, heartbeat_replies: list[dict[str, Any]] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.calls: list[dict[str, Any]] = []
        self.heartbeat_replies = deque(heartbeat_replies or [])
        self.cond = threading.Condition()
        super().__init__(self._handler(), port)

    def wait_for_calls(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.calls) >= count, timeout):
                raise AssertionError(f"only {len(self.calls)} calls: {self.calls}")
            return list(self.calls)

    def _reply(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/instance/register":
            return {"instance_id": body["instance_id"], "heartbeat_interval_s": 10, "ttl_s": 30,
                    "capability_fingerprint": "sha256:fake"}
        if path == "/v1/instance/heartbeat" and self.heartbeat_replies:
            return self.heartbeat_replies.popleft()
        return {"ok": True}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with fake.cond:
                    reply = fake._reply(self.path, body)
                    fake.calls.append({"path": self.path, "body": body, "t": time.monotonic(),
                                       "auth": self.headers.get("authorization")})
                    fake.cond.notify_all()
                answer_json(self, json.dumps(reply).encode())

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


REQUIRES_CAPS = {"ok": False, "error": "capability_fingerprint_mismatch",
                 "requires_capabilities": True, "expected_fingerprint": "sha256:other",
                 "reported_fingerprint": "sha256:fake"}


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_registration_lifecycle(tmp_path: Path) -> None:
    cp_port, interval = free_port(), 0.3
    script: list[dict[str, Any]] = [{"ok": True}, REQUIRES_CAPS, {"ok": True}, {"ok": False}]
    with FakeControlPlane(cp_port, script) as cp:
        # No --cp-port: the Instance control plane listens on data port + 1, like 9001/9002.
        sim = SimProcess(["--proxy-cp-url", cp.url, "--instance-id", "sim-reg",
                          "--register-token", "s3cret", "--heartbeat-interval", str(interval),
                          "--time-scale", str(TIME_SCALE), "--shutdown-grace", "1"],
                         tmp_path / "reg.log", port=free_port_pair())
        try:
            cp.wait_for_calls(7)
            # Registered only once both listeners are up.
            assert http("GET", f"http://127.0.0.1:{sim.port + 1}/healthz")[::2] == (
                200, {"ok": True})
            # A hung request keeps uvicorn draining for the full 1 s grace at shutdown; the
            # unregister must not wait for that (the Proxy should stop routing here first).
            http("POST", sim.url + "/sim/config", {"hang": True})
            hung = threading.Thread(target=http, args=("POST", sim.url + "/v1/completions",
                                                       {"prompt": "x"}), daemon=True)
            hung.start()
            poll_until(lambda: http("GET", sim.url + "/sim/stats")[2]["held"] == 1)
            t_signal = time.monotonic()
            exit_status = sim.terminate()
            exit_after = time.monotonic() - t_signal
            hung.join(5)
            calls = list(cp.calls)
        finally:
            sim.terminate()
    paths = [c["path"].rsplit("/", 1)[1] for c in calls]
    assert paths[:7] == ["register", "heartbeat", "heartbeat", "heartbeat", "heartbeat",
                         "register", "heartbeat"], paths
    assert paths[-1] == "unregister" and calls[-1]["body"] == {"instance_id": "sim-reg"}
    assert exit_status == 0, sim.log()
    assert calls[-1]["t"] - t_signal < 0.5 < 0.9 < exit_after, (calls[-1]["t"] - t_signal,
                                                                 exit_after)
    assert all(c["auth"] == "Bearer s3cret" for c in calls)
    assert calls[0]["body"] == {
        "instance_id": "sim-reg", "host": "127.0.0.1", "port": sim.port,
        "endpoints": ["chat/completions", "completions"], "tags": [], "weight": 1.0,
        "meta": {"version": "instance_v1", "simulated": True, "max_num_seqs": 8,
                 "cp_port": sim.port + 1, "kv_mem_gb": 128.0},
        "capabilities": {"schema_version": "1",
                         "model": {"identifier": "sim-model", "revision": None},
                         "runtime": {"supported_cache_features": ["kv_inject"]}}}
    plain = {"instance_id": "sim-reg", "capability_fingerprint": "sha256:fake"}
    assert calls[1]["body"] == calls[2]["body"] == calls[4]["body"] == plain
    assert calls[3]["body"] == {**plain, "capabilities": calls[0]["body"]["capabilities"]}
    # The interval override wins over the reply's 10 s; the caps resend is immediate.
    assert interval * 0.8 < calls[2]["t"] - calls[1]["t"] < interval + 0.5
    assert calls[3]["t"] - calls[2]["t"] < 0.2
    # {"ok": false} without requires_capabilities: re-register at once, not one interval later.
    assert calls[5]["t"] - calls[4]["t"] < 0.2 and calls[5]["body"] == calls[0]["body"]


@pytest.mark.timeout(30)
def test_resource_snapshots_after_register_and_on_their_interval_follow_the_load(tmp_path: Path) -> None:
    """--resource-interval: one snapshot right after the register, then one an interval, in the
    product's wire format, read by the sidecar as an agent's; a busy engine reads busier."""
    cp_port, interval = free_port(), 0.3
    with FakeControlPlane(cp_port) as cp:
        with running_sim(tmp_path / "res.log", "--proxy-cp-url", cp.url, "--instance-id", "sim-res",
                         "--resource-interval", str(interval), "--max-concurrency", "2",
                         "--time-scale", str(TIME_SCALE)) as sim:
            first = cp.wait_for_calls(2)
            assert [c["path"] for c in first[:2]] == ["/v1/instance/register", "/v1/instance/resource_snapshot"]
            http("POST", sim.url + "/sim/config", {"hold_streams": True})
            held = threading.Thread(target=http, args=("POST", sim.url + "/v1/completions",
                                                       {"prompt": "x", "stream": True}), daemon=True)
            held.start()
            poll_until(lambda: http("GET", sim.url + "/sim/stats")[2]["held"] == 1)
            snapshots = lambda: [c for c in cp.calls if c["path"] == "/v1/instance/resource_snapshot"]  # noqa: E731
            count = len(snapshots())
            poll_until(lambda: len(snapshots()) >= count + 2, timeout=5)  # a whole window busy
            calls = snapshots()
            http("POST", sim.url + "/sim/release", {})
    idle, busy = (msgspec.convert(c["body"], ResourceSnapshotRequest) for c in (calls[0], calls[-1]))
    assert idle.instance_id == busy.instance_id == "sim-res" and idle.metadata.reported_instance_id == "sim-res"
    read = [normalise(r.snapshot, r.metadata, time.time()) for r in (idle, busy)]
    assert msgspec.convert(busy.snapshot, ResourceSnapshotV1).devices.gpu[0].utilization_source == "simulated"
    assert read[0].gpu_util_avg == 0.0 and read[1].gpu_util_avg == read[1].gpu_util_max == 67.5, read
    assert read[0].cpu_util < read[1].cpu_util and read[0].memory_used_mb < read[1].memory_used_mb, read
    assert all(r.admission_state == "accepting" and r.gpu_mem_total_mb and r.memory_total_mb for r in read), read


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_registration_waits_for_a_late_control_plane(tmp_path: Path) -> None:
    cp_port = free_port()
    with running_sim(tmp_path / "late.log", "--proxy-cp-url", f"http://127.0.0.1:{cp_port}",
                     "--heartbeat-interval", "0.2") as sim:
        # The data plane serves while the control plane is down.
        assert http("POST", sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] \
            == 200
        time.sleep(1.2)  # several failed attempts (backoff 0.2, 0.4, 0.8 s)
        with FakeControlPlane(cp_port) as cp:
            calls = cp.wait_for_calls(2, timeout=5)  # register + a heartbeat
            assert [c["path"] for c in calls[:2]] == ["/v1/instance/register",
                                                      "/v1/instance/heartbeat"]
            assert all(c["auth"] is None for c in calls)  # no token: no header at all
            assert calls[0]["body"]["instance_id"] == f"hp_127.0.0.1:{sim.port}"
            exit_status = sim.terminate()
            assert cp.calls[-1]["path"] == "/v1/instance/unregister"
    assert exit_status == 0
    log = sim.log()
    assert log.count("control plane unreachable") == 1, log  # once per state change
    assert "registered as" in log


@pytest.mark.timeout(20)
def test_sigterm_with_a_hung_request_exits_zero(tmp_path: Path) -> None:
    with running_sim(tmp_path / "term.log", "--no-register", "--hang",
                     "--shutdown-grace", "0.3") as sim:
        async def go() -> int:
            async with aiohttp.ClientSession() as s:
                async def hung_call() -> int:
                    async with s.post(sim.url + "/v1/chat/completions", json=chat_body()) as r:
                        await r.read()
                        return r.status

                req = asyncio.create_task(hung_call())
                await wait_stats(s, sim.url, lambda st: st["held"] == 1)
                t0 = time.monotonic()
                status = await asyncio.to_thread(sim.terminate)
                assert time.monotonic() - t0 < 3
                # Cut off by the shutdown grace with an explicit 503, not left hanging.
                assert await asyncio.wait_for(req, 2) == 503
                return status

        assert run(go()) == 0, sim.log()


# ------------------------------------------------------------------ KV path: pure parts

def test_redis_pull_and_kv_hit_prefill_follow_the_reference() -> None:
    # The Redis pull: 2764.34 ms/GB x tokens x 0.0000381 GB + 12.46 ms.
    assert timing.redis_pull_ms(0) == pytest.approx(12.4608, abs=1e-3)
    assert timing.redis_pull_ms(2560) == pytest.approx(2764.3408 * 2560 * 0.0000381 + 12.4608)
    # The hit skips N tokens of prefill and costs their pull instead.
    assert timing.kv_hit_prefill_ms(3000, 2560) == pytest.approx(
        timing.redis_pull_ms(2560) + timing.prefill_ms(440))
    # Never more than the prompt, never less than one computed token.
    assert timing.kv_hit_prefill_ms(3000, 9999) == pytest.approx(
        timing.redis_pull_ms(3000) + timing.prefill_ms(1))
    assert timing.kv_hit_prefill_ms(100, 0) == pytest.approx(
        timing.redis_pull_ms(0) + timing.prefill_ms(100))


@pytest.mark.parametrize("value,expected", [(None, None), ("0", 0), ("2560", 2560),
                                            (" 17 ", 17)])
def test_kv_prefix_header_parses(value: str | None, expected: int | None) -> None:
    assert parse_kv_prefix_header(value) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "", "abc", "１２"])
def test_kv_prefix_header_rejects_garbage(value: str) -> None:
    with pytest.raises(InvalidRequest, match="x-cacheroute-kv-prefix-tokens"):
        parse_kv_prefix_header(value)


def test_control_plane_port_and_register_meta() -> None:
    assert SimConfig(port=9001).resolved_cp_port == 9002
    assert SimConfig(port=9001, cp_port=0).resolved_cp_port == 0
    assert SimConfig(port=9001, cp_port=9500).resolved_cp_port == 9500
    assert SimConfig(port=65535).resolved_cp_port == 0
    with pytest.raises(ValueError, match="cp_port must differ"):
        SimConfig(port=9001, cp_port=9001)
    config = SimConfig(port=9001, max_concurrency=3)
    assert register_body(config, 9002)["meta"] == {"version": "instance_v1", "simulated": True,
                                                   "max_num_seqs": 3, "cp_port": 9002,
                                                   "kv_mem_gb": 128.0}
    assert register_body(config, None)["meta"] == {"version": "instance_v1", "simulated": True,
                                                   "max_num_seqs": 3, "kv_mem_gb": 128.0}
    # The KV it keeps, in tokens, when given at start: what a model of its evictions uses.
    sized = SimConfig(port=9001, kv_mem_gb=2.0, knobs=Knobs(kv_capacity_tokens=1700))
    assert register_body(sized, None)["meta"] == {"version": "instance_v1", "simulated": True,
                                                  "max_num_seqs": 8, "kv_mem_gb": 2.0,
                                                  "kv_capacity_tokens": 1700}


# ------------------------------------------------------------ KV path: prefix-hit timing

def _prefill_time(sim: SimProcess, prompt_chars: int, prefix: str | None) -> float:
    """Wall time of a one-token completion: prefill only (no decode step)."""
    headers = {"content-type": "application/json"}
    if prefix is not None:
        headers["x-cacheroute-kv-prefix-tokens"] = prefix
    req = urllib.request.Request(
        sim.url + "/v1/completions", method="POST", headers=headers,
        data=json.dumps({"prompt": "p" * prompt_chars, "max_tokens": 1}).encode())
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        r.read()
    return time.monotonic() - t0


def test_kv_prefix_header_shortens_prefill(sim: SimProcess) -> None:
    # 3000 prompt tokens: 4.39 s of prefill; a 2560-token hit leaves 440 tokens (0.59 s)
    # plus a 0.28 s Redis pull. At TIME_SCALE 0.05: 220 ms vs 44 ms.
    # Reference numbers, not timing.py's (a wrong formula there must not move the target):
    # 1.48604*3000 - 64.205 = 4393.9 ms; 2764.34*2560*0.0000381 + 12.46 + 1.48604*440 - 64.205
    # = 871.7 ms.
    full = _prefill_time(sim, 12000, None)
    hit = _prefill_time(sim, 12000, "2560")
    expected_full = 4393.915 * TIME_SCALE / 1000
    expected_hit = 871.736 * TIME_SCALE / 1000
    assert expected_full <= full < expected_full + 0.08, (full, expected_full)
    assert expected_hit <= hit < expected_hit + 0.08, (hit, expected_hit)
    assert full - hit == pytest.approx(expected_full - expected_hit, abs=0.06)
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_prefix_hits"], st["kv_prefix_tokens_total"], st["completed"]) == (1, 2560, 2)


def test_kv_prefix_header_on_a_chat_stream_and_its_limits(sim: SimProcess) -> None:
    async def ttft(prefix: str) -> float:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(sim.url + "/v1/chat/completions",
                              json=chat_body("c" * 12000, stream=True, max_tokens=2),
                              headers={"x-cacheroute-kv-prefix-tokens": prefix}) as r:
                await read_events(r, 2)
                elapsed = time.monotonic() - t0
                await r.read()
        return elapsed

    # A claim larger than the prompt is capped at the prompt: pull 3000 tokens, compute 1.
    first = run(ttft("100000"))
    expected = 388.425 * TIME_SCALE / 1000  # 2764.34*3000*0.0000381 + 12.46 + 60 (1 token)
    # libuv (uvloop) timers have millisecond granularity and may fire up to 1 ms early.
    assert expected - 0.001 <= first < expected + 0.08, (first, expected)
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_prefix_hits"], st["kv_prefix_tokens_total"]) == (1, 3000)
    # Without the header: no hit.
    assert http("POST", sim.url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert http("GET", sim.url + "/sim/stats")[2]["kv_prefix_hits"] == 1
    req = urllib.request.Request(sim.url + "/v1/completions", method="POST",
                                 data=b'{"prompt": "x"}',
                                 headers={"x-cacheroute-kv-prefix-tokens": "-5"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    body = json.loads(err.value.read())
    assert err.value.code == 400 and body["error"] == "invalid_request"
    assert "x-cacheroute-kv-prefix-tokens" in body["detail"]


# ------------------------------------------------------- KV path: control plane -> KDN

# A small KDN store: DOC1 1000 tokens kv_ready (4 keys), doc2 text only, doc3 10 tokens.
KDN_KNOWLEDGE = [{"id": "DOC1", "content": "d" * 4000, "kv_ready": True},
                 {"id": "doc2", "content": "e" * 400, "kv_ready": False},
                 {"id": "doc3", "content": "f" * 40, "kv_ready": True}]
# 1000 bytes/token at 80 Mbps, full efficiency: DOC1's 1 MB of KV takes 100 ms.
KDN_LINK_ARGS = ("--kv-bytes-per-token", "1000", "--bandwidth-mbps", "80",
                 "--link-efficiency", "1", "--rtt-ms", "0")


@pytest.fixture(scope="module")
def shared_kdn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    tmp = tmp_path_factory.mktemp("kdn")
    (tmp / "k.json").write_text(json.dumps(KDN_KNOWLEDGE))
    with running_sim(tmp / "kdn.log", "--knowledge", str(tmp / "k.json"), *KDN_LINK_ARGS,
                     module="cacheroute_sim.kdn") as kdn:
        yield kdn


@pytest.fixture
def kdn(shared_kdn: SimProcess) -> Iterator[SimProcess]:
    for path in ("/sim/config/reset", "/sim/release", "/sim/stats/reset"):
        http("POST", shared_kdn.url + path)
    try:
        yield shared_kdn
    finally:
        http("POST", shared_kdn.url + "/sim/config/reset")
        http("POST", shared_kdn.url + "/sim/release")


def cp_inject(sim: SimProcess, kdn_addr: str, kids: list[str], request_id: Any = 42
              ) -> tuple[float, int, dict[str, str], Any]:
    assert sim.cp_url is not None
    body = {"request_id": request_id, "kdn_addr": kdn_addr, "model": "m-1",
            "knowledge_ids": kids}
    t0 = time.monotonic()
    status, headers, reply = http("POST", sim.cp_url + "/v1/kv/inject_ready", body)
    return time.monotonic() - t0, status, headers, reply


def test_cp_inject_goes_through_the_kdn(sim: SimProcess, kdn: SimProcess) -> None:
    assert sim.cp_url is not None
    assert http("GET", sim.cp_url + "/healthz")[::2] == (200, {"ok": True})
    elapsed, status, headers, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}",
                                              ["DOC1", "doc2", "missing", "doc3"])
    assert status == 200 and headers["x-sim-instance"] == "sim-a"
    assert ack == {"ok": True, "injected_kids": ["doc1", "doc3"], "text_only_kids": ["doc2"],
                   "miss_kids": ["missing"], "keys_injected": 5, "payload_bytes": 1_010_000,
                   "payload_files": 5, "network_sim_enabled": True, "detail": ""}
    assert 0.101 - TIMER_EARLY_S <= elapsed < 0.101 + 0.1, elapsed  # 1.01 MB at 10 000 bytes/ms
    _, _, kst = http("GET", kdn.url + "/sim/stats")
    # The KDN saw this Instance's Redis target and the Proxy's request fields.
    assert kst["last_inject"] == {"request_id": 42, "model": "m-1",
                                  "knowledge_ids": ["doc1", "doc2", "missing", "doc3"],
                                  "redis_host": "10.9.8.7", "redis_port": 6390, "redis_db": 3,
                                  "redis_password_set": True}
    assert kst["links"]["10.9.8.7:6390"]["bytes"] == 1_010_000
    # A full URL works as kdn_addr too; the answer is the KDN's, byte for byte (once doc3's
    # KV is forgotten: resident, it would be acknowledged without the KDN).
    http("POST", sim.url + "/sim/kv/clear")
    _, status, _, again = cp_inject(sim, f"http://127.0.0.1:{kdn.port}/", ["doc3"])
    assert status == 200 and again["injected_kids"] == ["doc3"]
    direct = http("POST", kdn.url + "/knowledge/inject_ready_kv",
                  {"request_id": 1, "model": "m", "knowledge_ids": ["doc3"]})[2]
    assert again == direct
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (2, 0)


def test_cp_relays_kdn_client_errors_verbatim(sim: SimProcess, kdn: SimProcess) -> None:
    _, status, _, reply = cp_inject(sim, f"127.0.0.1:{kdn.port}", [])
    assert (status, reply) == (400, {"ok": False, "detail": "knowledge_ids is empty"})
    assert http("GET", sim.url + "/sim/stats")[2]["kv_inject_failed"] == 0


def test_cp_kdn_down_is_a_502_with_the_reason(sim: SimProcess) -> None:
    dead = free_port()
    _, status, _, ack = cp_inject(sim, f"127.0.0.1:{dead}", ["doc1"])
    assert status == 502 and ack["ok"] is False and ack["injected_kids"] == []
    assert ack["keys_injected"] == 0 and "kdn unreachable" in ack["detail"]
    assert f"127.0.0.1:{dead}" in ack["detail"]
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (1, 1)


def test_cp_kdn_error_and_timeout_are_502s(sim: SimProcess, kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", {"fail_status": 503, "fault_on": "inject"})
    _, status, _, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}", ["doc1"])
    assert status == 502 and ack["ok"] is False and "kdn answered HTTP 503" in ack["detail"]
    http("POST", kdn.url + "/sim/config", {"fail_status": None, "hang": True})
    elapsed, status, _, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}", ["doc1"])
    assert status == 502 and f"kdn timeout after {KDN_TIMEOUT_S:g} s" in ack["detail"], ack
    assert KDN_TIMEOUT_S - TIMER_EARLY_S <= elapsed < KDN_TIMEOUT_S + 0.5
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (2, 2)


def test_cp_rejects_malformed_requests(sim: SimProcess) -> None:
    assert sim.cp_url is not None
    url = sim.cp_url + "/v1/kv/inject_ready"
    good = {"request_id": 1, "kdn_addr": "127.0.0.1:1", "model": "m", "knowledge_ids": ["a"]}
    for bad, detail in [({**good, "request_id": "1"}, "request_id"),
                        ({k: v for k, v in good.items() if k != "kdn_addr"}, "kdn_addr"),
                        ({**good, "knowledge_ids": [1]}, "knowledge_ids"),
                        ({**good, "kdn_addr": " "}, "kdn_addr is empty")]:
        status, _, reply = http("POST", url, bad)
        assert status == 400 and reply["ok"] is False and detail in reply["detail"], reply
    assert http("POST", url, raw=b"{")[::2] == (400, {"ok": False, "detail": "invalid_json"})
    assert http("GET", sim.url + "/sim/stats")[2]["kv_injects"] == 0


@pytest.mark.timeout(30)
def test_cp_port_zero_taken_default_and_taken_explicit(tmp_path: Path) -> None:
    # --cp-port 0: no control plane, no meta.cp_port, no KV pull among its cache features
    # (the Proxy sends its knowledge as text).
    no_pull = {"supported_cache_features": []}
    port = free_port_pair()
    with FakeControlPlane(free_port()) as cp, \
            running_sim(tmp_path / "zero.log", "--proxy-cp-url", cp.url, "--cp-port", "0",
                        port=port):
        body = cp.wait_for_calls(1)[0]["body"]
        assert body["meta"] == {"version": "instance_v1", "simulated": True, "max_num_seqs": 8,
                                "kv_mem_gb": 128.0}
        assert body["capabilities"]["runtime"] == no_pull
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/healthz", timeout=1)
    # Default port (data + 1) taken: serve the data plane anyway, register without cp_port.
    port = free_port_pair()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port + 1))
        blocker.listen()
        with FakeControlPlane(free_port()) as cp, \
                running_sim(tmp_path / "taken.log", "--proxy-cp-url", cp.url,
                            port=port) as sim:
            body = cp.wait_for_calls(1)[0]["body"]
            assert "cp_port" not in body["meta"] and body["capabilities"]["runtime"] == no_pull
            assert "running without a control plane" in sim.log()
        # An explicit --cp-port that cannot be bound is fatal.
        sim = SimProcess(["--no-register", "--cp-port", str(port + 1)], tmp_path / "x.log")
        try:
            assert sim.proc.wait(10) == 1
            assert "cannot bind the control plane" in sim.log()
        finally:
            sim.terminate()

