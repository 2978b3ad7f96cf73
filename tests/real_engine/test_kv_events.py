"""kv_aware on the engines' own account of their prefix cache: the
proxy tokenizes as the engine does, the sidecar follows each engine's KV cache events, every
worker then sees which engine holds a prompt's blocks, and requests sharing that prefix go
there and hit the engine's prefix cache."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable

import pytest

from cacheroute_proxy import engine_prefix
from proxy_workers.request_model import Message
from tests.harness import Cluster, get, http, wait_until
from tests.real_engine.engines import SERVED_MODEL, TINY_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

BLOCK = 128  # vLLM's block size on CPU
SHARED = " ".join(f"knowledge{i % 7} cache route proxy model token stream" for i in range(60))


def test_the_proxy_tokenizes_chat_and_completions_as_the_engine(healthy_engines: list[VllmEngine]) -> None:
    engine = healthy_engines[0]
    prefix = engine_prefix.load(str(TINY_MODEL), BLOCK, 32)
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "what now?"}]
    status, body, _ = http("POST", f"{engine.url}/tokenize", {"model": SERVED_MODEL, "messages": messages})
    assert status == 200, body
    assert prefix.chat_tokens([Message(**m) for m in messages]) == body["tokens"]
    status, body, _ = http("POST", f"{engine.url}/tokenize", {"model": SERVED_MODEL, "prompt": SHARED})
    assert status == 200, body
    assert prefix.completion_tokens(SHARED) == body["tokens"]


def test_kv_aware_follows_the_engines_kv_events_to_their_prefix_cache(
        proxy: Callable[..., Cluster], healthy_engines: list[VllmEngine]) -> None:
    ids = {f"vllm-{e.port}": e for e in healthy_engines}
    # No PROXY_KV_EVENTS: each agent finds its engine's publisher in /kv_event_sources.
    cluster = proxy(engines=2, workers=2, strategy="kv_aware", env={
        "PROXY_AFFINITY_TOKENIZER": str(TINY_MODEL), "PROXY_AFFINITY_BLOCK_TOKENS": str(BLOCK)})
    wait_until(lambda: {iid: feed["endpoint"] for iid, feed in cluster.status()["kv_event_feeds"].items()}
               == {iid: e.kv_events_endpoint for iid, e in ids.items()}, 15,
               message="the sidecar subscribed to both engines' publishers")
    time.sleep(0.5)  # ZMQ gives a subscriber nothing published before its connection is up
    blocks = len(engine_prefix.load(str(TINY_MODEL), BLOCK, 32).completion_tokens(SHARED)) // BLOCK
    assert blocks >= 3

    def ask(suffix: str) -> str:
        wait_until(lambda: all(r["least_load_score"]["total"] == 0 for w in range(cluster.workers)
                               for r in cluster.loads(w)["instances"]), 15, message="idle")
        status, body, headers = http("POST", f"{cluster.dp_url}/v1/completions", {
            "model": SERVED_MODEL, "prompt": f"{SHARED} {suffix}", "max_tokens": 4}, timeout=120)
        assert status == 200, body
        return headers["x-cacheroute-instance"]

    def held(worker: int) -> dict[str, int]:
        loads = get(f"{cluster.worker_url(worker)}/debug/instance_loads?"
                    f"{urllib.parse.urlencode({'prompt': SHARED})}")
        return {r["instance_id"]: r["affinity"]["resident_prefix_blocks"] for r in loads["instances"]}

    first = ask("first")
    other = next(iid for iid in ids if iid != first)
    # The engine's BlockStored events, not a guess: every worker sees its blocks there only.
    wait_until(lambda: all(held(w) == {first: blocks, other: 0} for w in range(cluster.workers)), 15,
               message=f"the engine's blocks in every worker's view\n{cluster.launcher_log()[-3000:]}")
    affinity = cluster.status()["event_channel"]["affinity"]
    assert affinity["instances"][first]["prefix_from"] == "engine"
    assert affinity["engine_blocks_stored"] >= blocks
    hits_before = {iid: e.metric("vllm:prefix_cache_hits_total") for iid, e in ids.items()}
    served = [ask(f"question {i}") for i in range(4)]
    assert served == [first] * 4
    hits = {iid: e.metric("vllm:prefix_cache_hits_total") - hits_before[iid] for iid, e in ids.items()}
    # Each of the four reused the shared prompt's blocks on the engine that held them.
    assert hits[first] >= 4 * blocks * BLOCK and hits[other] == 0, hits
