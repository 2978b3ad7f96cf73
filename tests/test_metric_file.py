"""shm_schema.metric_file (a process's metric values, read by other processes) and the worker's
counters and histograms on it (proxy_workers.metrics): the same text as prometheus_client's
own Histogram for the same observations, totals that survive a crash and a reused pid."""

from __future__ import annotations

import logging
import multiprocessing
import os
import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy_workers import metrics
from shm_schema.metric_file import MetricFile, MetricFileError, MetricFileFull, read_metric_file

SPAWN = multiprocessing.get_context("spawn")


def test_a_reader_sees_each_entry_with_its_values(tmp_path: Path) -> None:
    f = MetricFile(str(tmp_path / "w.db"))
    a, b = f.slot(b"a", 1), f.slot(b"bee", 3)
    assert f.slot(b"a", 1) == a  # found, not added again
    f.values[a] += 2.0
    f.values[b + 2] += 0.25
    assert read_metric_file(str(tmp_path / "w.db")) == [(b"a", (2.0,)), (b"bee", (0.0, 0.0, 0.25))]
    assert f.entries() == read_metric_file(str(tmp_path / "w.db"))
    assert oct(os.stat(tmp_path / "w.db").st_mode & 0o777) == "0o600"
    f.close()


def test_opening_a_file_that_exists_continues_its_counts(tmp_path: Path) -> None:
    """A restarted process, or a new one given a dead one's pid: totals never go down."""
    path = str(tmp_path / "w.db")
    first = MetricFile(path)
    first.values[first.slot(b"a", 1)] += 5.0
    first.close()
    again = MetricFile(path)
    again.values[again.slot(b"a", 1)] += 1.0
    again.values[again.slot(b"b", 1)] += 1.0
    assert read_metric_file(path) == [(b"a", (6.0,)), (b"b", (1.0,))]
    again.close()


def test_an_entry_not_yet_published_is_invisible_and_its_space_is_taken_clean(tmp_path: Path) -> None:
    """A crash between writing an entry and moving `used` past it: readers never see it, and
    the next opener writes over it with zeroed values."""
    path = str(tmp_path / "w.db")
    f = MetricFile(path)
    f.values[f.slot(b"a", 1)] += 1.0
    used = struct.unpack_from("<Q", f._map, 8)[0]
    struct.pack_into("<II", f._map, used, 1, 2)  # half an entry: its head, key and junk values
    f._map[used + 8:used + 9] = b"z"
    struct.pack_into("<2d", f._map, used + 16, 7.0, 7.0)
    f.close()
    assert read_metric_file(path) == [(b"a", (1.0,))]
    again = MetricFile(path)
    assert again.slot(b"z", 2) * 8 == used + 16
    assert again.entries() == [(b"a", (1.0,)), (b"z", (0.0, 0.0))]
    again.close()


def test_a_full_file_refuses_a_new_entry_and_keeps_the_others(tmp_path: Path) -> None:
    f = MetricFile(str(tmp_path / "w.db"), capacity=64)
    f.values[f.slot(b"a", 2)] += 1.0  # 16 + 8 + 8 + 16 = 48 bytes
    with pytest.raises(MetricFileFull):
        f.slot(b"b", 1)
    assert f.entries() == [(b"a", (1.0, 0.0))]
    f.close()


def test_a_file_that_is_not_one_is_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "other.db").write_bytes(b"SQLite format 3\0" + bytes(100))
    with pytest.raises(MetricFileError, match="other.db"):
        read_metric_file(str(tmp_path / "other.db"))
    damaged = str(tmp_path / "damaged.db")
    f = MetricFile(damaged)
    f.slot(b"a", 1)
    struct.pack_into("<II", f._map, 16, 1, 1000)  # an entry that claims more than is used
    f.close()
    with pytest.raises(MetricFileError, match="damaged entry"):
        read_metric_file(damaged)


