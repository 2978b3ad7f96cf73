"""One measured point: a load generator against one contender, with the contender's process-tree
CPU (user+sys delta over the load) and RSS (after it) charged to it (bench/harness/cpu.py): wrk
(bench/harness/wrk.py) or the streaming client (stream_load.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.harness.contenders import Contender
from bench.harness.cpu import charged, per_1k, per_unit
from bench.harness.wrk import wrk_post_script
from bench.peers import stream_load

PATH = "/v1/chat/completions"


def chat_body(max_tokens: int) -> str:
    """The small OpenAI chat body wrk POSTs (non-streaming)."""
    return ('{"model":"sim-model","messages":[{"role":"user","content":"Say hello."}],'
            f'"max_tokens":{max_tokens},"stream":false}}')


def write_script(directory: Path, max_tokens: int) -> Path:
    return wrk_post_script(directory / "post_chat.lua", chat_body(max_tokens), PATH)


def stream_point(contender: Contender, concurrency: int, seconds: float,
                 max_tokens: int) -> dict[str, Any]:
    result = charged(contender, lambda: stream_load.run_process(contender.url, concurrency,
                                                                 seconds, max_tokens))
    return per_1k(result, result.get("streams_ok"))


def long_stream_point(contender: Contender, concurrency: int, seconds: float,
                      tokens: int) -> dict[str, Any]:
    """`stream_point` with long streams, charged per token too: CPU seconds per million relayed
    tokens (each stream that ended with [DONE] relayed `tokens` content chunks)."""
    point = stream_point(contender, concurrency, seconds, tokens)
    relayed = (point.get("streams_ok") or 0) * tokens
    point["tokens"] = relayed
    point["tokens_per_s"] = round(relayed / point["seconds"], 1) if point.get("seconds") else None
    return per_unit(point, relayed, 1e6, "1m_tokens")


def idle_cpu(contenders: list[Contender], seconds: float) -> dict[str, float]:
    """CPU each contender burns per second while nothing is sent (background polling): the
    noise every idle contender adds while another one is measured."""
    before = {c.name: c.cpu_seconds() for c in contenders}
    time.sleep(seconds)
    return {c.name: round((c.cpu_seconds() - before[c.name]) / seconds, 4) for c in contenders}
