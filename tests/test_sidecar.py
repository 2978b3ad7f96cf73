"""The sidecar alone: control-plane wire compatibility, validation that changes nothing,
TTL liveness and purge, and refusing a segment it must not use."""

from __future__ import annotations

from http.client import HTTPConnection
import json
import shutil
import subprocess
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from shm_schema import Segment, layout
from tests.harness import Process, free_port, get, http, post, private_segment_name, wait_until


@pytest.fixture
def sidecar(tmp_path):
    started = []

    def start(ttl: float = 30.0, grace: float = 60.0, capacity: int = 8, name: str | None = None):
        port = free_port()
        name = name or private_segment_name()
        env = {"PROXY_CP_PORT": str(port), "PROXY_SHM_NAME": name, "PROXY_INSTANCE_TTL_S": str(ttl),
               "PROXY_INSTANCE_PURGE_GRACE_S": str(grace), "PROXY_SHM_INSTANCE_CAPACITY": str(capacity)}
        proc = Process(["-m", "sidecar"], env, tmp_path / f"sidecar{len(started)}.log")
        proc.url = f"http://127.0.0.1:{port}"
        proc.shm_name = name
        started.append(proc)
        return proc

    def ready(proc):
        wait_until(lambda: get(f"{proc.url}/healthz", timeout=1)["ok"], 15, message=proc.log())
        return proc

    yield lambda **kw: ready(start(**kw)), start
    for proc in started:
        proc.stop()
        Segment.unlink(proc.shm_name)


def _register(url: str, port: int, **extra) -> dict:
    return post(f"{url}/v1/instance/register", {"host": "127.0.0.1", "port": port, **extra})


def test_register_heartbeat_unregister_list(sidecar):
    start, _ = sidecar
    sc = start(ttl=30)
    reply = _register(sc.url, 9001, capabilities={"schema_version": "1", "model": {"identifier": "m"}})
    assert reply["instance_id"] == "hp_127.0.0.1:9001" and reply["heartbeat_interval_s"] == 10
    assert reply["ttl_s"] == 30 and reply["capability_fingerprint"].startswith("sha256:")
    fingerprint = reply["capability_fingerprint"]
    # Upsert keeps the slot and its generation.
    again = _register(sc.url, 9001, capabilities={"schema_version": "1", "model": {"identifier": "m"}})
    assert again["capability_fingerprint"] == fingerprint
    rows = get(f"{sc.url}/v1/instance/list")
    assert [r["instance_id"] for r in rows] == ["hp_127.0.0.1:9001"] and rows[0]["load"]["inflight"] == 0

    hb = f"{sc.url}/v1/instance/heartbeat"
    assert post(hb, {"instance_id": "hp_127.0.0.1:9001", "capability_fingerprint": fingerprint}) == {"ok": True}
    assert post(hb, {"instance_id": "nobody"}) == {"ok": False}
    mismatch = post(hb, {"instance_id": "hp_127.0.0.1:9001", "capability_fingerprint": "sha256:other"})
    assert mismatch["requires_capabilities"] and mismatch["error"] == "capability_fingerprint_mismatch"
    assert post(hb, {"instance_id": "hp_127.0.0.1:9001", "qps_1m": 2.5}) == {"ok": True}
    assert get(f"{sc.url}/v1/instance/list")[0]["load"]["qps_1m"] == 2.5

    assert post(f"{sc.url}/v1/instance/unregister", {"instance_id": "hp_127.0.0.1:9001"}) == {"ok": True}
    assert post(f"{sc.url}/v1/instance/unregister", {"instance_id": "hp_127.0.0.1:9001"}) == {"ok": False}
    assert get(f"{sc.url}/v1/instance/list?include_dead=true") == []