def _add_in_a_loop(path: str, rounds: int) -> None:
    f = MetricFile(path)
    slots = [f.slot(f"k{i}".encode(), 2) for i in range(50)]
    for n in range(rounds):
        for at in slots:
            f.values[at] += 1.0
            f.values[at + 1] += 0.5
        if n == 0:
            f.slot(b"late", 1)


def test_a_reader_beside_a_writing_process_sees_whole_entries_and_counts_that_only_grow(tmp_path: Path) -> None:
    path = str(tmp_path / "w.db")
    writer = SPAWN.Process(target=_add_in_a_loop, args=(path, 20_000))
    writer.start()
    last: dict[bytes, tuple[float, ...]] = {}
    partial_reads = 0
    try:
        while True:
            writing = writer.is_alive()
            if os.path.exists(path):
                for key, values in read_metric_file(path):
                    assert key == b"late" or key.startswith(b"k") and len(values) == 2, key
                    before = last.get(key, values)
                    assert all(now >= then for now, then in zip(values, before)), (key, before, values)
                    last[key] = values
                    partial_reads += key == b"k0" and values[0] < 20_000
            if not writing:
                break
    finally:
        writer.join(60)
    assert writer.exitcode == 0
    assert partial_reads, "no read happened while the writer was still adding"
    final = dict(read_metric_file(path))
    assert len(final) == 51 and all(final[f"k{i}".encode()] == (20_000.0, 10_000.0) for i in range(50))


# --- the worker's families on it ---------------------------------------------------------------
@pytest.fixture
def store_dir(tmp_path: Path):
    metrics.open_store(str(tmp_path / "metrics"))
    yield tmp_path / "metrics"
    metrics.open_store(None)


def _samples(text: bytes, prefix: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples if s.name.startswith(prefix)}


def _collected(collector: object) -> bytes:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry)


def test_latency_histograms_read_as_prometheus_clients_own_would(store_dir: Path) -> None:
    """Bounds themselves, values between them, above the last: the same buckets, count and sum."""
    seconds = [0.0, 0.004, 0.005, 0.0051, 0.3, 1, 299.9, 300, 301, 1e6]
    registry = CollectorRegistry()
    reference = Histogram("cacheroute_request_duration_seconds", "x", ["route", "instance_id"],
                          buckets=metrics.LATENCY_BUCKETS, registry=registry)
    for value in seconds:
        metrics.observe_request("chat/completions", 200, value, "i0")
        reference.labels("chat/completions", "i0").observe(value)
    ours = _samples(_collected(metrics.WorkerFilesCollector(metrics._store)), "cacheroute_request_duration")
    ours = {k: v for k, v in ours.items() if ("instance_id", "i0") in k[1]}  # not the zero series
    theirs = _samples(generate_latest(registry), "cacheroute_request_duration")
    theirs = {k: v for k, v in theirs.items() if not k[0].endswith("_created")}
    assert ours == theirs and ours[("cacheroute_request_duration_seconds_count",
                                    (("instance_id", "i0"), ("route", "chat/completions")))] == 10


