"""The demo (`make run-workers`, cacheroute_sim/demo.py): the production launcher plus simulated
instances and a KDN that register themselves; a crashed simulated instance comes back; Ctrl-C
stops everything and leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from cacheroute_proxy.config import Settings
from cacheroute_proxy.supervisor.children import Child
from cacheroute_sim.demo import Demo, alive_among, build_parser, sim_instance_ids
from cacheroute_sim.processes import free_port, free_port_range
from cacheroute_sim.scheduler.requests import scheduler_body
from tests.harness import Engine, Process, SupervisorPorts, chat_body, get, http, wait_until


def commands(pid: int) -> dict[int, str]:
    """pid -> command line of each running child (a zombie not reaped yet is left out)."""
    found = {}
    for child in psutil.Process(pid).children():
        try:
            found[child.pid] = " ".join(child.cmdline())
        except psutil.Error:
            continue
    return found


def alive_ids(cp_url: str) -> set[str]:
    return {r["instance_id"] for r in get(f"{cp_url}/debug/instance_loads")["instances"] if r["is_alive"]}


@pytest.mark.slow
def test_the_demo_serves_on_simulated_instances_and_stops_cleanly(tmp_path: Path) -> None:
    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    sim_base, kdn_port = free_port_range(12), free_port()
    env = {**ports.supervisor_env("least_load"), "PROXY_SIM_INSTANCES": "2",
           "PROXY_SIM_INSTANCE_PORT_BASE": str(sim_base), "PROXY_SIM_KDN_PORT": str(kdn_port)}
    demo = Process(["-m", "cacheroute_sim.demo"], env, tmp_path / "demo.log")
    expected = {f"hp_127.0.0.1:{sim_base}", f"hp_127.0.0.1:{sim_base + 10}"}
    try:
        wait_until(lambda: alive_ids(ports.cp_url) == expected, 40, message=f"both registered\n{demo.tail()}")
        wait_until(lambda: "curl -s" in demo.log(), 10, message="the demo says what to try")

        status, answer, headers = http("POST", f"{ports.dp_url}/v1/chat/completions", chat_body(stream=False))
        assert status == 200 and headers["x-cacheroute-instance"] in expected, answer
        body = scheduler_body(7, stream=False)
        body["Service"].update({"Enable_know_injection": True, "Injection_type": "text",
                                "Knowledge_List": ["k0001"], "Knowledge_length": 64})
        body["Task"]["KDN_server_addr"] = f"127.0.0.1:{kdn_port}"
        status, answer, _ = http("POST", f"{ports.dp_url}/v1/chat/completions", body)
        assert status == 200, answer
        meta = answer["_cacheroute_meta"]
        assert meta["error"] is None and meta["text_only_kids"] + meta["kv_ready_kids"] == ["k0001"]

        crashed = next(pid for pid, line in commands(demo.pid).items() if f"--port {sim_base + 10}" in line)
        os.kill(crashed, signal.SIGKILL)
        wait_until(lambda: any(f"--port {sim_base + 10}" in line and pid != crashed
                               for pid, line in commands(demo.pid).items()), 15,
                   message=f"the crashed instance started again\n{demo.tail()}")
        wait_until(lambda: alive_ids(ports.cp_url) == expected, 20, message="it registered again")
        children = psutil.Process(demo.pid).children(recursive=True)
    finally:
        code = demo.stop(signal.SIGINT, timeout=60)
    assert code == 0, demo.tail()
    assert "unregistered" in demo.log()  # the instances left before the proxy stopped
    assert not os.path.exists(f"/dev/shm{ports.shm_name}")
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


# --- the demo's instances report resources; its log says each thing once, in the chosen format --------
def start_demo(tmp_path: Path, name: str, **env: str) -> tuple[SupervisorPorts, Process, set[str]]:
    ports = SupervisorPorts(workers=2, shm_prefix="cacheroute_test")
    sim_base, kdn_port = free_port_range(12), free_port()
    demo = Process(["-m", "cacheroute_sim.demo"], {
        **ports.supervisor_env("least_load"), "PROXY_SIM_INSTANCES": "2",
        "PROXY_SIM_INSTANCE_PORT_BASE": str(sim_base), "PROXY_SIM_KDN_PORT": str(kdn_port), **env},
        tmp_path / f"{name}.log")
    return ports, demo, {f"hp_127.0.0.1:{sim_base}", f"hp_127.0.0.1:{sim_base + 10}"}


def repeated(lines: list[str]) -> list[str]:
    return sorted({line for line in lines if lines.count(line) > 1})


TEXT_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def test_the_demo_counts_its_own_instances_and_logs_each_line_once(tmp_path: Path) -> None:
    """With an engine of PROXY_STATIC_INSTANCES beside the simulated ones: the demo's line counts
    the simulated ones only; no line of the whole run (start and stop) is said twice; the host's
    tcp_migrate_req note is no warning."""
    static = Engine(tmp_path).start()
    ports, demo, expected = start_demo(tmp_path, "demo", PROXY_STATIC_INSTANCES=f"{static.url}=static-extra",
                                       PROXY_STATIC_PROBE_S="0.2")
    try:
        wait_until(lambda: alive_ids(ports.cp_url) == expected | {"static-extra"}, 40,
                   message=f"all three alive\n{demo.tail()}")
        wait_until(lambda: "curl -s" in demo.log(), 20, message=f"the demo says what to try\n{demo.tail()}")
    finally:
        code = demo.stop(signal.SIGINT, timeout=60)
        static.stop()
    log = demo.log()
    assert code == 0, log[-3000:]
    assert "demo: 2 simulated instances registered" in log, log
    lines = [TEXT_TIME.sub("", line) for line in log.splitlines()]
    assert not repeated(lines), "\n".join(repeated(lines))
    assert not [line for line in lines if "tcp_migrate_req" in line and "WARNING" in line], log


def reported(cp_url: str) -> dict[str, dict[str, Any]]:
    """instance id -> its last resource snapshot, normalised, for those that sent one."""
    rows = get(f"{cp_url}/debug/instance_resources")["instances"]
    return {row["instance_id"]: row["resource"] for row in rows if row["resource"] is not None}


def test_the_demo_s_instances_report_resources_and_every_line_is_json(tmp_path: Path) -> None:
    ports, demo, expected = start_demo(tmp_path, "demo-json", PROXY_LOG_FORMAT="json")
    try:
        resources = wait_until(lambda: (found := reported(ports.cp_url)).keys() == expected and found, 40,
                               message=f"resource snapshots from both instances\n{demo.tail()}")
        pool = get(f"{ports.cp_url}/debug/pool_resource")["pool_resource"]
        wait_until(lambda: "curl -s" in demo.log(), 20, message=f"the demo says what to try\n{demo.tail()}")
    finally:
        code = demo.stop(signal.SIGINT, timeout=60)
    log = demo.log()
    assert code == 0, log[-3000:]
    for res in resources.values():
        assert res["cpu_util"] is not None and res["memory_total_mb"] and res["memory_used_mb"], res
        assert res["gpu_util_avg"] is not None and res["gpu_mem_total_mb"], res
        assert res["admission_state"] == "accepting", res
    assert pool["instances"]["with_resource"] == 2 and pool["pool_admission_state"] == "accepting", pool
    entries = []
    for line in log.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{log[-3000:]}") from None
    said = [json.dumps([e["role"], e["pid"], e["level"], e["logger"], e["message"]]) for e in entries]
    assert not repeated(said), "\n".join(repeated(said))


@dataclass
class RecordingChild(Child):
    """A child that records the signals it is sent and has exited whenever it is waited for."""

    signals: list[int] = field(default_factory=list)

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def wait(self, timeout_s: float) -> bool:
        return True


def test_the_demo_stops_each_simulated_process_with_one_sigterm() -> None:
    """A second SIGTERM tells a simulated process to stop waiting for what it has in flight."""
    demo = Demo(build_parser().parse_args(["--sim-instances", "2"]), Settings())
    demo.sims = [RecordingChild(child.name, child.argv, {}) for child in demo.sims]
    demo.proxy = RecordingChild("proxy", [], {})
    demo._stop()
    assert {child.name: child.signals for child in demo.sims} == {
        "sim-instance0": [signal.SIGTERM], "sim-instance1": [signal.SIGTERM], "sim-kdn": [signal.SIGTERM]}


def test_the_demo_counts_only_its_own_instances_alive() -> None:
    rows = [{"instance_id": "hp_127.0.0.1:9001", "is_alive": True},
            {"instance_id": "hp_127.0.0.1:9011", "is_alive": False},
            {"instance_id": "static-a", "is_alive": True}]
    assert alive_among(rows, sim_instance_ids(build_parser().parse_args(["--sim-instances", "2"]))) == 1
    assert alive_among(None, {"hp_127.0.0.1:9001"}) == 0
