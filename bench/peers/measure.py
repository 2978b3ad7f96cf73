"""One measured point: a load generator against one contender, with the contender's process-tree
CPU (user+sys delta over the load) and RSS (after it) charged to it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.wrk import run_wrk, wrk_post_script
from bench.contenders import Contender
from bench.peers import stream_load

PATH = "/v1/chat/completions"


def chat_body(max_tokens: int) -> str:
    """The small OpenAI chat body wrk POSTs (non-streaming)."""
    return ('{"model":"sim-model","messages":[{"role":"user","content":"Say hello."}],'
            f'"max_tokens":{max_tokens},"stream":false}}')


def write_script(directory: Path, max_tokens: int) -> Path:
    return wrk_post_script(directory / "post_chat.lua", chat_body(max_tokens), PATH)


def _charged(contender: Contender, load: Any) -> dict[str, Any]:
    """Run `load()` and add the contender's CPU seconds over it (the whole tree and, where the
    contender has roles, per role) and its RSS after it."""
    roles_before = contender.cpu_seconds_by_role()
    cpu_before, started = contender.cpu_seconds(), time.monotonic()
    result: dict[str, Any] = load()
    result["cpu_s"] = round(contender.cpu_seconds() - cpu_before, 4)
    result["wall_s"] = round(time.monotonic() - started, 3)
    roles_after = contender.cpu_seconds_by_role()
    if roles_after:
        result["cpu_s_by_role"] = {role: round(seconds - roles_before.get(role, 0.0), 4)
                                   for role, seconds in sorted(roles_after.items())}
    result["rss_mb"] = round(contender.rss_mb(), 1)
    return result


def per_1k(result: dict[str, Any], done: int | None) -> dict[str, Any]:
    """CPU seconds per 1,000 of what was done (requests or streams), whole tree and by role."""
    if done:
        result["cpu_s_per_1k"] = round(result["cpu_s"] / done * 1000, 4)
        if "cpu_s_by_role" in result:
            result["cpu_s_per_1k_by_role"] = {role: round(s / done * 1000, 4)
                                              for role, s in result["cpu_s_by_role"].items()}
    return result


def wrk_point(contender: Contender, script: Path, connections: int, seconds: float) -> dict[str, Any]:
    result = _charged(contender, lambda: run_wrk(contender.url, script, connections, seconds))
    return per_1k(result, result.get("requests"))


def stream_point(contender: Contender, concurrency: int, seconds: float,
                 max_tokens: int) -> dict[str, Any]:
    result = _charged(contender, lambda: stream_load.run_process(contender.url, concurrency,
                                                                 seconds, max_tokens))
    return per_1k(result, result.get("streams_ok"))


def idle_cpu(contenders: list[Contender], seconds: float) -> dict[str, float]:
    """CPU each contender burns per second while nothing is sent (background polling): the
    noise every idle contender adds while another one is measured."""
    before = {c.name: c.cpu_seconds() for c in contenders}
    time.sleep(seconds)
    return {c.name: round((c.cpu_seconds() - before[c.name]) / seconds, 4) for c in contenders}
