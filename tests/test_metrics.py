"""`/metrics` from any worker: host-wide gauges from the shared table, request counters and
latency histograms summed over every worker's metrics file (shm_schema.metric_file)."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.aio import OpenStream
from tests.harness import chat_body, http, wait_until


Sample = tuple[str, tuple]


def _scrape(url: str) -> dict[Sample, float]:
    status, text, headers = http("GET", f"{url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _settled_scrape(url: str, expected: dict[Sample, float]) -> dict[Sample, float]:
    """A scrape in which every counter in `expected` has reached its value: a request is counted
    when its handler ends, which may be just after the client has read the last byte."""
    def reached() -> dict[Sample, float] | None:
        scrape = _scrape(url)
        for key, value in expected.items():
            assert scrape.get(key, 0.0) <= value, (key, scrape.get(key))  # never past it
        return scrape if all(scrape.get(key) == value for key, value in expected.items()) else None
    return wait_until(reached, 5, message=f"counters {expected}")


def test_any_worker_reports_the_same_host_wide_numbers(make_cluster):
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance("--hold-streams")
    label = (("instance_id", inst.instance_id),)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            streams = [await OpenStream.open(session, f"{cluster.worker_url(w)}/v1/chat/completions", chat_body())
                       for w in (0, 1, 1)]
            scrapes = [_scrape(cluster.worker_url(w)) for w in (0, 1)]
            for scrape in scrapes:
                assert scrape[("cacheroute_instance_inflight", label)] == 3
                assert scrape[("cacheroute_instance_alive", label)] == 1
            inst.release()
            await asyncio.gather(*(s.finish() for s in streams))

    asyncio.run(scenario())
    for n in range(4):
        assert http("POST", f"{cluster.worker_url(n % 2)}/v1/chat/completions", chat_body(stream=False))[0] == 200
    assert http("POST", f"{cluster.worker_url(0)}/v1/chat/completions", raw=b"nope")[0] == 400
    ok = ("cacheroute_requests_total", (("instance_id", inst.instance_id), ("route", "chat/completions"),
                                        ("status", "200")))
    bad = ("cacheroute_requests_total", (("instance_id", ""), ("route", "chat/completions"), ("status", "400")))
    ttft = ("cacheroute_time_to_first_token_seconds_count", (("instance_id", inst.instance_id),
                                                             ("route", "chat/completions")))
    # 3 streams + 4 requests, over both workers
    inflight = ("cacheroute_instance_inflight", label)
    for w in (0, 1):
        _settled_scrape(cluster.worker_url(w), {ok: 7, bad: 1, ttft: 3, inflight: 0})
    metrics_dir = f"/tmp/cacheroute-metrics-{cluster.shm_name.strip('/')}"
    assert os.path.isdir(metrics_dir) and oct(os.stat(metrics_dir).st_mode & 0o777) == "0o700"
    cluster.stop()
    assert not os.path.exists(metrics_dir)


def test_a_killed_workers_counts_stay_in_every_scrape(make_cluster):
    """SIGKILL mid-life: its file stays, the replacement (a new pid) counts in a new one, and
    the totals never go down."""
    cluster = make_cluster(workers=2)
    inst = cluster.add_instance()
    ok = ("cacheroute_requests_total", (("instance_id", inst.instance_id), ("route", "chat/completions"),
                                        ("status", "200")))
    for _ in range(3):
        assert http("POST", f"{cluster.worker_url(1)}/v1/chat/completions", chat_body(stream=False))[0] == 200
    _settled_scrape(cluster.worker_url(0), {ok: 3})
    pid = cluster.worker_pids()[1]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: cluster.worker_pids()[1] != pid, 10, message="worker 1 replaced")
    assert http("POST", f"{cluster.worker_url(1)}/v1/chat/completions", chat_body(stream=False))[0] == 200
    for w in (0, 1):
        _settled_scrape(cluster.worker_url(w), {ok: 4})
    files = sorted(os.listdir(f"/tmp/cacheroute-metrics-{cluster.shm_name.strip('/')}"))
    assert f"worker-{pid}.db" in files and len(files) == 3, files
