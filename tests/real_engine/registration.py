"""How a real engine gets into a proxy's instance directory in these tests: as in a deployment,
the instance agent (`cacheroute-proxy instance-agent`) runs beside it, reads what the engine says
of itself, registers it and heartbeats its health. Every test registers engines through
`register_engine`."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.harness import Process, wait_until
from tests.real_engine.engines import VllmEngine


# Heartbeat and resource snapshot every 1 and 2 s: a test sees a change within seconds.
TEST_REPORTS = ("--heartbeat-interval", "1", "--resource-interval", "2")


class AgentRegistration:
    """One engine's agent, registered on one control plane until stop(). `reports`: the agent's
    report intervals as flags (TEST_REPORTS; none: its defaults, as deployed)."""

    def __init__(self, cp_url: str, engine: VllmEngine, instance_id: str, log_path: Path,
                 reports: tuple[str, ...] = TEST_REPORTS) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.process = Process(["-m", "cacheroute_proxy", "instance-agent",
                                "--instance-url", f"http://127.0.0.1:{engine.port}",
                                "--proxy-cp-url", cp_url, "--instance-id", instance_id,
                                # vLLM does not say its --max-num-seqs: the operator tells the agent.
                                "--max-num-seqs", str(engine.max_num_seqs), *reports],
                               {}, log_path)

    def log(self) -> str:
        return self.process.log()

    def stop(self) -> int | None:
        """SIGTERM: the agent unregisters the engine, then exits 0."""
        return self.process.stop(signal.SIGTERM, timeout=15)


def seen_alive_by_every_worker(cluster: Any, instance_id: str) -> bool:
    return all(any(row["instance_id"] == instance_id and row["is_alive"]
                   for row in cluster.loads(worker)["instances"])
               for worker in range(cluster.workers))


def register_engine(cluster: Any, engine: VllmEngine, instance_id: str | None = None) -> AgentRegistration:
    """Start the agent beside `engine` for `cluster` (tests.harness.Cluster) and wait until every
    worker sees the engine alive."""
    instance_id = instance_id or f"vllm-{engine.port}"
    registration = AgentRegistration(cluster.cp_url, engine, instance_id,
                                     cluster.tmp_path / f"agent-{instance_id}.log")
    wait_until(lambda: seen_alive_by_every_worker(cluster, registration.instance_id), 30,
               message=f"{registration.instance_id} registered by its agent\n{registration.log()[-2000:]}")
    return registration
