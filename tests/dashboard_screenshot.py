"""Make docs/dashboard.png: a real cluster with some held streams, the dashboard in headless
Chromium, one screenshot.

    .venv/bin/python -m tests.dashboard_screenshot [--out docs/dashboard.png]

About a minute: 3 workers, 3 simulated instances that hold their streams, one stream opened
every 2 s (so the chart climbs), one instance released half-way (its line drops), an
instance registered by hand that never heartbeats (stale, then dead), and a few long prompts
in flight at the end (pending prefill, predicted backlog).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.aio import OpenStream
from tests.chromium import Chromium
from tests.harness import ROOT, Cluster, chat_body, free_port, post, wait_until

TTL_S = 12  # short, so the hand-registered instance goes stale and dead within the run


async def _open_gradually(cluster: Cluster, session: aiohttp.ClientSession, streams: int,
                          every_s: float) -> list[OpenStream]:
    opened = []
    for n in range(streams):
        opened.append(await OpenStream.open(session, f"{cluster.dp_url}/v1/chat/completions", chat_body()))
        if n == streams - 3:
            cluster.instances[1].release()  # that instance's line drops back to 0
        await asyncio.sleep(every_s)
    return opened


def run(out: Path, workdir: Path) -> None:
    cluster = Cluster(workdir, workers=3, env={"PROXY_INSTANCE_TTL_S": str(TTL_S)})
    cluster.start()
    try:
        for _ in range(3):
            cluster.add_instance("--hold-streams", time_scale=1.0)
        with Chromium(workdir / "profile", workdir / "chromium.log") as browser:
            browser.navigate(f"{cluster.cp_url}/dashboard")

            async def scenario() -> None:
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
                    browser.screenshot(out)
                    for task in long_ones:
                        task.cancel()
                    for stream in opened:
                        stream.close()

            asyncio.run(scenario())
            wait_until(lambda: int(browser.evaluate("document.body.dataset.updates")) > 30, 30,
                       message="the page kept refreshing")
    finally:
        for inst in cluster.instances:
            try:
                inst.release()
            except (OSError, AssertionError):
                pass
        cluster.stop()


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
