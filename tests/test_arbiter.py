"""The supervisor's stop, with children that record the signals they are sent."""

from __future__ import annotations

import signal
from pathlib import Path

from cacheroute_proxy.config import Settings
from cacheroute_proxy.supervisor.arbiter import Arbiter
from cacheroute_proxy.supervisor.children import Child


class RecordingChild(Child):
    def __init__(self, name: str, sent: list[tuple[str, str]]) -> None:
        super().__init__(name, [], {})
        self.sent = sent

    def signal(self, signum: int) -> None:
        self.sent.append((self.name, signal.Signals(signum).name))

    def wait(self, timeout_s: float) -> bool:
        return True


def test_a_stop_sends_each_child_one_sigterm(tmp_path: Path) -> None:
    """A worker takes a second SIGTERM as "stop waiting for what is in flight" and cuts its
    streams, so the stop must not send one: workers first, then the sidecar, once each."""
    arbiter = Arbiter(Settings(workers=2, shm_name=f"/cr-test-arbiter-{tmp_path.name}",
                               metrics_dir=str(tmp_path / "metrics")))
    sent: list[tuple[str, str]] = []
    arbiter.workers = [RecordingChild(f"worker{i}", sent) for i in range(2)]
    arbiter.sidecar = RecordingChild("sidecar", sent)
    arbiter._stop_all()
    assert sent == [("worker0", "SIGTERM"), ("worker1", "SIGTERM"), ("sidecar", "SIGTERM")]
