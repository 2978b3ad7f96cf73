"""`GET /metrics` (Prometheus text format), the same numbers whichever worker is scraped.

Two sources, both host-wide:
- per-instance gauges are read from the shared table at scrape time (inflight, queue lanes,
  liveness, the sidecar's predicted pressure and the snapshot's age) and so is the event
  channel's drop count: a custom collector, no per-request work;
- request, retry, ejection, admission and prompt-key counters and the latency histograms: each
  worker adds to float64 words of its own file in the metrics directory (shm_schema.metric_file;
  the supervisor creates and empties the directory, systemd's RuntimeDirectory= does under
  systemd), and a scrape sums every file there. A dead worker's file stays, so totals never go
  down. Per request that is three in-place additions (0.7 µs in all), where
  prometheus_client's multiprocess values cost 6.5 µs (a lock, a pid check and a struct write
  each). prometheus_client only renders the text.

Every series whose label values are known is exported from the start, at 0 (Prometheus'
advice: avoid missing metrics), so a dashboard panel on a healthy proxy says 0, not "No data":
each family declares its zero grids, the label values it can take, and a scrape adds every
combination not counted yet. A grid's instance label takes each instance of the directory at
scrape time, so an instance's series appear when it registers.

Names follow the Prometheus conventions: a `cacheroute_` prefix, base
units (`_seconds`), `_total` on counters, no `_count`/`_sum`/`_bucket` suffix on a gauge. The
instance label is `instance_id`, not `instance`: Prometheus attaches `instance` (the scraped
host:port) to every series, and would rename ours to `exported_instance`.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
from bisect import bisect_left
from typing import Any, Iterable, Iterator, NamedTuple, Sequence, Union

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from shm_schema import InstanceSlot, header, read_all, read_rows
from shm_schema.metric_file import MetricFile, MetricFileError, MetricFileFull, read_metric_file

from cacheroute_proxy.routing.load_view import LoadView

from .request_model import Endpoint

log = logging.getLogger("cacheroute.worker")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
NO_INSTANCE = ""  # refused before any instance was chosen (400, 413, 503 no_instance...)


class _EveryInstance:
    """In a zero grid, the instance label's values: each instance of the directory."""


EVERY_INSTANCE = _EveryInstance()
LabelValues = Union[tuple[str, ...], _EveryInstance]

ROUTES = tuple(endpoint.value for endpoint in Endpoint)
# The statuses the proxy answers itself on the two routes, and 200: those
# before an instance is chosen (the client gone first: 499), and those once one is.
STATUSES_BEFORE_AN_INSTANCE = ("400", "405", "413", "422", "499", "503")
STATUSES_ON_AN_INSTANCE = ("200", "429", "499", "502", "503", "504")
REJECTION_REASONS = ("queue_full", "queue_timeout")
PROMPT_KEY_SOURCES = ("memo", "shared", "tokenized")


class Family(NamedTuple):
    """One metric this worker counts: a counter (no buckets) or a histogram. `zero`: grids of
    label values (in the order of `labels`) whose every combination is exported at 0 until it
    is counted."""
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None
    zero: tuple[tuple[LabelValues, ...], ...] = ()

    @property
    def width(self) -> int:
        """Its values in a file: a count; or a count per bucket (the last is +Inf), and the sum."""
        return 1 if self.buckets is None else len(self.buckets) + 2

    def key(self, label_values: Iterable[str]) -> bytes:
        return json.dumps([self.name, *label_values]).encode()


REQUESTS = Family("cacheroute_requests_total", "Data-plane requests answered, by route, status "
                  "and the instance that answered", ("route", "status", "instance_id"),
                  zero=((ROUTES, STATUSES_BEFORE_AN_INSTANCE, (NO_INSTANCE,)),
                        (ROUTES, STATUSES_ON_AN_INSTANCE, EVERY_INSTANCE)))
DURATION = Family("cacheroute_request_duration_seconds", "Time from receiving a request to its "
                  "last byte", ("route", "instance_id"), LATENCY_BUCKETS,
                  zero=((ROUTES, (NO_INSTANCE,)), (ROUTES, EVERY_INSTANCE)))
TTFT = Family("cacheroute_time_to_first_token_seconds", "Time from receiving a streaming "
              "request to its first upstream byte", ("route", "instance_id"), LATENCY_BUCKETS,
              zero=((ROUTES, EVERY_INSTANCE),))
