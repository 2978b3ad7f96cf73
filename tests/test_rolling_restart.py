"""Graceful drain (SIGTERM to a worker) and rolling restart (SIGHUP to the supervisor).

The rolling restart runs in a private network namespace (`unshare --net`), so it can set
`net.ipv4.tcp_migrate_req=1` there without touching the host (tests/rolling_restart_scenario.py
drives it and prints its result as JSON).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, chat_body, wait_until

pytestmark = pytest.mark.timeout(240)

NETNS = "ip link set lo up && sysctl -qw net.ipv4.tcp_migrate_req={migrate} && exec {argv}"


@functools.cache
def _netns_unavailable() -> str | None:
    """Why a private network namespace cannot be made here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    try:
        done = in_private_netns(["true"], migrate=1, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare --net timed out"
    return None if done.returncode == 0 else f"cannot make a network namespace: {done.stderr.strip()[:200]}"


def require_netns() -> None:
    why = _netns_unavailable()
    if why:
        pytest.skip(why)


def in_private_netns(argv: list[str], migrate: int, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run argv in a new network namespace with only `lo`, up, and tcp_migrate_req set there."""
    script = NETNS.format(migrate=migrate, argv=shlex.join(argv))
    return subprocess.run(["unshare", "--net", "--", "sh", "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# --- the kernel fact the design rests on ---------------------------------------------------------
PROBE = r"""
import json, socket, time
def listener():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 18001)); s.listen(128); return s
a, b = listener(), listener()
clients = [socket.create_connection(("127.0.0.1", 18001)) for _ in range(40)]
time.sleep(0.2)
a.close()  # what happens to the connections queued on a?
b.settimeout(0.5); accepted = 0
try:
    while True:
        conn, _ = b.accept(); accepted += 1; conn.sendall(b"ok"); conn.close()
except socket.timeout:
    pass
answered = 0
for c in clients:
    try:
        c.settimeout(1); answered += c.recv(2) == b"ok"
    except OSError:
        pass
print(json.dumps({"clients": 40, "accepted_by_other": accepted, "answered": answered}))
"""


def test_kernel_resets_queued_connections_of_a_closing_reuseport_listener_unless_migrated(tmp_path: Path) -> None:
    require_netns()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    results = {}
    for migrate in (0, 1):
        done = in_private_netns([sys.executable, str(probe)], migrate, timeout=60)
        assert done.returncode == 0, done.stderr
        results[migrate] = json.loads(done.stdout)
    # 0: the connections hashed to the closed listener are lost; 1: all handed to the other
    assert results[0]["answered"] < 40, results
    assert results[1]["answered"] == 40 and results[1]["accepted_by_other"] == 40, results


# --- rolling restart under load ---------------------------------------------------------------------
@pytest.mark.slow
def test_rolling_restart_under_load_fails_no_request(tmp_path: Path) -> None:
    require_netns()
    argv = [sys.executable, "-m", "tests.rolling_restart_scenario", "--log-dir", str(tmp_path)]
    done = in_private_netns(argv, migrate=1, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    load = result.get("load", {})
    context = json.dumps({k: v for k, v in result.items() if k != "load"}, indent=1) + \
        json.dumps(load, indent=1)[:4000] + log[-3000:]
    print(f"rolling restart: {load.get('requests')} requests, {load.get('failed')} failed, "
          f"{load.get('completed_in_restart_window')} completed in the {result.get('restart_window_s')} s "
          f"restart window; streams in flight at the SIGTERMs: {[d['streams'] for d in result.get('drains', [])]}")
    assert "error" not in result, context
    assert result["tcp_migrate_req"] == "1"
    before, after = result["pids_before"], result["pids_after"]
    assert all(before.values()) and all(after.values()), context
    assert not set(before.values()) & set(after.values()), f"not every worker was replaced\n{context}"
    assert load["failed"] == 0, context
    assert load["completed_in_restart_window"] >= 300, context
    assert result["old_workers_exit_codes"] == ["0"] * result["workers"], context
    assert len(result["drains"]) == result["workers"] and all(d["cut"] == 0 for d in result["drained"]), context
    assert sum(d["streams"] for d in result["drains"]) >= 1, f"no stream outlived a SIGTERM\n{context}"
    assert result["leftover_inflight_at_exit"] == 0, context
    assert result["inflight_and_lanes_zero"], context
    assert result["launcher_exit"] == 0, context
    assert result["leftovers"] == {"processes": [], "segment_exists": False}, context
    assert "tcp_migrate_req is 0" not in log  # the namespace has it on: no warning


# --- one worker's drain ---------------------------------------------------------------------------
def _post_chat(url: str, out: list[Any], body: dict[str, Any], heads: list[int] | None = None) -> None:
    """POST a chat request on its own connection; append (status, body, error). `heads` gets
    the status as soon as the response head arrives (a stream under way)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if heads is not None:
            heads.append(response.status)
        out.append((response.status, response.read(), None))
    except (OSError, http.client.HTTPException) as exc:
        out.append((None, b"", repr(exc)))
    finally:
        conn.close()


