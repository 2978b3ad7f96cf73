"""`GET /metrics` (Prometheus text format), the same numbers whichever worker is scraped.

Two sources, both host-wide:
- per-instance gauges are read from the shared table at scrape time (inflight, queue lanes,
  liveness, the sidecar's predicted pressure and the snapshot's age) and so is the event
  channel's drop count: a custom collector, no per-request work;
- request, retry, ejection and admission counters and the latency histograms use
  prometheus_client's multiprocess mode: each worker writes its own mmap files in
  PROMETHEUS_MULTIPROC_DIR (the supervisor creates and empties it, and marks dead workers),
  and a scrape sums every worker's files.

Names follow the Prometheus conventions (docs/protocol.md §4.4): a `cacheroute_` prefix, base
units (`_seconds`), `_total` on counters, no `_count`/`_sum`/`_bucket` suffix on a gauge. The
instance label is `instance_id`, not `instance`: Prometheus attaches `instance` (the scraped
host:port) to every series, and would rename ours to `exported_instance`.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from shm_schema import header, read_all, read_rows

from cacheroute_proxy.routing.load_view import LoadView

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
NO_INSTANCE = ""  # refused before any instance was chosen (400, 413, 503 no_instance...)

REQUESTS = Counter("cacheroute_requests_total", "Data-plane requests answered, by route, status "
                   "and the instance that answered", ["route", "status", "instance_id"])
DURATION = Histogram("cacheroute_request_duration_seconds", "Time from receiving a request to "
                     "its last byte", ["route", "instance_id"], buckets=LATENCY_BUCKETS)
TTFT = Histogram("cacheroute_time_to_first_token_seconds", "Time from receiving a streaming "
                 "request to its first upstream byte", ["route", "instance_id"], buckets=LATENCY_BUCKETS)
RETRIES = Counter("cacheroute_retries_total", "Attempts made again on another instance, by the "
                  "instance that failed", ["route", "instance_id"])
EJECTIONS = Counter("cacheroute_outlier_ejections_total", "Times a worker left an instance out "
                    "after consecutive failures", ["instance_id"])
ADMISSION_REJECTIONS = Counter("cacheroute_admission_rejections_total", "Requests refused by "
                               "admission: queue_full (429) or queue_timeout (503)",
                               ["instance_id", "reason"])

# Labelled children, looked up once: `labels()` builds a key and takes a lock on every call.
# Bounded: past the cap (instances come and go) the cache starts again; the series stay.
_CHILDREN_CAP = 4096
_request_children: dict[tuple[str, int, str], tuple[Any, Any]] = {}
_ttft_children: dict[tuple[str, str], Any] = {}


def observe_request(route: str, status: int, seconds: float, instance_id: str = NO_INSTANCE) -> None:
    """Count one data-plane request by route, status and instance, and observe its duration."""
    key = (route, status, instance_id)
    children = _request_children.get(key)
    if children is None:
        if len(_request_children) >= _CHILDREN_CAP:
            _request_children.clear()
        children = _request_children[key] = (REQUESTS.labels(route, str(status), instance_id),
                                             DURATION.labels(route, instance_id))
    children[0].inc()
    children[1].observe(seconds)


def observe_ttft(route: str, instance_id: str, seconds: float) -> None:
    key = (route, instance_id)
    child = _ttft_children.get(key)
    if child is None:
        if len(_ttft_children) >= _CHILDREN_CAP:
            _ttft_children.clear()
        child = _ttft_children[key] = TTFT.labels(route, instance_id)
    child.observe(seconds)


# Off the common path (only when something failed or was refused): plain labels() calls.
def retried(route: str, failed_instance_id: str) -> None:
    RETRIES.labels(route, failed_instance_id).inc()


def ejected(instance_id: str) -> None:
    EJECTIONS.labels(instance_id).inc()


def admission_rejected(instance_id: str, reason: str) -> None:
    ADMISSION_REJECTIONS.labels(instance_id, reason).inc()


# The shared table's per-instance words: (component of LoadView.components, metric, help).
_INSTANCE_GAUGES = (
    ("inflight", "cacheroute_instance_inflight", "Requests in flight, host-wide"),
    ("active_prepare", "cacheroute_instance_active_prepare", "Requests in the prepare stage (KDN, KV inject), host-wide"),
    ("active_ready", "cacheroute_instance_active_ready", "Requests admitted to the instance (READY_CONCURRENCY lane), host-wide"),
    ("prepare_queue_depth", "cacheroute_instance_prepare_queue_depth", "Requests waiting to prepare, host-wide"),
    ("ready_queue_depth", "cacheroute_instance_ready_queue_depth", "Requests waiting for ready admission, host-wide"),
    ("pending_prefill_count", "cacheroute_instance_pending_prefills", "Prefills the sidecar's timeline predicts (absent when unknown)"),
    ("active_decode_count", "cacheroute_instance_active_decodes", "Decodes the sidecar's timeline predicts (absent when unknown)"),
)


class SharedTableCollector(Collector):
    """Per-instance gauges and the event channel's drops straight from the segment:
    identical from every worker."""

    def __init__(self, view: LoadView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        instances = read_all(self._view.directory.segment)
        components = self._view.components(instances)
        ids = [inst.instance_id for inst in instances]
        alive = GaugeMetricFamily("cacheroute_instance_alive", "1 if the instance heartbeats "
                                  "within its TTL", labels=["instance_id"])
        for inst in instances:
            alive.add_metric([inst.instance_id], 1.0 if inst.alive else 0.0)
        yield alive
        for component, name, help_text in _INSTANCE_GAUGES:
            yield _per_instance(name, help_text, ids, components.get(component), 1.0)
        yield _per_instance("cacheroute_instance_predicted_backlog_seconds",
                            "The sidecar's predicted backlog before a new request would start "
                            "(absent when unknown)", ids,
                            components.get("predicted_total_backlog_ms"), 0.001)
        age = self._view.snapshot_age_ms()
        snapshot = GaugeMetricFamily("cacheroute_pressure_snapshot_age_seconds",
                                     "Age of the sidecar's pressure snapshot (absent if never published)")
        if age is not None:
            snapshot.add_metric([], age / 1000)
        yield snapshot
        yield self._events_dropped()

    def _events_dropped(self) -> CounterMetricFamily:
        """Events workers could not hand to the sidecar (ring and spill full): the live rows'
        counts plus those of rows since freed, so the sum never goes down."""
        seg = self._view.directory.segment
        dropped = sum(row.events_dropped for row in read_rows(seg)) + header.events_dropped_gone(seg)
        return CounterMetricFamily("cacheroute_event_channel_dropped_events",
                                   "Worker-to-sidecar events lost because a worker's ring and "
                                   "spill were both full", value=dropped)


def _per_instance(name: str, help_text: str, ids: list[str], values: list[Any] | None,
                  scale: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["instance_id"])
    for instance_id, value in zip(ids, values or ()):
        if value is not None:  # unknown stays absent, never 0
            family.add_metric([instance_id], float(value) * scale)
    return family


def render(view: LoadView) -> bytes:
    registry = CollectorRegistry()
    registry.register(SharedTableCollector(view))
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(registry)
    return generate_latest(registry)
