"""The two engines every contender routes to, and what is read from them: started once with the
same flags for every contender, their prefix caches reset before each run, their own counters
(/metrics) and the calls each contender made of them (their access logs)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.harness.processes import wait_for
from tests.real_engine.engines import MAX_NUM_SEQS, VllmEngine, metric_sum, start_engines

from .workload import BLOCK_TOKENS

ENGINES = 2
KV_BLOCKS = 64  # blocks of BLOCK_TOKENS: 8,192 tokens, about 8 of the 16 system prompts' 7 blocks
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings; a request is ~1,000 tokens
# Every contender meets the same engines: vllm-router 0.1.17 tokenizes by calling
# /v1/chat/completions/render, which vLLM serves only with --enable-scale-out; prefix caching is
# vLLM's default, named anyway; VLLM_SERVER_DEV_MODE=1 serves POST /reset_prefix_cache.
# The model runs in the engine-core process (the uniprocess executor; vLLM's CPU platform allows
# it only with VLLM_ENABLE_V1_MULTIPROCESSING=0, which AsyncLLM's own engine-core process does
# not need). Its default multiprocess executor keeps a worker process that, like the engine core
# reading from it, spins on sched_yield for a second after every message: under load two
# engines then hold both cores of this machine busy, and what every contender's TTFT measured
# was mostly how long the router, the engines' API servers and the load got a turn on them.
# On one OpenMP thread: in-process, vLLM's per-worker thread binding does not apply, and two
# engines with a thread a core each spin on each other's cores (3 req/s at saturation).
ENGINE_ARGS = ("--num-gpu-blocks-override", str(KV_BLOCKS), "--enable-prefix-caching", "--enable-scale-out",
               "--distributed-executor-backend", "uni")
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
# The engine's own TTFT (from its API server taking the request to the first token): its sum and
# count give the mean, which, beside the client's mean, says what the route in front added.
ENGINE_TTFT_SUM, ENGINE_TTFT_COUNT = "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"


def start(log_dir: Path) -> list[VllmEngine]:
    """ENGINES engines, each on its own core, KV events published on tcp://*:port (the form a
    subscriber in another process reaches: the proxy's sidecar and vllm-router alike)."""
    return start_engines(ENGINES, log_dir, extra_args=ENGINE_ARGS, extra_env=ENGINE_ENV,
                         kv_events=True, kv_events_over_tcp=True, max_model_len=MAX_MODEL_LEN)


def describe(engines: Sequence[VllmEngine]) -> dict[str, Any]:
    version = json.loads(_get_text(f"{engines[0].url}/version"))["version"]
    return {"vllm_version": version, "engines": len(engines), "kv_blocks": KV_BLOCKS,
            "block_size": BLOCK_TOKENS, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
            "engine_cores": [e.cpu for e in engines], "env": ENGINE_ENV,
            "argv": engines[0].argv()[1:], "kv_events": [e.kv_events_bind for e in engines]}


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _post_json(url: str) -> Any:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def reset_prefix_cache(engine: VllmEngine) -> None:
    """vLLM refuses (success false) while blocks are held by running requests: retry a while."""
    wait_for(lambda: _post_json(f"{engine.url}/reset_prefix_cache").get("success") is True, 60,
             f"{engine.url}/reset_prefix_cache")


# --- /metrics (pure from the text on) ------------------------------------------------------------
@dataclass(frozen=True)
class Counters:
    """One engine's prefix-cache counters (prompt tokens), finished requests and its own TTFT
    histogram's sum (s) and count."""
    hits: float
    queries: float
    finished: float
    ttft_s: float
    ttft_count: float


def counters_of(text: str) -> Counters:
    names = (HITS, QUERIES, SUCCESS, ENGINE_TTFT_SUM, ENGINE_TTFT_COUNT)
    found = [metric_sum(text, name) for name in names]
    missing = [name for name, value in zip(names, found) if value is None]
    if missing:
        raise RuntimeError(f"/metrics has no {', '.join(missing)}")
    return Counters(*found)  # type: ignore[arg-type]


def read_counters(engines: Sequence[VllmEngine]) -> list[Counters]:
    return [counters_of(_get_text(f"{e.url}/metrics")) for e in engines]


def engine_account(before: Sequence[Counters], after: Sequence[Counters]) -> dict[str, Any]:
    """Between two readings: the hit rate over all engines (Δhits / Δqueries, in tokens), the
    engines' own mean TTFT (ms), and per engine its hits, queries, hit rate and the requests it
    finished (its share)."""
    per = [{"hits": a.hits - b.hits, "queries": a.queries - b.queries, "finished": a.finished - b.finished}
           for b, a in zip(before, after)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    ttft_s = sum(a.ttft_s - b.ttft_s for b, a in zip(before, after))
    ttft_count = sum(a.ttft_count - b.ttft_count for b, a in zip(before, after))
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "engine_ttft_mean_ms": round(1000 * ttft_s / ttft_count, 2) if ttft_count else None,
            "share": [int(p["finished"]) for p in per],
            "per_engine": [{**p, "hit_rate": round(p["hits"] / p["queries"], 4) if p["queries"] else None}
                           for p in per]}


# --- the engines' access logs ----------------------------------------------------------------------
_ACCESS = re.compile(r'"(GET|POST|PUT|DELETE) (\S+) HTTP/[0-9.]+" (\d+)')


def calls_in(text: str) -> Counter[str]:
    """uvicorn's access lines in an engine's log, counted by "METHOD path status"."""
    return Counter(f"{m[1]} {m[2].split('?', 1)[0]} {m[3]}" for m in _ACCESS.finditer(text))


class CallLog:
    """What each engine was asked between mark() and calls(): its log from the marked offset on."""

    def __init__(self, engines: Sequence[VllmEngine]) -> None:
        self.engines = engines
        self._offsets = [0] * len(engines)

    def mark(self) -> None:
        self._offsets = [e.log_path.stat().st_size for e in self.engines]

    def calls(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for engine, offset in zip(self.engines, self._offsets):
            with open(engine.log_path, "rb") as log:
                log.seek(offset)
                total += calls_in(log.read().decode(errors="replace"))
        return total


def contender_calls(calls: Counter[str], engines: int) -> dict[str, int]:
    """The calls of a run's window that the contender made: all but the harness's own reading of
    each engine's /metrics before the load (the window opens before it)."""
    mine = calls.copy()
    mine["GET /metrics 200"] -= engines
    return {call: count for call, count in sorted(mine.items()) if count > 0}