def _stream(url: str, out: list[Any], max_tokens: int = 40, heads: list[int] | None = None) -> None:
    _post_chat(url, out, chat_body(max_tokens=max_tokens), heads)


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def test_sigterm_drains_streams_and_closes_keepalive_after_a_last_answer(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(workers=1, env={"PROXY_DRAIN_TIMEOUT_S": "30", "PROXY_KEEPALIVE_TIMEOUT_S": "20"})
    cluster.add_instance(time_scale=1.0)  # 120 tokens at ~25 ms: streams of ~3 s
    url = cluster.worker_url(0)
    idle = http.client.HTTPConnection("127.0.0.1", cluster.private_base, timeout=30)
    idle.request("GET", "/healthz")
    first = idle.getresponse()
    pid = json.loads(first.read())["pid"]
    streams: list[Any] = []
    heads: list[int] = []
    threads = [threading.Thread(target=_stream, args=(url, streams, 120, heads)) for _ in range(3)]
    for t in threads:
        t.start()
    # Under way, not only admitted: the drain's log line below counts streams whose answer began.
    wait_until(lambda: len(heads) == 3 and sum(cluster.inflight(0).values()) == 3, 20,
               message="3 streams in flight, each answer begun")
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: _refuses(cluster.private_base), 20, message="listener closed")
    # The idle keep-alive connection was not closed under us: it gets one last answer that says
    # Connection: close.
    idle.request("GET", "/healthz")
    last = idle.getresponse()
    assert last.status == 200 and last.getheader("connection") == "close"
    last.read()
    for t in threads:
        t.join(60)
    assert [s[0] for s in streams] == [200, 200, 200], streams
    assert all(s[1].rstrip().endswith(b"data: [DONE]") for s in streams), streams
    log = lambda: cluster.launcher_log()  # noqa: E731
    wait_until(lambda: f"worker0 (pid {pid}) exit code 0" in log(), 40, message=f"worker exits 0\n{log()[-3000:]}")
    assert f"worker0[{pid}] INFO cacheroute.worker: draining: stopped accepting; 3 requests in flight (3 streams)" in log()
    assert "3 were in flight at SIGTERM, 3 streams); 0 cut at the deadline" in log(), log()[-3000:]
    assert "released inflight still held at exit" not in log()
    wait_until(lambda: cluster.worker_pids()[0] != pid, 30, message="worker replaced")
    assert cluster.inflight() == {i.instance_id: 0 for i in cluster.instances}
    assert "WARNING cacheroute.host" not in log()  # the host's tcp_migrate_req is a debug note


def test_drain_deadline_cuts_what_is_left_cleanly(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(workers=1, env={"PROXY_DRAIN_TIMEOUT_S": "2"})
    inst = cluster.add_instance("--hold-streams")  # first token, then nothing until released
    url = cluster.worker_url(0)
    pid = cluster.worker_pids()[0]
    results: list[Any] = []
    heads: list[int] = []
    threads = [threading.Thread(target=_stream, args=(url, results, 40, heads)) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(heads) == 2 and sum(cluster.inflight(0).values()) == 2, 20,
               message="2 streams held, each answer begun")
    inst.configure(hang=True)  # and a request that never gets an answer head
    hung: list[Any] = []
    waiting = threading.Thread(target=_post_whole, args=(url, hung))
    waiting.start()
    wait_until(lambda: sum(cluster.inflight(0).values()) == 3, 20, message="3 requests in flight")
    os.kill(pid, signal.SIGTERM)
    for t in [*threads, waiting]:
        t.join(30)
        assert not t.is_alive(), "a client hung past the drain deadline"
    for status, body, error in results:  # streams: an error event, no [DONE]
        assert status == 200 and error is None, results
        assert b'"error":"worker_drain_deadline"' in body and b"[DONE]" not in body, body[-300:]
    assert hung[0][0] == 503 and json.loads(hung[0][1])["error"] == "worker_draining", hung
    log = lambda: cluster.launcher_log()  # noqa: E731
    wait_until(lambda: f"worker0 (pid {pid}) exit code 0" in log(), 40, message=f"worker exits 0\n{log()[-3000:]}")
    assert "drain deadline (2s) reached: cutting 3 requests (2 streams)" in log(), log()[-3000:]
    assert "released inflight still held at exit" not in log()
    wait_until(lambda: cluster.worker_pids()[0] != pid, 30, message="worker replaced")
    assert cluster.inflight() == {inst.instance_id: 0}
    wait_until(lambda: inst.stats()["disconnected"] >= 3, 10, message="upstream connections closed")


def _post_whole(url: str, out: list[Any]) -> None:
    _post_chat(url, out, chat_body(stream=False))


def test_rolling_restart_with_no_spare_row_waits_for_the_old_worker(make_cluster) -> None:  # type: ignore[no-untyped-def]
    # Two workers, two rows: each replacement can only claim the row its predecessor frees.
    cluster = make_cluster(workers=2, env={"PROXY_SHM_WORKER_CAPACITY": "2", "PROXY_DRAIN_TIMEOUT_S": "3"})
    inst = cluster.add_instance("--hold-streams")
    before = cluster.worker_pids()
    held: list[Any] = []
    stream = threading.Thread(target=_stream, args=(cluster.worker_url(0), held))
    stream.start()
    wait_until(lambda: sum(cluster.inflight(0).values()) == 1, 20, message="a stream held by worker 0")
    os.kill(cluster.launcher.pid, signal.SIGHUP)
    log = lambda: cluster.launcher_log()  # noqa: E731
    wait_until(lambda: "rolling restart done: 2 workers replaced" in log(), 60, message=f"restart done\n{log()[-3000:]}")
    after = cluster.worker_pids()
    assert not set(before.values()) & set(after.values()), (before, after)
    assert "all 2 worker rows in use (PROXY_SHM_WORKER_CAPACITY): the replacement waits" in log()
    assert "cannot start" not in log() and "WorkerTableFull" not in log()
    stream.join(30)
    assert held and b'"error":"worker_drain_deadline"' in held[0][1], held
    assert cluster.inflight() == {inst.instance_id: 0}
