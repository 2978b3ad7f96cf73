"""`cacheroute-proxy status` and `loads` against a running proxy."""

from __future__ import annotations

import io
import subprocess
import sys

from cacheroute_proxy.cli import status_view
from tests.harness import ROOT, chat_body, http


def _cli(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cacheroute_proxy", *args, "--url", cluster.cp_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_status_and_loads_tables(make_cluster):
    cluster = make_cluster(workers=2, strategy="least_load")
    inst = cluster.add_instance()
    assert http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False))[0] == 200
    status = _cli(cluster, "status")
    assert status.returncode == 0, status.stderr
    assert "1 alive / 1 registered" in status.stdout and status.stdout.count(" alive ") >= 2
    assert "epoch 1" in status.stdout and "corrections 0" in status.stdout
    loads = _cli(cluster, "loads")
    assert loads.returncode == 0, loads.stderr
    assert "strategy least_load" in loads.stdout and inst.instance_id in loads.stdout
    line = next(row for row in loads.stdout.splitlines() if inst.instance_id in row)
    assert line.split()[1:3] == ["yes", "0"]  # alive, inflight 0


def test_watch_refreshes_and_unreachable_is_an_error():
    calls = []
    out = io.StringIO()
    assert status_view.show(lambda: calls.append(1) or f"round {len(calls)}", out, 0.01, rounds=3) == 0
    assert out.getvalue().count("round") == 3
    done = subprocess.run([sys.executable, "-m", "cacheroute_proxy", "status", "--url", "http://127.0.0.1:9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "unreachable" in done.stdout