def test_every_series_of_known_labels_is_at_zero_until_counted(store_dir: Path) -> None:
    """Before any count: each route's refusals before an instance (instance_id ""), and for each
    instance of the directory each route's statuses on an instance, latencies, retries, its
    ejections and both admission reasons. What is counted replaces its zero."""
    metrics.admission_rejected("i0", "queue_full")
    values = _samples(_collected(metrics.WorkerFilesCollector(metrics._store, ["i0", "i1"])), "cacheroute_")
    for instance in ("i0", "i1"):
        for route in ("chat/completions", "completions"):
            for status in ("200", "429", "499", "502", "503", "504"):
                assert values[("cacheroute_requests_total", (("instance_id", instance), ("route", route),
                                                             ("status", status)))] == 0
            for family in ("cacheroute_request_duration_seconds", "cacheroute_time_to_first_token_seconds"):
                assert values[(f"{family}_count", (("instance_id", instance), ("route", route)))] == 0
            assert values[("cacheroute_retries_total", (("instance_id", instance), ("route", route)))] == 0
        assert values[("cacheroute_outlier_ejections_total", (("instance_id", instance),))] == 0
        assert values[("cacheroute_admission_rejections_total", (("instance_id", instance),
                                                                 ("reason", "queue_timeout")))] == 0
    assert values[("cacheroute_admission_rejections_total", (("instance_id", "i0"), ("reason", "queue_full")))] == 1
    for route in ("chat/completions", "completions"):
        for status in ("400", "405", "413", "422", "499", "503"):
            assert values[("cacheroute_requests_total", (("instance_id", ""), ("route", route), ("status", status)))] == 0
        assert values[("cacheroute_request_duration_seconds_count", (("instance_id", ""), ("route", route)))] == 0
    # Nothing at zero that cannot happen: no success without an instance, no stream timed on none.
    assert ("cacheroute_requests_total", (("instance_id", ""), ("route", "completions"), ("status", "200"))) not in values
    assert not any(name.startswith("cacheroute_time_to_first_token") and ("instance_id", "") in labels
                   for name, labels in values)


def test_a_scrape_sums_every_workers_file_and_leaves_out_what_it_cannot_read(store_dir: Path, caplog) -> None:
    metrics.observe_request("completions", 200, 0.01, "i0")
    metrics.retried("completions", "i1")
    other = MetricFile(str(store_dir / "worker-1.db"))  # another worker's (or a dead one's) file
    other.values[other.slot(metrics.REQUESTS.key(("completions", "200", "i0")), 1)] += 2.0
    other.values[other.slot(metrics.DURATION.key(("completions", "i0")), 3)] += 5.0  # other buckets
    (store_dir / "junk.db").write_bytes(b"nope")
    with caplog.at_level(logging.WARNING, "cacheroute.worker"):
        values = _samples(_collected(metrics.WorkerFilesCollector(metrics._store)), "cacheroute_")
    assert values[("cacheroute_requests_total", (("instance_id", "i0"), ("route", "completions"),
                                                 ("status", "200")))] == 3
    assert values[("cacheroute_retries_total", (("instance_id", "i1"), ("route", "completions")))] == 1
    assert values[("cacheroute_request_duration_seconds_count", (("instance_id", "i0"), ("route", "completions")))] == 1
    assert "junk.db left out of the scrape" in caplog.text


def test_a_full_file_counts_new_series_nowhere_and_says_so_once(store_dir: Path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(metrics._store.file, "_capacity", metrics._store.file._used)
    with caplog.at_level(logging.WARNING, "cacheroute.worker"):
        for _ in range(3):
            metrics.ejected("i9")
            metrics.admission_rejected("i9", "queue_full")
    text = _collected(metrics.WorkerFilesCollector(metrics._store)).decode()
    assert "i9" not in text and "overflow" not in text
    assert caplog.text.count("new series are no longer counted") == 1


@pytest.mark.parametrize("content", [b"OLD!" + bytes(60), b"", b"CRMV", b"CRMV\x01\0\0\0" + (10**6).to_bytes(8, "little")],
                         ids=["another magic", "empty", "shorter than a header", "used past the end"])
def test_a_file_of_another_format_left_under_this_workers_name_is_moved_aside(tmp_path: Path, caplog,
                                                                               content: bytes) -> None:
    directory = tmp_path / "metrics"
    directory.mkdir()
    stale = directory / f"worker-{os.getpid()}.db"
    stale.write_bytes(content)
    with caplog.at_level(logging.WARNING, "cacheroute.worker"):
        metrics.open_store(str(directory))
    try:
        metrics.observe_request("completions", 200, 0.01, "i0")
        assert (directory / f"worker-{os.getpid()}.db.unreadable").read_bytes() == content
        assert read_metric_file(str(stale))[-1][0] == metrics.DURATION.key(("completions", "i0"))
        assert "counting in a new file" in caplog.text
    finally:
        metrics.open_store(None)
