"""Make docs/dashboard.png (and docs/dashboard-dark.png): a real cluster registered with a
simulated Scheduler, simulated instances reporting resource snapshots and KDN links, some held
streams, the dashboard in headless Chromium, one full-page screenshot per theme.

    .venv/bin/python -m tests.dashboard_screenshot [--out docs/dashboard.png]

About a minute and a half: 3 workers (least_load), 3 simulated instances that hold their
streams, one stream opened every 2 s (so the inflight chart climbs), resource snapshots every
2 s that move (so the CPU / memory / GPU / network charts do), one instance released half-way
(its line drops), an instance registered by hand that never heartbeats (stale, then dead), and
a few long prompts in flight at the end (pending prefill, predicted backlog).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from cacheroute_proxy import instance_wire as wire
from tests.aio import OpenStream
from tests.chromium import Chromium
from tests.harness import ROOT, Cluster, chat_body, free_port, post, wait_until
from tests.test_scheduler_link import PROXY_ID, SimScheduler

TTL_S = 12  # short, so the hand-registered instance goes stale and dead within the run
WIDTH = 1440


def snapshot_body(instance_id: str, index: int, step: int) -> dict[str, Any]:
    """A resource snapshot as an agent sends it, with numbers that drift over the run."""
    wave = math.sin(step / 4 + index * 1.7)
    gpus = [wire.GpuReading(utilization_pct_avg=55 + 25 * wave + 5 * g, memory_used_mb=40_000 + 9_000 * index,
                            memory_total_mb=81_920) for g in range(2)]
    snapshot = wire.ResourceSnapshotV1(
        timestamp_ms=int(time.time() * 1000), devices=wire.Devices(
            cpu=wire.CpuReading(utilization_pct=28 + 18 * index + 9 * wave),
            memory=wire.MemoryReading(used_mb=(0.42 + 0.12 * index + 0.04 * wave) * 65_536, total_mb=65_536,
                                      free_mb=(0.58 - 0.12 * index) * 65_536),
            gpu=gpus,
            network=[wire.NetworkReading(iface="eth0", rx_mbps=220 + 120 * index + 60 * wave,
                                         tx_mbps=90 + 40 * index - 30 * wave)]),
        capacity_hint=wire.CapacityHint(memory_free_ratio=0.5, admission_state="accepting"))
    return msgspec.to_builtins(wire.resource_snapshot_request(
        instance_id, snapshot, wire.ReportMetadata(reported_instance_id=instance_id)))


async def _report_resources(cluster: Cluster, stop: asyncio.Event) -> None:
    step = 0
    while not stop.is_set():
        for index, inst in enumerate(cluster.instances):
            post(f"{cluster.cp_url}/v1/instance/resource_snapshot", snapshot_body(inst.instance_id, index, step))
        step += 1
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except asyncio.TimeoutError:
            pass


async def _open_gradually(cluster: Cluster, session: aiohttp.ClientSession, streams: int,
                          every_s: float) -> list[OpenStream]:
    opened = []
    for n in range(streams):
        opened.append(await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body()))
        if n == streams - 3:
            cluster.instances[1].release()  # that instance's line drops back to 0
        await asyncio.sleep(every_s)
    return opened


def _report_topology(cluster: Cluster) -> None:
    for index, inst in enumerate(cluster.instances):
        post(f"{cluster.cp_url}/v1/topology/report", {"instance_id": inst.instance_id, "links": {
            "kdn://10.0.0.21:9101": {"bandwidth_mbps": 25_000 - 5_000 * index, "latency_ms": 0.4 + 0.3 * index},
            f"kdn://10.0.1.{30 + index}:9101": {"bandwidth_mbps": 10_000, "latency_ms": 1.2}}})


def _full_page(browser: Chromium, path: Path) -> None:
    height = int(browser.evaluate("document.documentElement.scrollHeight"))
    browser.page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=height, deviceScaleFactor=1, mobile=False)
    updates = int(browser.evaluate("document.body.dataset.updates"))
    wait_until(lambda: int(browser.evaluate("document.body.dataset.updates")) >= updates + 2, 10,
               message="redrawn at the new size")
    browser.screenshot(path)
    browser.page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=900, deviceScaleFactor=1, mobile=False)


def run(out: Path, workdir: Path) -> None:
    scheduler = SimScheduler(workdir).start()
    cluster = Cluster(workdir, workers=3, strategy="least_load",
                      env={"PROXY_INSTANCE_TTL_S": str(TTL_S), "SCHEDULER_CP_URL": scheduler.url,
                           "PROXY_ID": PROXY_ID, "PROXY_SCHEDULER_BACKOFF_MAX_S": "1"})
    cluster.start()
    try:
        for _ in range(3):
            cluster.add_instance("--hold-streams", time_scale=1.0)
        _report_topology(cluster)
        with Chromium(workdir / "profile", workdir / "chromium.log", width=WIDTH, height=900) as browser:
            browser.navigate(f"{cluster.cp_url}/dashboard")

            async def scenario() -> None:
                stop = asyncio.Event()
                reporter = asyncio.create_task(_report_resources(cluster, stop))
                async with aiohttp.ClientSession() as session:
                    opened = await _open_gradually(cluster, session, streams=14, every_s=2.0)
                    post(f"{cluster.cp_url}/v1/instance/register",
                         {"host": "127.0.0.1", "port": free_port(), "instance_id": "gpu-node-7 (no heartbeat)"})
                    await asyncio.sleep(TTL_S)
                    # Long non-streaming prompts in flight: pending prefill and a predicted backlog.
                    long_ones = [asyncio.create_task(session.post(
                        f"{cluster.dp_url}/v1/chat/completions",
                        json=chat_body("word " * 3000, stream=False, max_tokens=64))) for _ in range(5)]
                    await asyncio.sleep(3)
                    _full_page(browser, out)
                    browser.evaluate("document.getElementById('btn-theme').click()")
                    _full_page(browser, out.with_name(f"{out.stem}-dark{out.suffix}"))
                    browser.evaluate("document.getElementById('btn-theme').click()")
                    for task in long_ones:
                        task.cancel()
                    for stream in opened:
                        stream.close()
                stop.set()
                await reporter

            asyncio.run(scenario())
            wait_until(lambda: int(browser.evaluate("document.body.dataset.updates")) > 30, 30,
                       message="the page kept refreshing")
            problems = browser.problems()
            assert not problems, problems
    finally:
        for inst in cluster.instances:
            try:
                inst.release()
            except (OSError, AssertionError):
                pass
        cluster.stop()
        scheduler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cacheroute-dashboard-") as workdir:
        run(args.out.resolve(), Path(workdir))
    print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