RETRIES = Family("cacheroute_retries_total", "Attempts made again on another instance, by the "
                 "instance that failed", ("route", "instance_id"), zero=((ROUTES, EVERY_INSTANCE),))
EJECTIONS = Family("cacheroute_outlier_ejections_total", "Times a worker left an instance out "
                   "after consecutive failures", ("instance_id",), zero=((EVERY_INSTANCE,),))
ADMISSION_REJECTIONS = Family("cacheroute_admission_rejections_total", "Requests refused by "
                              "admission: queue_full (429) or queue_timeout (503)",
                              ("instance_id", "reason"), zero=((EVERY_INSTANCE, REJECTION_REASONS),))
PROMPT_KEYS = Family("cacheroute_prompt_keys_total", "Chats kv_aware routed on engine block keys, "
                     "by where their keys came from: this worker's memo of the leading messages, "
                     "another worker's (shared), or the prompt tokenized then", ("source",),
                     zero=((PROMPT_KEY_SOURCES,),))
FAMILIES = {f.name: f for f in (REQUESTS, DURATION, TTFT, RETRIES, EJECTIONS, ADMISSION_REJECTIONS,
                                PROMPT_KEYS)}
_SUM = len(LATENCY_BUCKETS) + 1  # a latency histogram's sum, after its buckets
_OVERFLOW_KEY = b'["", "overflow"]'  # where a full file's new series go: never rendered
_FILE_SUFFIX = ".db"  # a worker's file is worker-<pid>.db; a scrape reads every *.db


class _Store:
    """This worker's file (or, with no directory, an anonymous mapping only it reads)."""

    def __init__(self, directory: str | None) -> None:
        path = None if directory is None else os.path.join(directory, f"worker-{os.getpid()}{_FILE_SUFFIX}")
        self.directory = directory
        self.file = _opened(path)
        self.values = self.file.values
        self.overflow = self.file.slot(_OVERFLOW_KEY, max(f.width for f in FAMILIES.values()))
        self.full_said = False

    def slot(self, family: Family, *label_values: str) -> int:
        try:
            return self.file.slot(family.key(label_values), family.width)
        except MetricFileFull as exc:
            if not self.full_said:
                self.full_said = True
                log.warning("%s: new series are no longer counted", exc)
            return self.overflow


def _opened(path: str | None) -> MetricFile:
    """The file at `path`, continued; one left there that is not a metrics file of this
    version (the pid of a worker from an older release) is moved aside, not counted into."""
    try:
        return MetricFile(path)
    except MetricFileError as exc:
        assert path is not None
        os.replace(path, f"{path}.unreadable")
        log.warning("%s; moved to %s.unreadable, counting in a new file", exc, path)
        return MetricFile(path)


_store = _Store(None)
# Series looked up once; bounded, as instances come and go (the file's series stay).
_CACHED_SERIES_CAP = 4096
_request_slots: dict[tuple[str, int, str], tuple[int, int]] = {}
_ttft_slots: dict[tuple[str, str], int] = {}
_prompt_key_slots: dict[str, int] = {}


def open_store(directory: str | None) -> None:
    """Count into this worker's file in `directory` (created if missing, mode 0700) from now on,
    or with None into a mapping only this process reads. A worker calls it once, when it is
    about to serve: a worker that never serves leaves no file."""
    global _store
    if directory is not None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    _store = _Store(directory)
    _request_slots.clear()
    _ttft_slots.clear()
    _prompt_key_slots.clear()


def observe_request(route: str, status: int, seconds: float, instance_id: str = NO_INSTANCE) -> None:
    """Count one data-plane request by route, status and instance, and observe its duration."""
    key = (route, status, instance_id)
    at = _request_slots.get(key)
    if at is None:
        if len(_request_slots) >= _CACHED_SERIES_CAP:
            _request_slots.clear()
        at = _request_slots[key] = (_store.slot(REQUESTS, route, str(status), instance_id),
                                    _store.slot(DURATION, route, instance_id))
    values = _store.values
    values[at[0]] += 1.0
    histogram = at[1]
    values[histogram + bisect_left(LATENCY_BUCKETS, seconds)] += 1.0
    values[histogram + _SUM] += seconds