@pytest.mark.parametrize("body, field", [
    ({"port": 9001}, "host"),
    ({"host": "127.0.0.1"}, "port"),
    ({"host": "127.0.0.1", "port": "abc"}, "port"),
    ({"host": "127.0.0.1", "port": 70000}, "port"),
    ({"host": "not a host", "port": 9001}, "host"),
    ({"host": "127.0.0.1/path", "port": 9001}, "host"),
    ({"host": "127.0.0.1", "port": 9001, "instance_id": "x" * 200}, "instance_id"),
    ({"host": "127.0.0.1", "port": 9001, "capabilities": {"surprise": 1}}, "surprise"),
    ({"host": "127.0.0.1", "port": 9001, "weight": -1}, "weight"),
])
def test_bad_register_payload_names_field_and_changes_nothing(sidecar, body, field):
    start, _ = sidecar
    sc = start()
    _register(sc.url, 9100, instance_id="keep")
    before = get(f"{sc.url}/debug/instance_loads")["instances"]
    status, reply, _ = http("POST", f"{sc.url}/v1/instance/register", body)
    assert 400 <= status < 500 and field in reply["detail"], reply
    assert "regex" not in reply["detail"] and "\\" not in reply["detail"], reply  # in words
    if field == "host" and "host" in body:
        assert "a host name, an IPv4 address or an IPv6 address" in reply["detail"], reply
    after = get(f"{sc.url}/debug/instance_loads")["instances"]
    assert [(r["instance_id"], r["slot_generation"]) for r in after] == \
        [(r["instance_id"], r["slot_generation"]) for r in before]


def test_invalid_json_and_full_table(sidecar):
    start, _ = sidecar
    sc = start(capacity=2)
    status, reply, _ = http("POST", f"{sc.url}/v1/instance/heartbeat", raw=b"{oops")
    assert status == 400 and reply["error"] == "invalid_json"
    _register(sc.url, 9001)
    _register(sc.url, 9002)
    status, reply, _ = http("POST", f"{sc.url}/v1/instance/register", {"host": "127.0.0.1", "port": 9003})
    assert status == 507 and reply["error"] == "instance_table_full"
    ports = sorted(r["port"] for r in get(f"{sc.url}/v1/instance/list"))
    assert ports == [9001, 9002]


def test_ttl_expiry_then_purge_with_new_generation(sidecar):
    start, _ = sidecar
    sc = start(ttl=1.0, grace=1.0)
    _register(sc.url, 9001, instance_id="a")
    generation = get(f"{sc.url}/debug/instance_loads")["instances"][0]["slot_generation"]
    wait_until(lambda: get(f"{sc.url}/debug/status")["expired_instances"] == 1, 4, message="expired")
    assert get(f"{sc.url}/v1/instance/list") == []  # out of the candidate set
    assert post(f"{sc.url}/v1/instance/heartbeat", {"instance_id": "a"}) == {"ok": True}
    assert get(f"{sc.url}/debug/status")["alive_instances"] == 1  # a heartbeat revives it
    wait_until(lambda: get(f"{sc.url}/v1/instance/list?include_dead=true") == [], 6, message="purged")
    _register(sc.url, 9001, instance_id="a")
    assert get(f"{sc.url}/debug/instance_loads")["instances"][0]["slot_generation"] != generation


def test_refuses_a_segment_of_another_layout(sidecar, tmp_path):
    _, start_raw = sidecar
    name = private_segment_name()
    seg = Segment.create_or_attach(name, 4, 2)
    seg.store(layout.H_LAYOUT_VERSION, layout.LAYOUT_VERSION + 7)
    seg.close()
    proc = start_raw(name=name)
    assert proc.popen.wait(15) == 2
    log = proc.log()
    assert f"layout version {layout.LAYOUT_VERSION + 7}" in log and f"layout version {layout.LAYOUT_VERSION}" in log
    assert "Traceback" not in log


def test_second_sidecar_on_the_same_segment_refuses(sidecar):
    start, start_raw = sidecar
    first = start()
    second = start_raw(name=first.shm_name)
    assert second.popen.wait(15) == 2
    assert "another sidecar" in second.log()
    time.sleep(0.2)
    assert get(f"{first.url}/healthz")["ok"]


