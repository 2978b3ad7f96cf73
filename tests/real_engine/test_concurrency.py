"""Load and cancellation against a real engine: more concurrent streams than the engine has
slots all finish, and leave every lane of every worker at 0; a client that leaves mid-stream
makes vLLM abort the request (the upstream connection is closed)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Cluster, wait_until
from tests.real_engine.engines import MAX_MODEL_LEN, MAX_NUM_SEQS, SERVED_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

LANES = ("inflight", "active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth")
STREAMS = 16
STREAM_TOKENS = 48


def busy_lanes(cluster: Cluster) -> list[str]:
    """Every non-zero lane of every instance, as each worker (its private port) reads it."""
    return [f"worker {w} {row['instance_id']} {lane}={row[lane]}"
            for w in range(cluster.workers) for row in cluster.loads(w)["instances"]
            for lane in LANES if row.get(lane)]


class PeakInflight:
    """Polls the sidecar's view of inflight (the shared table) while a load runs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.peak, self._done = cluster, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, sum(self.cluster.inflight().values()))

    def __enter__(self) -> PeakInflight:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)


async def one_stream(client: Any, index: int) -> tuple[int, str | None]:
    stream = await client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": f"stream {index}: hello world"}],
        max_tokens=STREAM_TOKENS, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    usage, finish = 0, None
    async for chunk in stream:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        if getattr(chunk, "usage", None):
            usage = chunk.usage.completion_tokens
    return usage, finish


async def many_streams(openai: Any, cluster: Cluster) -> list[tuple[int, str | None]]:
    client = openai.AsyncOpenAI(base_url=f"{cluster.dp_url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.wait_for(asyncio.gather(*(one_stream(client, i) for i in range(STREAMS))), 240)
    finally:
        await client.close()


def test_more_streams_than_slots_all_finish_and_every_lane_returns_to_zero(
        proxy: Callable[..., Cluster], openai_module: Any, healthy_engines: list[VllmEngine]) -> None:
    cluster = proxy(workers=2)
    with PeakInflight(cluster) as peak:
        results = asyncio.run(many_streams(openai_module, cluster))
    assert results == [(STREAM_TOKENS, "length")] * STREAMS
    assert peak.peak > MAX_NUM_SEQS, f"never more than {peak.peak} streams at once"
    wait_until(lambda: not busy_lanes(cluster), 10, message="every lane back to 0 on every worker")
    wait_until(lambda: healthy_engines[0].metric("vllm:num_requests_running") == 0, 10,
               message="vLLM idle")


def test_a_client_leaving_mid_stream_aborts_the_request_in_vllm(
        proxy: Callable[..., Cluster], healthy_engines: list[VllmEngine]) -> None:
    engine = healthy_engines[0]
    cluster = proxy()
    # vLLM counts no "abort" in vllm:request_success_total; an aborted request is one that
    # stopped running without finishing, and before its tokens were generated.
    finished_before = engine.metric("vllm:request_success_total")
    tokens_before = engine.metric("vllm:generation_tokens_total")
    # As long as the engine allows: ~3 s of decoding for the tiny model on 2 cores. vLLM's API
    # server sometimes stalls for 1-2 s on a loaded host while its engine core goes on
    # decoding, so a shorter request can finish before its first tokens reach the client.
    max_tokens = MAX_MODEL_LEN - 64
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", cluster.dp_port, timeout=30)
    began = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    data_lines = 0
    while data_lines < 3:  # the stream is flowing: the engine is running it
        data_lines += response.fp.readline().startswith(b"data: {")
    flowing = time.monotonic()
    conn.close()  # the client goes away mid-stream, at once (no scrape first: see above)

    wait_until(lambda: engine.metric("vllm:num_requests_running") == 0, 2,
               message=f"vLLM stopped generating\n{engine.tail()}")
    assert engine.metric("vllm:request_success_total") == finished_before, (
        f"it finished instead (its first tokens reached the client {flowing - began:.2f} s "
        f"after it was sent)")
    generated = engine.metric("vllm:generation_tokens_total") - tokens_before
    assert generated < max_tokens / 2, (
        f"{generated:.0f} of {max_tokens} tokens generated; the stream flowed "
        f"{flowing - began:.2f} s after the request was sent")
    wait_until(lambda: not busy_lanes(cluster), 10, message="every lane back to 0 on every worker")
