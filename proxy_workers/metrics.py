"""`GET /metrics` (Prometheus text format), the same numbers whichever worker is scraped.

Two sources, both host-wide:
- per-instance gauges are read from the shared table at scrape time (inflight, queue lanes,
  liveness, the sidecar's predicted pressure and the snapshot's age): a custom collector, no
  per-request work;
- request counters and latency histograms use prometheus_client's multiprocess mode: each
  worker writes its own mmap files in PROMETHEUS_MULTIPROC_DIR (the supervisor creates and
  empties it, and marks dead workers), and a scrape sums every worker's files.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from shm_schema import read_all

from cacheroute_proxy.routing.load_view import LoadView

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("cacheroute_requests_total", "Data-plane requests answered, by endpoint and status",
                   ["endpoint", "status"])
TTFT = Histogram("cacheroute_ttft_seconds", "Time from receiving a streaming request to its first "
                 "upstream byte", buckets=LATENCY_BUCKETS)
DURATION = Histogram("cacheroute_request_duration_seconds", "Time from receiving a request to its "
                     "last byte", ["endpoint"], buckets=LATENCY_BUCKETS)


# Labelled children, looked up once: `labels()` builds a key and takes a lock on every call.
_request_children: dict[tuple[str, int], tuple[Any, Any]] = {}


def observe_request(endpoint: str, status: int, seconds: float) -> None:
    """Count one data-plane request by endpoint and status, and observe its duration."""
    children = _request_children.get((endpoint, status))
    if children is None:
        children = _request_children[(endpoint, status)] = (
            REQUESTS.labels(endpoint, str(status)), DURATION.labels(endpoint))
    children[0].inc()
    children[1].observe(seconds)


class SharedTableCollector(Collector):
    """Per-instance gauges straight from the segment: identical from every worker."""

    def __init__(self, view: LoadView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        instances = read_all(self._view.directory.segment)
        components = self._view.components(instances)
        labels = ["instance"]
        families = {
            "inflight": GaugeMetricFamily("cacheroute_instance_inflight", "Requests in flight, host-wide", labels=labels),
            "alive": GaugeMetricFamily("cacheroute_instance_alive", "1 if the instance heartbeats within its TTL", labels=labels),
        }
        for name in ("active_prepare", "active_ready", "prepare_queue_depth", "ready_queue_depth",
                     "pending_prefill_count", "active_decode_count", "predicted_total_backlog_ms"):
            families[name] = GaugeMetricFamily(f"cacheroute_instance_{name}",
                                               f"{name} (absent when unknown)", labels=labels)
        for index, inst in enumerate(instances):
            families["alive"].add_metric([inst.instance_id], 1.0 if inst.alive else 0.0)
            for name, family in families.items():
                if name == "alive":
                    continue
                value = components.get(name, [None] * len(instances))[index]
                if value is not None:  # unknown stays absent, never 0
                    family.add_metric([inst.instance_id], float(value))
        yield from families.values()
        age = self._view.snapshot_age_ms()
        snapshot = GaugeMetricFamily("cacheroute_pressure_snapshot_age_seconds",
                                     "Age of the sidecar's pressure snapshot (absent if never published)")
        if age is not None:
            snapshot.add_metric([], age / 1000)
        yield snapshot


def render(view: LoadView) -> bytes:
    registry = CollectorRegistry()
    registry.register(SharedTableCollector(view))
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(registry)
    return generate_latest(registry)
