"""The inspecting commands against a running proxy, by their output and exit codes: `status`,
`loads`, `instances [--all] [--limit N]`, `scheduler`, `watch`, and `console` fed from a pipe
(tests/test_console.py drives it in a real terminal); and `shm unlink`, which refuses a segment
that a running proxy uses."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from cacheroute_proxy.cli import status_view
from cacheroute_proxy.cli.control_client import local_url
from cacheroute_proxy.cli.line_editing import candidates, history_path
from shm_schema import Segment, layout, process_identity
from shm_schema.bitfields import ProcessIdentity
from tests.harness import ROOT, Process, chat_body, free_port, get, http, post, wait_until
from tests.test_scheduler_link import PROXY_ID, SimScheduler, link_env
from tests.test_sidecar import sidecar  # noqa: F401 - a fixture

DOWN_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
TTL_S = 4  # heartbeats every 1 s: never stale (silent over TTL/2), a silent instance expires in 4 s


def run_cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    return subprocess.run([sys.executable, "-m", "cacheroute_proxy", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout, env={**clean, **(env or {})})


def _cli(cluster, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--url", cluster.cp_url, **kw)


def _rows(stdout: str, ids: list[str]) -> dict[str, list[str]]:
    """The table rows of the listed ids, split into cells."""
    return {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.split() and line.split()[0] in ids}


def test_status_and_loads_tables(make_cluster):
    cluster = make_cluster(workers=2, strategy="least_load")
    inst = cluster.add_instance()
    assert http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))[0] == 200
    status = _cli(cluster, "status")
    assert status.returncode == 0, status.stderr
    assert "1 alive / 1 registered" in status.stdout and status.stdout.count(" alive ") >= 2
    assert "epoch 1" in status.stdout and "corrections 0" in status.stdout
    assert "scheduler   off (SCHEDULER_CP_URL is not set)" in status.stdout
    loads = _cli(cluster, "loads")
    assert loads.returncode == 0, loads.stderr
    assert "strategy least_load" in loads.stdout and inst.instance_id in loads.stdout
    line = next(row for row in loads.stdout.splitlines() if inst.instance_id in row)
    assert line.split()[1:3] == ["yes", "0"]  # alive, inflight 0
    as_json = _cli(cluster, "loads", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["strategy"] == "least_load"


@pytest.mark.slow
def test_instances_alive_only_or_all_with_a_limit(make_cluster):
    cluster = make_cluster(workers=1, env={"PROXY_INSTANCE_TTL_S": str(TTL_S),
                                           "PROXY_INSTANCE_PURGE_GRACE_S": "600"})
    live = [cluster.add_instance().instance_id for _ in range(2)]
    ghost = "ghost-no-heartbeat"  # registered by hand, never heard from again: expired, not purged
    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": free_port(), "instance_id": ghost})
    wait_until(lambda: {r["instance_id"]: r["health"] for r in
                        get(f"{cluster.cp_url}/v1/instance/list?include_dead=true")}.get(ghost) == "expired",
               3 * TTL_S, message="the hand-registered instance expired")
    alive = _cli(cluster, "instances")
    assert alive.returncode == 0, alive.stderr
    assert f"2 alive / 3 registered (ttl {TTL_S}s); listing alive" in alive.stdout
    rows = _rows(alive.stdout, [*live, ghost])
    assert sorted(rows) == sorted(live) and all(r[2] == "healthy" for r in rows.values())
    assert rows[live[0]][1].startswith("127.0.0.1:") and rows[live[0]][3] == "0"  # address, inflight

    everything = _cli(cluster, "instances", "--all")
    rows = _rows(everything.stdout, [*live, ghost])
    assert everything.returncode == 0 and sorted(rows) == sorted([*live, ghost])
    assert rows[ghost][2] == "expired"
    limited = _cli(cluster, "instances", "--all", "--limit", "1")
    assert list(_rows(limited.stdout, [*live, ghost])) == [live[0]]  # registration order
    assert "first 1 of 3" in limited.stdout
    assert len(_rows(_cli(cluster, "instances", "--all", "2").stdout, [*live, ghost])) == 2  # `:instances N`

    as_json = _cli(cluster, "instances", "--all", "--json")
    body = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and (body["alive"], body["registered"], body["ttl_s"]) == (2, 3, TTL_S)
    assert [r["health"] for r in body["instances"]] == ["healthy", "healthy", "expired"]

    for bad in (["instances", "--limit", "0"], ["instances", "two"], ["watch", "--interval", "0"],
                ["instances", "--frobnicate"]):
        refused = _cli(cluster, *bad)
        assert refused.returncode == 2 and "error" in refused.stderr, bad


def test_scheduler_registration_and_its_loss(make_cluster, tmp_path):
    sched = SimScheduler(tmp_path).start()
    try:
        cluster = make_cluster(workers=1, env=link_env(sched.url))
        wait_until(lambda: cluster.status()["scheduler"]["heartbeats_ok"] >= 1, 20, message="registered")
        shown = _cli(cluster, "scheduler")
        assert shown.returncode == 0, shown.stderr
        assert f"registered with {sched.url} as {PROXY_ID}" in shown.stdout
        assert "NOT registered" not in shown.stdout and "last error      -" in shown.stdout
        assert "sent again      0 (a kept-alive connection closed unanswered)" in shown.stdout
        assert f"scheduler   registered with {sched.url} as {PROXY_ID}" in _cli(cluster, "status").stdout
        link = json.loads(_cli(cluster, "scheduler", "--json").stdout)
        assert link["registered"] is True and link["proxy_id"] == PROXY_ID
    finally:
        sched.stop()

    def lost() -> str | None:
        done = _cli(cluster, "scheduler")
        return done.stdout if done.returncode == 0 and "NOT registered" in done.stdout else None
    text = wait_until(lost, 20, interval=0.3, message="the lost Scheduler shown")
    assert f"NOT registered with {sched.url} as {PROXY_ID}" in text and "last error:" in text


def test_the_debug_token_is_sent_when_configured(make_cluster):
    token = "console-test-token"
    cluster = make_cluster(workers=1, env={"PROXY_CP_TOKEN": token, "PROXY_DEBUG_REQUIRES_TOKEN": "1"})
    refused = _cli(cluster, "instances")
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr and "PROXY_CP_TOKEN" in refused.stderr
    token_file = cluster.tmp_path / "token"
    token_file.write_text(token + "\n")
    for env in ({"PROXY_CP_TOKEN": token}, {"PROXY_CP_TOKEN_FILE": str(token_file)}):
        done = _cli(cluster, "scheduler", env=env)
        assert done.returncode == 0 and "off (SCHEDULER_CP_URL is not set)" in done.stdout, done.stderr


def test_unreachable_is_exit_1_and_the_url_comes_from_the_environment():
    for command in ("status", "instances", "scheduler", "loads"):
        done = run_cli(command, "--url", DOWN_URL)
        assert done.returncode == 1 and "unreachable at http://127.0.0.1:9" in done.stderr, command
        assert done.stdout == ""  # a script reading stdout gets nothing half-made
    port = free_port()
    done = run_cli("instances", env={"PROXY_CP_HOST": "127.0.0.1", "PROXY_CP_PORT": str(port)})
    assert done.returncode == 1 and f"unreachable at http://127.0.0.1:{port}" in done.stderr
    assert run_cli("status", env={"PROXY_CP_PORT": "0"}).returncode == 2  # a configuration error
    assert local_url("0.0.0.0", 8002) == "http://127.0.0.1:8002" and local_url("::", 1) == "http://[::1]:1"
    assert local_url("fd00::5", 8002) == "http://[fd00::5]:8002" and local_url("cp.lan", 1) == "http://cp.lan:1"


def _interruptible() -> None:
    # As from a terminal: a suite started in the background of a non-interactive shell hands
    # its children SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_watch_keeps_refreshing_while_the_proxy_is_down_and_ctrl_c_ends_it_with_0(tmp_path):
    out_path = tmp_path / "watch.out"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    with open(out_path, "w") as out:
        watch = subprocess.Popen([sys.executable, "-m", "cacheroute_proxy", "watch", "--interval", "0.2",
                                  "--url", DOWN_URL], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=clean,
                                 preexec_fn=_interruptible)
    try:
        wait_until(lambda: "refresh 3," in out_path.read_text(), 20, message="three refreshes")
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=10) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    text = out_path.read_text()
    assert "watch every 0.2s, refresh 3" in text and "error: control plane unreachable" in text


def test_watch_refreshes_until_rounds_are_done():
    calls = []
    out = io.StringIO()
    assert status_view.show(lambda: calls.append(1) or f"round {len(calls)}", out, 0.01, rounds=3) == 0
    assert out.getvalue().count("round") == 3


def test_console_from_a_pipe_survives_errors_and_a_proxy_that_is_down(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    script = ":status\nfrobnicate\ninstances --all 5\n:instances --limit zero\n:help\n:help watch\n:exit\n"
    done = run_cli("console", "--url", DOWN_URL, stdin=script, env=env)
    assert done.returncode == 0, done.stderr
    assert "NOT reachable now" in done.stdout
    assert done.stderr.count("unreachable at http://127.0.0.1:9") == 2  # :status and instances
    assert "unknown command: frobnicate (:help lists the commands)" in done.stderr
    assert "error: :instances: argument --limit: not a whole number: 'zero'" in done.stderr
    assert ":watch [--all] [--interval S] [--limit N]" in done.stdout  # :help
    assert "--interval S" in done.stdout and "usage: :watch" in done.stdout  # :help watch
    ended = run_cli("console", "--url", DOWN_URL, stdin=":status\n", env=env)  # Ctrl-D: end of input
    assert ended.returncode == 0


def test_completion_candidates_and_history_place():
    options = {"instances": ["--all", "--json", "--limit"], "watch": ["--all", "--interval", "--limit"],
               "status": ["--json", "--watch"]}
    assert candidates("", ":in", options, ["help", "exit"]) == [":instances "]
    assert candidates("", "", options, ["help"]) == ["instances ", "watch ", "status ", "help "]
    assert candidates(":watch ", "--i", options, []) == ["--interval "]
    assert candidates("instances --all ", "--l", options, []) == ["--limit "]
    assert candidates(":help ", "wa", options, []) == ["watch "]
    assert candidates(":frobnicate ", "--", options, []) == []
    assert str(history_path({"XDG_STATE_HOME": "/s"})) == "/s/cacheroute-proxy/console_history"
    assert str(history_path({"HOME": "/h"})).endswith(".local/state/cacheroute-proxy/console_history")


# --- shm unlink: never under a running proxy (make clean-shm) ---------------------------------------
def _unlink(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return run_cli("shm", "unlink", "--name", name, *flags)


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm{name}")


def test_shm_unlink_refuses_while_the_sidecar_lives_and_force_removes(sidecar):  # noqa: F811
    start, _ = sidecar
    sc = start()
    done = _unlink(sc.shm_name)
    assert done.returncode == 1, done
    assert f"sidecar (pid {sc.pid})" in done.stderr and "--force" in done.stderr, done.stderr
    assert _exists(sc.shm_name) and get(f"{sc.url}/healthz")["ok"]

    done = _unlink(sc.shm_name, "--force")
    assert done.returncode == 0 and f"removed {sc.shm_name}" in done.stdout, done
    assert f"pid {sc.pid}" in done.stderr  # said what it did: the sidecar serves on from its mapping
    assert not _exists(sc.shm_name)


def test_shm_unlink_removes_once_the_owner_is_gone_or_its_pid_names_another_process(  # noqa: F811
        sidecar, tmp_path):
    start, _ = sidecar
    sc = start()
    sc.stop(signal.SIGKILL)  # no clean exit: the header still names it
    seg = Segment.attach(sc.shm_name)
    owner = seg.load(layout.H_SIDECAR_IDENTITY)
    assert ProcessIdentity.pid(owner) == sc.pid
    # The pid, reused by another process (a live one, started at another time): gone all the same.
    other = Process(["-c", "import time; time.sleep(60)"], {}, tmp_path / "sleeper.log")
    try:
        ticks = process_identity.start_ticks(other.pid)
        assert ticks is not None
        seg.store(layout.H_SIDECAR_IDENTITY, ProcessIdentity.pack(other.pid, ticks))
        done = _unlink(sc.shm_name)  # the control: that process itself is alive, so refused
        assert done.returncode == 1 and f"pid {other.pid}" in done.stderr, done
        seg.store(layout.H_SIDECAR_IDENTITY, ProcessIdentity.pack(other.pid, ticks + 1))
        seg.close()
        done = _unlink(sc.shm_name)
        assert done.returncode == 0 and f"removed {sc.shm_name}" in done.stdout, done
        assert not _exists(sc.shm_name)
    finally:
        other.stop()
    done = _unlink(sc.shm_name)
    assert done.returncode == 0 and f"no segment named {sc.shm_name}" in done.stdout, done


def test_shm_unlink_refuses_while_workers_serve_without_a_sidecar(make_cluster):
    """Workers serve on from the segment while their sidecar is down (restarting): it is in
    use all the same. The header holds no sidecar here, as after the sidecar's clean exit."""
    cluster = make_cluster(workers=2)
    seg = Segment.attach(cluster.shm_name)
    sidecar_identity = seg.load(layout.H_SIDECAR_IDENTITY)
    seg.store(layout.H_SIDECAR_IDENTITY, 0)
    try:
        done = _unlink(cluster.shm_name)
    finally:
        seg.store(layout.H_SIDECAR_IDENTITY, sidecar_identity)
        seg.close()
    assert done.returncode == 1, done
    pids = sorted(cluster.worker_pids().values())
    assert f"in use by 2 workers (pids {pids[0]}, {pids[1]})." in done.stderr, done.stderr
    assert _exists(cluster.shm_name)


def test_shm_unlink_finds_the_sidecar_of_a_segment_of_another_layout(sidecar):  # noqa: F811
    """An upgrade's case: the old proxy still runs on a segment the new build cannot read. Its
    sidecar is in the header's first words, which every layout has kept in place."""
    start, _ = sidecar
    sc = start()
    seg = Segment.attach(sc.shm_name)
    seg.store(layout.H_LAYOUT_VERSION, layout.LAYOUT_VERSION - 1)
    seg.close()
    done = _unlink(sc.shm_name)
    assert done.returncode == 1 and f"sidecar (pid {sc.pid})" in done.stderr, done
    assert _exists(sc.shm_name)


@pytest.mark.parametrize("force", [False, True])
def test_make_clean_shm_says_what_the_command_does(force):
    """`make clean-shm` runs `shm unlink`, with --force only when FORCE=1 is given."""
    args = ["make", "-n", "--no-print-directory", "clean-shm", *(["FORCE=1"] if force else [])]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    line = done.stdout.strip().splitlines()[-1]
    command = "-m cacheroute_proxy shm unlink" + (" --force" if force else "")
    assert line.endswith(command), line
