"""Logs through a real cluster: PROXY_LOG_FORMAT=json gives one JSON object per line from every
process (time, level, role, pid, logger, message; the request id on what a worker logs for a
request); the access log (PROXY_ACCESS_LOG) writes one line per proxied request, only when on;
the text default is unchanged."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from cacheroute_sim.scheduler.requests import scheduler_body
from tests.harness import Cluster, chat_body, http, wait_until

pytestmark = pytest.mark.timeout(180)

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (supervisor|sidecar|worker\d+)\[\d+\] "
                       r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _objects(log: str) -> list[dict[str, Any]]:
    """Every line of the launcher's log as JSON (a line that is not one fails the test)."""
    return [json.loads(line) for line in log.splitlines() if line.strip()]


def _access(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["logger"] == "cacheroute.access"]


def test_json_logs_and_the_access_log(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: Cluster = make_cluster(workers=2, env={"PROXY_LOG_FORMAT": "json", "PROXY_ACCESS_LOG": "1",
                                                    "PROXY_EJECT_AFTER_FAILURES": "1"})
    inst = cluster.add_instance()
    status, _, headers = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False),
                              headers={"X-Request-Id": "req-<17>"})
    assert status == 200
    wait_until(lambda: _access(_objects(cluster.launcher_log())), 10, message="the access line")
    objects = _objects(cluster.launcher_log())
    roles = {o["role"] for o in objects}
    assert {"supervisor", "sidecar", "worker0", "worker1"} <= roles, roles
    for o in objects:
        assert {"time", "level", "role", "pid", "logger", "message"} <= o.keys(), o
        assert ISO_UTC.match(o["time"]) and isinstance(o["pid"], int), o
    ready = next(o for o in objects if o["message"].startswith("ready: 2 workers"))
    assert ready["role"] == "supervisor" and ready["level"] == "INFO" and "request_id" not in ready
    [line] = _access(objects)
    worker = headers["x-cacheroute-worker"]  # w<index>-pid<pid>
    assert line["role"] == f"worker{worker[1]}" and line["pid"] == int(worker.split("pid")[1]), (line, worker)
    assert line["request_id"] == "req-<17>" and line["worker"] == worker
    assert (line["method"], line["path"], line["status"], line["instance"]) == \
        ("POST", "/v1/chat/completions", 200, inst.instance_id), line
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0, line
    assert line["message"].startswith("POST /v1/chat/completions 200 ") and "request_id=req-<17>" in line["message"]

    # A Scheduler body's Request_ID names the request when the client sends no X-Request-Id;
    # what a worker logs meanwhile carries it (here: the instance ejected after it failed).
    # A 500 is not retried elsewhere; each one ejects the instance (PROXY_EJECT_AFTER_FAILURES=1),
    # and with no other candidate it is tried anyway.
    inst.configure(fail_status=500, fail_rate=1.0)
    for _ in range(2):
        assert http("POST", f"{cluster.dp_url}/v1/chat/completions", scheduler_body(4242, stream=False))[0] == 500
    wait_until(lambda: len(_access(_objects(cluster.launcher_log()))) == 3, 10, message="3 access lines")
    objects = _objects(cluster.launcher_log())
    failed = _access(objects)[1:]
    assert [o["request_id"] for o in failed] == ["4242"] * 2 and {o["status"] for o in failed} == {500}, failed
    ejected = [o for o in objects if "ejected from this worker's candidates" in o["message"]]
    assert ejected and all(o["request_id"] == "4242" and o["level"] == "WARNING" for o in ejected), ejected
    assert ejected[0]["message"].startswith(f"instance {inst.instance_id} ejected")


def test_the_default_is_text_and_no_access_log(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: Cluster = make_cluster(workers=1)
    cluster.add_instance()
    for _ in range(3):
        status, _, _ = http("POST", f"{cluster.dp_url}/v1/chat/completions", chat_body(stream=False),
                            headers={"X-Request-Id": "req-text"})
        assert status == 200
    log = cluster.launcher_log()
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines and all(TEXT_LINE.match(line) for line in lines if not line.startswith(" ")), log
    assert "cacheroute.access" not in log and "req-text" not in log, log


def test_the_access_log_in_text_format(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: Cluster = make_cluster(workers=1, env={"PROXY_ACCESS_LOG": "true", "PROXY_LOG_LEVEL": "warning"})
    inst = cluster.add_instance()
    status, _, _ = http("POST", f"{cluster.dp_url}/v1/completions",
                        {"model": "sim", "prompt": "hi", "max_tokens": 4}, headers={"X-Request-Id": "abc"})
    assert status == 200
    # On even below PROXY_LOG_LEVEL: asking for the access log is asking for its lines.
    line = wait_until(lambda: next((ln for ln in cluster.launcher_log().splitlines()
                                    if "cacheroute.access" in ln), None), 10, message="the access line")
    assert TEXT_LINE.match(line) and " worker0[" in line, line
    assert re.search(rf"INFO cacheroute\.access: POST /v1/completions 200 \d+\.\dms "
                     rf"instance={re.escape(inst.instance_id)} request_id=abc$", line), line
