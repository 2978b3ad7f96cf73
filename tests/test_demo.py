"""The demo (`make run-workers`, cacheroute_sim/demo.py): the production launcher plus simulated
instances and a KDN that register themselves; a crashed simulated instance comes back; Ctrl-C
stops everything and leaves nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from cacheroute_sim.processes import free_port, free_port_range
from cacheroute_sim.scheduler.requests import scheduler_body
from tests.harness import Process, SupervisorPorts, chat_body, get, http, wait_until


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
