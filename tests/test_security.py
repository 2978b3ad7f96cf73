"""The control-plane token: required for writes, optional for debug reads, constant-time,
never logged; the simulated instance registers with it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat

import pytest

from cacheroute_proxy.config import Settings
from sidecar.host_header_check import DASHBOARD, HostHeaderCheck
from tests.harness import http
from tests.test_sidecar import raw_post

TOKEN = "s3cret-token-for-tests"


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_guards_registration_and_optionally_debug(make_cluster, tmp_path):
    token_file = tmp_path / "cp.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cluster = make_cluster(workers=1, env={"PROXY_CP_TOKEN_FILE": str(token_file),
                                           "PROXY_DEBUG_REQUIRES_TOKEN": "1"})
    register = f"{cluster.cp_url}/v1/instance/register"
    body = {"host": "127.0.0.1", "port": 9999, "instance_id": "intruder"}
    for headers in ({}, _auth("wrong"), {"Authorization": TOKEN}, _auth(TOKEN + "x")):
        status, reply, got = http("POST", register, body, headers=headers)
        assert status == 401 and reply["error"] == "unauthorized", (headers, reply)
        assert got["www-authenticate"] == "Bearer"
    for path in ("/v1/instance/heartbeat", "/v1/instance/unregister"):
        assert http("POST", f"{cluster.cp_url}{path}", {"instance_id": "x"})[0] == 401
    # Debug reads need it too here, on the control plane and on the workers.
    for url in (f"{cluster.cp_url}/debug/status", f"{cluster.cp_url}/debug/instance_loads",
                f"{cluster.cp_url}/v1/instance/list", f"{cluster.worker_url(0)}/debug/instance_loads"):
        assert http("GET", url)[0] == 401, url
        assert http("GET", url, headers=_auth(TOKEN))[0] == 200, url
    assert http("GET", f"{cluster.cp_url}/healthz")[0] == 200  # liveness probes stay open

    status, reply, _ = http("POST", register, body, headers=_auth(TOKEN))
    assert status == 200 and reply["instance_id"] == "intruder"
    # A simulated instance configured with the token registers and serves.
    inst = cluster.add_instance("--register-token", TOKEN, headers=_auth(TOKEN))
    assert inst.instance_id in {r["instance_id"] for r in
                                http("GET", f"{cluster.cp_url}/v1/instance/list",
                                     headers=_auth(TOKEN))[1]}
    assert TOKEN not in cluster.launcher_log()


def test_debug_reads_open_by_default_writes_closed(make_cluster):
    cluster = make_cluster(workers=1, env={"PROXY_CP_TOKEN": TOKEN})
    assert http("GET", f"{cluster.cp_url}/debug/instance_loads")[0] == 200
    assert http("POST", f"{cluster.cp_url}/v1/instance/register",
                {"host": "127.0.0.1", "port": 9999})[0] == 401


def test_a_web_page_cannot_register_on_a_control_plane_without_token(make_cluster):
    """A page in a browser on this host can POST cross-site without a CORS preflight only a
    "simple" request: a form or text/plain body, or one with no content type at all (fetch
    with a Blob or an ArrayBuffer). The browser marks every such request as the page's with
    `Origin` (and `Sec-Fetch-Site`), which no script can remove: the writing routes refuse
    those, so with no token set a page still cannot register an instance and have requests sent
    to it. The same bytes from curl (no `Origin`) are taken."""
    cluster = make_cluster(workers=1)
    body = json.dumps({"host": "127.0.0.1", "port": 9999, "instance_id": "from-a-web-page"}).encode()
    pages = ({"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
             {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"})
    for page in pages:
        for media_type in (None, "text/plain", "text/plain; charset=utf-8",
                           "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            headers = page if media_type is None else {**page, "Content-Type": media_type}
            for path in ("/v1/instance/register", "/v1/instance/heartbeat", "/v1/instance/unregister",
                         "/v1/instance/resource_snapshot", "/v1/topology/report"):
                status, reply = raw_post(f"{cluster.cp_url}{path}", body, headers)
                assert status == 415 and reply["error"] == "unsupported_media_type", (headers, path, reply)
                assert "web page" in reply["detail"], reply
    assert http("GET", f"{cluster.cp_url}/v1/instance/list")[1] == []
    status, reply = raw_post(f"{cluster.cp_url}/v1/instance/register", body,
                             {"Content-Type": "application/x-www-form-urlencoded"})  # curl -d: fine
    assert status == 200 and reply["instance_id"] == "from-a-web-page"


def test_token_file_errors_name_the_variable(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    for path in (str(empty), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="PROXY_CP_TOKEN_FILE"):
            Settings.from_env({"PROXY_CP_TOKEN_FILE": path})
    assert TOKEN not in repr(Settings(cp_token=TOKEN))


def test_segment_is_private_to_the_service_user(make_cluster):
    cluster = make_cluster(workers=1)
    mode = stat.S_IMODE(os.stat(f"/dev/shm{cluster.shm_name}").st_mode)
    assert mode == 0o600


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::", "proxy.example"])
def test_a_control_plane_beyond_loopback_needs_a_token(host, tmp_path):
    with pytest.raises(ValueError, match="PROXY_CP_HOST.*needs a token"):
        Settings.from_env({"PROXY_CP_HOST": host})
    token_file = tmp_path / "cp.token"
    token_file.write_text(TOKEN)
    assert Settings.from_env({"PROXY_CP_HOST": host, "PROXY_CP_TOKEN_FILE": str(token_file)}).cp_host == host
    for loopback in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert Settings.from_env({"PROXY_CP_HOST": loopback}).cp_host == loopback


def test_without_a_token_the_control_plane_answers_only_its_own_names(make_cluster):
    """DNS rebinding: a page under an attacker's name that resolves to 127.0.0.1 sends that
    name as Host; the control plane refuses it, and nothing is registered."""
    cluster = make_cluster(workers=1)
    body = {"host": "127.0.0.1", "port": 9999, "instance_id": "rebound"}
    port = cluster.cp_port
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        status, reply, _ = http("POST", f"{cluster.cp_url}/v1/instance/register", body,
                                headers={"Host": host})
        assert status == 421 and reply["error"] == "misdirected_request", (host, reply)
        assert http("GET", f"{cluster.cp_url}/debug/status", headers={"Host": host})[0] == 421
    assert all(r["instance_id"] != "rebound" for r in cluster.loads()["instances"])
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
        assert http("GET", f"{cluster.cp_url}/healthz", headers={"Host": host})[0] == 200, host
    # The refusal says, in words, which names are taken and what to set to change that.
    detail = http("GET", f"{cluster.cp_url}/healthz", headers={"Host": "evil.example"})[1]["detail"]
    assert detail.startswith("Host 'evil.example' is not a name of this control plane;"), detail
    for name in ("127.0.0.1", "localhost", "[::1]", socket.gethostname(), str(port),
                 "PROXY_CP_HOST", "PROXY_CP_PORT", "PROXY_CP_TOKEN_FILE"):
        assert name in detail, (name, detail)
    assert "frozenset" not in detail and "\\" not in detail, detail


def test_the_dashboard_listener_names_its_own_hosts_and_settings():
    """PROXY_UI_LISTEN's check: the same refusal, naming PROXY_UI_URL's host and the UI settings."""
    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    checked = HostHeaderCheck(app, "127.0.0.1", 8202, extra=("dash.localtest:8202",), listener=DASHBOARD)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/dashboard", "headers": [(b"host", b"evil.example")]}
    asyncio.run(checked(scope, None, send))
    assert sent[0]["status"] == 421
    detail = json.loads(sent[1]["body"])["detail"]
    assert detail.startswith("Host 'evil.example' is not a name of the dashboard's listener;"), detail
    for name in ("dash.localtest:8202", "127.0.0.1", ":8202", "PROXY_UI_LISTEN", "PROXY_UI_URL", "PROXY_CP_TOKEN_FILE"):
        assert name in detail, (name, detail)


def test_with_a_token_any_host_may_reach_the_control_plane(make_cluster, tmp_path):
    token_file = tmp_path / "cp.token"
    token_file.write_text(TOKEN)
    cluster = make_cluster(workers=1, env={"PROXY_CP_TOKEN_FILE": str(token_file)})
    status, _, _ = http("GET", f"{cluster.cp_url}/debug/status", headers={"Host": "proxy.example"})
    assert status == 200