def test_max_num_seqs_from_meta_survives_a_sidecar_restart(sidecar):
    start, start_raw = sidecar
    first = start()
    _register(first.url, 9001, instance_id="small", meta={"max_num_seqs": 4, "cp_port": 9101})
    _register(first.url, 9002, instance_id="bad", meta={"max_num_seqs": True})
    _register(first.url, 9003, instance_id="huge", meta={"max_num_seqs": 10**9})
    # A re-registration without it keeps it: meta is merged.
    _register(first.url, 9001, instance_id="small", meta={"version": "instance_v1"})
    first.popen.kill()
    first.popen.wait(10)
    second = start_raw(name=first.shm_name)
    wait_until(lambda: get(f"{second.url}/healthz", timeout=1)["ok"], 15, message=second.log())
    metas = {r["instance_id"]: r["meta"] for r in get(f"{second.url}/v1/instance/list")}
    # Only what the shared table stores comes back; bad values were never stored.
    assert metas == {"small": {"max_num_seqs": 4, "cp_port": 9101}, "bad": {}, "huge": {}}


# --- the content type of a control-plane write ----------------------------------------------------
# Every JSON route of the control plane, in an order that succeeds, with a body it accepts.
WRITES = {
    "/v1/instance/register": {"host": "127.0.0.1", "port": 9001, "instance_id": "i1"},
    "/v1/instance/heartbeat": {"instance_id": "i1"},
    "/v1/instance/resource_snapshot": {"instance_id": "i1", "snapshot": {"devices": {}}},
    "/v1/topology/report": {"instance_id": "i1", "links": {"kdn://k:1": {"bandwidth_mbps": 10}}},
    "/v1/instance/unregister": {"instance_id": "i1"},
}


def raw_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST with exactly these headers (urllib would add a content type of its own)."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", parts.path, body, headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "application/json; charset=utf-8"],
                         ids=["none", "curl-d-form", "json"])
def test_a_json_body_without_a_content_type_or_sent_as_curl_d_sends_it_is_accepted(sidecar, content_type):
    """`curl -d '{json}'` sends application/x-www-form-urlencoded: a body that parses as JSON
    is taken as with no content type, on every writing route."""
    start, _ = sidecar
    sc = start()
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path, body in WRITES.items():
        status, reply = raw_post(f"{sc.url}{path}", json.dumps(body).encode(), headers)
        assert status == 200 and reply.get("ok", True) is True, (path, status, reply)
    assert get(f"{sc.url}/v1/instance/list?include_dead=true") == []  # the last one unregistered it


def test_the_operators_plain_curl_d_registers(sidecar):
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    start, _ = sidecar
    sc = start()
    out = subprocess.run(["curl", "-s", "-d", '{"host": "127.0.0.1", "port": 9001}',
                          f"{sc.url}/v1/instance/register"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["instance_id"] == "hp_127.0.0.1:9001", out.stdout
    assert [r["instance_id"] for r in get(f"{sc.url}/v1/instance/list")] == ["hp_127.0.0.1:9001"]


def test_a_body_of_another_type_is_415_naming_application_json_and_changes_nothing(sidecar):
    start, _ = sidecar
    sc = start()
    body = json.dumps(WRITES["/v1/instance/register"]).encode()
    for content_type in ("text/xml", "application/xml", "application/octet-stream", "text/plain",
                         "multipart/form-data; boundary=x"):
        for path in WRITES:
            status, reply = raw_post(f"{sc.url}{path}", body, {"Content-Type": content_type})
            assert (status, reply["error"]) == (415, "unsupported_media_type"), (content_type, path, reply)
            assert "application/json" in reply["detail"], reply
            assert content_type.split(";")[0] in reply["detail"], reply
    # A real form (not JSON) sent as one: 415 too, saying so.
    status, reply = raw_post(f"{sc.url}/v1/instance/register", b"host=127.0.0.1&port=9001",
                             {"Content-Type": "application/x-www-form-urlencoded"})
    assert (status, reply["error"]) == (415, "unsupported_media_type"), reply
    assert "application/json" in reply["detail"] and "not JSON" in reply["detail"], reply
    # No content type and not JSON: the body is at fault, as with application/json.
    status, reply = raw_post(f"{sc.url}/v1/instance/register", b"host=127.0.0.1", {})
    assert (status, reply["error"]) == (400, "invalid_json"), reply
    assert get(f"{sc.url}/v1/instance/list?include_dead=true") == []
