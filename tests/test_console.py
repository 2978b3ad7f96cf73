"""`cacheroute-proxy console` in a real terminal: tmux runs it against a live proxy (workers,
simulated instances, a simulated Scheduler); the test types as an operator would and reads the
screen. Needs tmux: skipped without it, unless CACHEROUTE_REQUIRE_TMUX=1 (.ci/run sets it).

CACHEROUTE_CONSOLE_SESSION=<path> also saves the whole session's text there."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.harness import ROOT, free_port, get, post, wait_until
from tests.test_scheduler_link import PROXY_ID, SimScheduler, link_env
from tests.tmux import Tmux, find_tmux

TTL_S = 4  # heartbeats every 1 s: never stale; the hand-registered instance expires within seconds
GHOST = "ghost-no-heartbeat"


@pytest.fixture
def terminal_env(tmp_path: Path) -> dict[str, str]:
    if find_tmux() is None:
        if os.environ.get("CACHEROUTE_REQUIRE_TMUX") == "1":
            pytest.fail("tmux is required here (.ci/run installs it) but is not on PATH")
        pytest.skip("tmux is not installed (apt-get install tmux; .ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROXY_", "TMUX"))}
    return {**env, "XDG_STATE_HOME": str(tmp_path / "state")}


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SimScheduler]:
    sched = SimScheduler(tmp_path).start()
    yield sched
    sched.stop()


@pytest.mark.slow
def test_an_operator_session_in_a_real_terminal(make_cluster, scheduler, terminal_env, tmp_path):
    cluster = make_cluster(workers=2, env=link_env(scheduler.url, PROXY_INSTANCE_TTL_S=str(TTL_S),
                                                   PROXY_INSTANCE_PURGE_GRACE_S="600"))
    live = [cluster.add_instance().instance_id for _ in range(2)]
    post(f"{cluster.cp_url}/v1/instance/register", {"host": "127.0.0.1", "port": free_port(), "instance_id": GHOST})
    wait_until(lambda: {r["instance_id"]: r["health"] for r in
                        get(f"{cluster.cp_url}/v1/instance/list?include_dead=true")}.get(GHOST) == "expired",
               3 * TTL_S, message="the hand-registered instance expired")
    wait_until(lambda: cluster.status()["scheduler"]["heartbeats_ok"] >= 1, 20, message="registered")

    term = Tmux([sys.executable, "-m", "cacheroute_proxy", "console", "--url", cluster.cp_url],
                cwd=ROOT, env=terminal_env)
    try:
        term.wait_for(f"control plane {cluster.cp_url}, reachable")
        term.wait_for("cacheroute>")

        _enter(term, ":help")
        term.wait_for(":watch [--all] [--interval S] [--limit N]")

        _enter(term, ":status")
        screen = term.wait_for(f"scheduler   registered with {scheduler.url} as {PROXY_ID}")
        assert "2 alive / 3 registered" in screen

        _enter(term, ":instances --all 5")
        screen = term.wait_for(GHOST)
        rows = {line.split()[0]: line.split() for line in screen.splitlines()
                if line.split() and line.split()[0] in (*live, GHOST)}
        assert rows[GHOST][2] == "expired" and [rows[i][2] for i in live] == ["healthy", "healthy"]

        term.type(":sch")  # Tab completes the command...
        term.send("Tab")
        term.wait_for("cacheroute> :scheduler")
        term.send("Enter")
        term.wait_for("heartbeats ok")
        term.type(":instances --a")  # ...and its options
        term.send("Tab")
        term.wait_for("cacheroute> :instances --all")
        _enter(term, "1")
        term.wait_for("listing all, first 1 of 3")

        _enter(term, ":frobnicate")
        term.wait_for("unknown command: :frobnicate (:help lists the commands)")

        _enter(term, ":watch --interval 0.5")
        term.wait_for("refresh 3,")  # it refreshes by itself
        term.send("C-c")  # back to the prompt, not out of the console
        screen = term.wait_for("(watch stopped)")
        wait_until(lambda: term.screen().splitlines()[-1] == "cacheroute>", 10, message="the prompt back")
        assert term.exit_status() is None

        term.send("Up")  # history: the last line comes back
        term.wait_for("cacheroute> :watch --interval 0.5")
        term.send("C-u")
        _enter(term, ":exit")
        assert wait_until(lambda: term.exit_status() is not None, 10, message="the console ended") \
            and term.exit_status() == 0
        session = term.screen(history=True)
    finally:
        term.close()

    (tmp_path / "console_session.txt").write_text(session + "\n")
    if os.environ.get("CACHEROUTE_CONSOLE_SESSION"):
        Path(os.environ["CACHEROUTE_CONSOLE_SESSION"]).write_text(session + "\n")
    history = (Path(terminal_env["XDG_STATE_HOME"]) / "cacheroute-proxy" / "console_history").read_text()
    assert [":status", ":instances --all 5", ":watch --interval 0.5", ":exit"] == \
        [line for line in history.splitlines() if line in (":status", ":instances --all 5",
                                                            ":watch --interval 0.5", ":exit")]


def test_the_console_stays_when_the_proxy_is_down_and_ctrl_d_leaves_with_0(terminal_env):
    url = f"http://127.0.0.1:{free_port()}"
    term = Tmux([sys.executable, "-m", "cacheroute_proxy", "console", "--url", url], cwd=ROOT, env=terminal_env)
    try:
        term.wait_for(f"control plane {url}, NOT reachable now")
        _enter(term, "status")
        term.wait_for(f"error: control plane unreachable at {url}")
        _enter(term, "instances --all")
        wait_until(lambda: term.screen().count(f"unreachable at {url}") >= 3, 10, message="a second error")
        wait_until(lambda: term.screen().splitlines()[-1] == "cacheroute>", 10, message="the prompt back")
        term.type(":instan")  # Ctrl-C at the prompt drops the line, as in a shell, and stays
        # Only once the line is on the screen: a ^C the terminal gets first flushes the unread
        # text from its input queue, and the operator could not have seen the line.
        wait_until(lambda: term.screen().splitlines()[-1] == "cacheroute> :instan", 10, message="the typed line")
        term.send("C-c")
        wait_until(lambda: term.screen().splitlines()[-2:] == ["cacheroute> :instan", "cacheroute>"], 10,
                   message="a fresh prompt after Ctrl-C")
        assert term.exit_status() is None
        term.send("C-d")  # leaves with 0
        assert wait_until(lambda: term.exit_status() is not None, 10,
                          message=f"the console ended\n{term.screen()}") \
            and term.exit_status() == 0
    finally:
        term.close()


def _enter(term: Tmux, line: str) -> None:
    term.type(line)
    term.send("Enter")
