"""Samples, over the measured window, what each instance itself says it has in flight (its
own `/sim/stats` gauge, every ~50 ms) and how busy each proxy worker is (CPU over ~1 s).

A thread with blocking keep-alive connections, not a task in the client's event loop: the
client's loop must stay free to fire arrivals on time, and the thread waits on sockets with
the GIL released.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil


@dataclass
class Samples:
    times_s: list[float] = field(default_factory=list)           # since the sampler started
    inflight: list[list[int]] = field(default_factory=list)      # one list per sample, per instance
    failed_polls: int = 0
    # Per proxy worker pid: CPU utilisation (0..1 of one core) of each ~1 s interval.
    worker_cpu: dict[int, list[float]] = field(default_factory=dict)


class InflightSampler:
    def __init__(self, instance_urls: list[str], worker_pids: list[int],
                 interval_s: float = 0.05, cpu_interval_s: float = 1.0) -> None:
        self._targets = [urlsplit(u) for u in instance_urls]
        self._workers = {pid: psutil.Process(pid) for pid in worker_pids}
        self._interval, self._cpu_interval = interval_s, cpu_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-sampler", daemon=True)
        self.samples = Samples(worker_cpu={pid: [] for pid in worker_pids})

    def __enter__(self) -> InflightSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        conns = [http.client.HTTPConnection(t.hostname, t.port, timeout=2) for t in self._targets]
        start = time.monotonic()
        last_cpu, last_cpu_at = self._cpu_times(), start
        try:
            while not self._stop.is_set():
                tick = time.monotonic()
                self._poll(conns, tick - start)
                if tick - last_cpu_at >= self._cpu_interval:
                    last_cpu = self._record_cpu(last_cpu, tick - last_cpu_at)
                    last_cpu_at = tick
                self._stop.wait(max(0.0, self._interval - (time.monotonic() - tick)))
        finally:
            for conn in conns:
                conn.close()

    def _poll(self, conns: list[http.client.HTTPConnection], at_s: float) -> None:
        values = []
        for conn in conns:
            try:
                conn.request("GET", "/sim/stats")
                values.append(int(json.loads(conn.getresponse().read())["inflight"]))
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                conn.close()  # reconnects on the next request
                self.samples.failed_polls += 1
                return
        self.samples.times_s.append(round(at_s, 4))
        self.samples.inflight.append(values)

    def _cpu_times(self) -> dict[int, float]:
        out = {}
        for pid, proc in self._workers.items():
            try:
                t = proc.cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                out[pid] = float("nan")
        return out

    def _record_cpu(self, before: dict[int, float], elapsed_s: float) -> dict[int, float]:
        now = self._cpu_times()
        for pid, value in now.items():
            self.samples.worker_cpu[pid].append((value - before[pid]) / max(elapsed_s, 1e-6))
        return now