def observe_ttft(route: str, instance_id: str, seconds: float) -> None:
    key = (route, instance_id)
    histogram = _ttft_slots.get(key)
    if histogram is None:
        if len(_ttft_slots) >= _CACHED_SERIES_CAP:
            _ttft_slots.clear()
        histogram = _ttft_slots[key] = _store.slot(TTFT, route, instance_id)
    values = _store.values
    values[histogram + bisect_left(LATENCY_BUCKETS, seconds)] += 1.0
    values[histogram + _SUM] += seconds


def prompt_keys(source: str) -> None:
    """One chat routed on keys from `source` (PROMPT_KEY_SOURCES)."""
    at = _prompt_key_slots.get(source)
    if at is None:
        at = _prompt_key_slots[source] = _store.slot(PROMPT_KEYS, source)
    _store.values[at] += 1.0


# Off the common path (only when something failed or was refused): no cache of slots.
def _count(family: Family, *label_values: str) -> None:
    _store.values[_store.slot(family, *label_values)] += 1.0


def retried(route: str, failed_instance_id: str) -> None:
    _count(RETRIES, route, failed_instance_id)


def ejected(instance_id: str) -> None:
    _count(EJECTIONS, instance_id)


def admission_rejected(instance_id: str, reason: str) -> None:
    _count(ADMISSION_REJECTIONS, instance_id, reason)


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

    def __init__(self, view: LoadView, instances: Sequence[InstanceSlot]) -> None:
        self._view = view
        self._instances = instances  # the directory, read once for the scrape

    def collect(self) -> Iterator[Metric]:
        instances = self._instances
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


class WorkerFilesCollector(Collector):
    """The counters and histograms of every worker: each file's values, summed by series, and
    at 0 every series of the families' zero grids not counted yet (`instance_ids`: the
    directory's)."""

    def __init__(self, store: _Store, instance_ids: Sequence[str] = ()) -> None:
        self._store = store
        self._instance_ids = instance_ids

    def collect(self) -> Iterator[Metric]:
        totals = _summed(self._entries())
        for family in FAMILIES.values():
            series = {labels: [0.0] * family.width for labels in zero_series(family, self._instance_ids)}
            series.update(totals.get(family.name, {}))
            yield _family(family, series)

    def _entries(self) -> Iterator[list[tuple[bytes, tuple[float, ...]]]]:
        if self._store.directory is None:
            yield self._store.file.entries()
            return
        for path in sorted(glob.glob(os.path.join(self._store.directory, "*" + _FILE_SUFFIX))):
            try:
                yield read_metric_file(path)
            except (OSError, MetricFileError) as exc:  # the others' counts still go out
                log.warning("metrics: %s left out of the scrape: %s", path, exc)


def zero_series(family: Family, instance_ids: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """The label values of every series `family` exports at 0 until it is counted."""
    for grid in family.zero:
        yield from itertools.product(*(instance_ids if isinstance(values, _EveryInstance) else values
                                       for values in grid))


def _summed(files: Iterable[list[tuple[bytes, tuple[float, ...]]]]) -> dict[str, dict[tuple[str, ...], list[float]]]:
    """family name -> label values -> values summed over the files. A series whose width is
    not its family's (a file of a release with other buckets) is left out."""
    totals: dict[str, dict[tuple[str, ...], list[float]]] = {}
    for entries in files:
        for key, values in entries:
            name, *label_values = json.loads(key)
            family = FAMILIES.get(name)
            if family is None or len(values) != family.width:
                continue
            series = totals.setdefault(name, {})
            summed = series.get(tuple(label_values))
            if summed is None:
                series[tuple(label_values)] = list(values)
            else:
                for i, value in enumerate(values):
                    summed[i] += value
    return totals


def _family(family: Family, series: dict[tuple[str, ...], list[float]]) -> Metric:
    if family.buckets is None:
        counter = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for label_values, values in series.items():
            counter.add_metric(list(label_values), values[0])
        return counter
    histogram = HistogramMetricFamily(family.name, family.help, labels=family.labels)
    bounds = [floatToGoString(b) for b in family.buckets] + ["+Inf"]
    for label_values, values in series.items():
        cumulative, buckets = 0.0, []
        for bound, count in zip(bounds, values):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram.add_metric(list(label_values), buckets, sum_value=values[-1])
    return histogram


def render(view: LoadView) -> bytes:
    instances = read_all(view.directory.segment)
    registry = CollectorRegistry()
    registry.register(SharedTableCollector(view, instances))
    registry.register(WorkerFilesCollector(_store, [instance.instance_id for instance in instances]))
    return generate_latest(registry)
