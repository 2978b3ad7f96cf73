"""bench/pipeline_cost.py runs the worker's real request path in-process and leaves nothing."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import uvloop

from bench import pipeline_cost


def test_a_short_run_measures_every_variant_and_removes_what_it_made(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "cost.json"
    assert pipeline_cost.main(["--requests", "64", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"full", "without metrics", "without events", "without meta", "parts inline",
                            "relay floor"}
    assert all(r["median_us"] > 0 for r in results.values())
    assert results["full"]["part_us"] is None and results["relay floor"]["part_us"] is not None
    assert not {name for name in set(os.listdir("/dev/shm")) - before if "cacheroute_cost" in name}
    from bench.report.others import pipeline_cost_section
    text = pipeline_cost_section(json.loads(out.read_text()))
    assert "| relay floor |" in text and "1 interleaved blocks of 64 requests" in text


def test_a_variant_replaces_its_part_only_while_it_runs() -> None:
    from proxy_workers import metrics
    original = metrics.observe_request
    with pipeline_cost.replaced(metrics, "observe_request", None):
        assert metrics.observe_request is None
    assert metrics.observe_request is original


class CapturingConnection(pipeline_cost.CountingConnection):
    def __init__(self) -> None:
        super().__init__()
        self.data = b""

    def write(self, data: bytes) -> None:
        super().write(data)
        self.data += data


def test_the_inline_variant_does_the_full_paths_work_for_a_plain_request(tmp_path: Path) -> None:
    """What `parts inline` is measured for is the same work as `full`: an answer with the meta
    and the instance named, a reservation and a completion for the sidecar, the lanes left."""
    from proxy_workers import metrics
    from shm_schema import DirectoryReader, counter_value, layout
    from shm_schema.events import EventKind

    async def one_each() -> list[tuple[bytes, list[Any], list[int | None]]]:
        seen: list[tuple[bytes, list[Any], list[int | None]]] = []
        async with pipeline_cost.canned_worker() as worker:
            for handler in (worker.full, worker.inline):
                connection = CapturingConnection()
                await handler(pipeline_cost.a_cycle(connection))
                events = list(worker.events.drain(worker.row.row))
                snapshot = DirectoryReader(worker.seg).snapshot()
                counts = [counter_value(worker.seg, i.slot, i.generation, lane) for i in snapshot.alive
                          for lane in (layout.LANE_INFLIGHT, layout.LANE_READY_ACTIVE)]
                seen.append((connection.data, [e.kind for e in events], counts))
        return seen

    metrics.open_store(str(tmp_path))
    try:
        seen = uvloop.run(one_each())
    finally:
        metrics.open_store(None)
    assert len(seen) == 2
    for answer, kinds, counts in seen:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"x-cacheroute-instance: inst-" in head and b"x-cacheroute-worker: w0-pid" in head
        assert b'"choices"' in body and b'"_cacheroute_meta":{"trace":' in body
        assert kinds == [EventKind.RESERVE, EventKind.COMPLETE]
        assert counts == [0] * len(counts)
