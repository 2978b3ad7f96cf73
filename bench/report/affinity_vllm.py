"""The kv_aware-on-real-engines section (bench/results/affinity_vllm.json,
bench/bench_affinity_vllm.py): vLLM's own prefix-cache counters per contender, and each run."""

from __future__ import annotations

from typing import Any

from bench.report import blocks
from bench.report.fmt import num, pct, table


def section(data: dict[str, Any]) -> str:
    engine = data.get("engine") or {}
    parts = ["## kv_aware against least_load on two real vLLM engines (prefix-cache hits)",
             *blocks.header_blocks(data, "affinity_vllm.json")]
    parts.append(
        f"Scenario: {num(engine.get('engines'))} vLLM {num(engine.get('vllm_version'))} CPU engines "
        f"serving the tiny model (one core each, prefix caching on, KV capped at "
        f"{num(engine.get('kv_blocks'))} blocks of {num(engine.get('block_size'))} tokens, "
        f"max_num_seqs {num(engine.get('max_num_seqs'))}) behind {num(data.get('workers'))} proxy workers "
        f"(predictor profile {num(data.get('profile'))}). Per run {num(data.get('requests_per_run'))} "
        f"streaming chats over {num(data.get('duration_s'))} s (Poisson, {num(data.get('rate_per_s'))}/s, "
        f"seed {num(data.get('seed'))}): a system prompt of {num(data.get('system_prompt_chars'))} "
        f"characters drawn Zipf({num(data.get('zipf_s'))}) from {num(data.get('system_prompts'))}, a "
        f"distinct user turn, {num(data.get('max_tokens'))} tokens out. Every run starts on a fresh proxy "
        f"and engines whose prefix caches were reset; contenders alternate (ABBA, ABCCBA with a third). "
        f"The hit rate is "
        f"vLLM's own: Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` "
        f"(prompt tokens), both engines together."
        + (f" Proxy settings: {', '.join(f'`{k}={v}`' for k, v in data['proxy_env'].items())}."
           if data.get("proxy_env") else ""))
    header = ["contender", "runs", "prefix-cache hit rate", "per run", "TTFT p50 (ms)", "TTFT p99 (ms)",
              "share per engine", "guard fired", "errors"]
    body = [[r["contender"], num(r.get("runs")), pct(r.get("prefix_cache_hit_rate")),
             " / ".join(pct(v) for v in r.get("hit_rate_per_run") or []),
             num(r.get("ttft_p50_ms")), num(r.get("ttft_p99_ms")),
             " / ".join(num(v) for v in (r.get("share") or {}).values()),
             _guard(r), num(r.get("errors"))] for r in data.get("results") or []]
    parts.append(table(header, body))
    rates = {r["contender"]: r.get("prefix_cache_hit_rate") for r in data.get("results") or []}
    base = rates.get("least_load")
    ratios = [f"{name}'s is {rate / base:.2f}× least_load's" for name, rate in rates.items()
              if name != "least_load" and rate and base]
    if ratios:
        parts.append("Hit rate: " + "; ".join(ratios) + ". TTFT p50 and p99 in the table are medians "
                     "over the runs.")
    runs = data.get("runs") or []
    if runs:
        parts.append("Each run, in the order run:\n\n" + table(
            ["#", "contender", "hits / queries (tokens)", "hit rate per engine", "TTFT p50 / p99 (ms)",
             "share", "credited requests", "guard fired", "index: prefix from (engine blocks stored / removed)"],
            [[num(i + 1), r["contender"],
              f"{num(r.get('prefix_cache_hits'))} / {num(r.get('prefix_cache_queries'))}",
              " / ".join(pct(e.get("hit_rate")) for e in r.get("per_engine") or []),
              f"{num(r.get('ttft_p50_ms'))} / {num(r.get('ttft_p99_ms'))}",
              " / ".join(num(v) for v in (r.get("share") or {}).values()),
              num(r.get("credited")) if r.get("guard_decisions") else "–", _guard(r), _index(r)]
             for i, r in enumerate(runs)]))
    return "\n\n".join(p for p in parts if p)


def _guard(row: dict[str, Any]) -> str:
    if not row.get("guard_decisions"):
        return "–"
    return f"{num(row.get('guard_fired'))} of {num(row.get('guard_decisions'))}"


def _index(row: dict[str, Any]) -> str:
    """Where the sidecar's prefix entries came from in the run: the engines' own KV cache
    events, or the model of what the workers sent."""
    index = row.get("index")
    if not index or not index.get("prefix_from"):
        return "–"
    sources = "/".join(sorted(set(index["prefix_from"].values())))
    if not index.get("engine_blocks_stored"):
        return sources
    return f"{sources} ({num(index['engine_blocks_stored'])} / {num(index.get('engine_blocks_removed'))})"
