"""How a real engine gets into a proxy's instance directory in these tests: registered by hand on
the control plane (docs/protocol.md §3.2) and kept alive with heartbeats (§3.3) from a thread,
which is what the instance agent (`cacheroute-proxy instance-agent`) will do beside a real
deployment's engine. Everything that registers an engine goes through `register_engine`, so
the agent can take its place in one spot."""

from __future__ import annotations

import threading
from typing import Any

from tests.harness import http, post, wait_until
from tests.real_engine.engines import VllmEngine


class HandRegistration:
    """One engine registered on one control plane, heartbeating until stop()."""

    def __init__(self, cp_url: str, engine: VllmEngine, instance_id: str) -> None:
        self.cp_url = cp_url
        self.engine = engine
        self.instance_id = instance_id
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def body(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "host": "127.0.0.1", "port": self.engine.port,
                "endpoints": ["chat/completions", "completions"], "tags": ["vllm-cpu"],
                # max_num_seqs: the sidecar's timeline models the engine's real slot count.
                "meta": {"version": "vllm-hand-registered", "max_num_seqs": self.engine.max_num_seqs}}

    def start(self) -> HandRegistration:
        reply = post(f"{self.cp_url}/v1/instance/register", self.body())
        interval = float(reply["heartbeat_interval_s"])
        self._thread = threading.Thread(target=self._heartbeat, args=(interval,), daemon=True,
                                        name=f"heartbeat-{self.instance_id}")
        self._thread.start()
        return self

    def _heartbeat(self, interval: float) -> None:
        while not self._stopped.wait(interval):
            try:
                status, reply, _ = http("POST", f"{self.cp_url}/v1/instance/heartbeat",
                                        {"instance_id": self.instance_id}, timeout=5)
                if status == 200 and reply.get("ok") is False:  # purged: register again
                    http("POST", f"{self.cp_url}/v1/instance/register", self.body(), timeout=5)
            except OSError:
                pass  # the cluster is stopping; the next beat (or stop()) settles it

    def stop(self, unregister: bool = True) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(10)
        if unregister:
            try:
                http("POST", f"{self.cp_url}/v1/instance/unregister",
                     {"instance_id": self.instance_id}, timeout=5)
            except OSError:
                pass  # the control plane is gone already


def register_engine(cluster: Any, engine: VllmEngine, instance_id: str | None = None) -> HandRegistration:
    """Register `engine` with `cluster` (tests.harness.Cluster) and wait until every worker
    sees it alive."""
    registration = HandRegistration(cluster.cp_url, engine, instance_id or f"vllm-{engine.port}").start()

    def seen_by_every_worker() -> bool:
        return all(any(row["instance_id"] == registration.instance_id and row["is_alive"]
                       for row in cluster.loads(worker)["instances"])
                   for worker in range(cluster.workers))
    wait_until(seen_by_every_worker, 20, message=f"{registration.instance_id} registered")
    return registration
