"""The kv_aware section (bench/results/affinity.json, bench/bench_affinity.py): one row per
contender, and the issue's targets checked against the rows."""

from __future__ import annotations

from typing import Any

from bench.report import blocks
from bench.report.fmt import num, pct, table, verdict

SHARED, PER_WORKER, ONE = "kv_aware shared x4", "kv_aware per_worker x4", "kv_aware x1"
LEAST_LOAD = "least_load x4"


def _share_words(share: float) -> str:
    for n, word in ((3, "a third"), (9, "a ninth"), (2, "a half"), (6, "a sixth")):
        if abs(share - 1 / n) < 1e-3:
            return word
    return f"{share:.2f}"


def section(data: dict[str, Any], source: str = "affinity.json") -> str:
    rows = {r["contender"]: r for r in data.get("results") or []}
    share = data.get("capacity_share") or 1 / 3
    title = "## kv_aware: a host-wide affinity index against per-worker ones and load-only routing"
    if abs(share - 1 / 3) > 1e-3:
        title += f", instances holding {_share_words(share)} of the corpus each"
    parts = [title, *blocks.header_blocks(data, source)]
    parts.append(
        f"Scenario: {num(data.get('requests'))} streaming requests over {num(data.get('duration_s'))} s "
        f"(seed {num(data.get('seed'))}, bursts of 2 s), 75 % kvcache requests naming 1–3 of "
        f"{num(data.get('knowledge_ids'))} knowledge ids drawn Zipf({num(data.get('zipf_s'))}), "
        f"25 % plain chats over 4 shared system prompts; {num(data.get('instances'))} simulated "
        f"instances (one at {num(data.get('slow_factor'))}× the time), each keeping "
        f"{num(data.get('capacity_tokens'))} tokens of KV ({_share_words(share)} of the corpus) with prefix "
        f"caching and heartbeat reports of its resident ids; time scale {num(data.get('time_scale'))}. "
        f"Every contender starts from empty caches.")
    header = ["contender", "resident-hit rate", "of the avoidable", "KDN GB moved", "TTFT p50 (ms)", "TTFT p99 (ms)",
              "knowledge TTFT p50 / p99 (ms)", "prefix-cache hit rate", "share per instance",
              "share CV", "max share / mean", "guard fired", "errors"]
    body = []
    for name, r in rows.items():
        share = " / ".join(num(v) for v in (r.get("share") or {}).values())
        guard = (f"{num(r.get('guard_fired'))} of {num(r.get('guard_decisions'))}"
                 if r.get("guard_decisions") else "–")
        body.append([name, pct(r.get("resident_hit_rate")), pct(r.get("avoidable_hit_rate")),
                     num((r.get("kdn_bytes") or 0) / 1e9),
                     num(r.get("ttft_p50_ms")), num(r.get("ttft_p99_ms")),
                     f"{num(r.get('knowledge_ttft_p50_ms'))} / {num(r.get('knowledge_ttft_p99_ms'))}",
                     pct(r.get("prefix_cache_hit_rate")), share, num(r.get("share_cv")),
                     num(r.get("max_share_over_mean")), guard, num(r.get("requests", 0) - r.get("ok", 0))])
    parts.append(table(header, body))
    first = next(iter(rows.values()), {})
    if first.get("hit_rate_bound") is not None:
        parts.append(
            f"The first request for each id misses wherever it goes: {num(first.get('compulsory_misses'))} "
            f"of the {num(first.get('kv_ids_requested'))} ids requested, so no contender can pass "
            f"{pct(first.get('hit_rate_bound'))}. \"Of the avoidable\" is the hit rate over the others.")
    replayed = data.get("replayed_without_load")
    if replayed:
        parts.append(
            f"Replayed offline against LRU caches of the same capacity, with no load to yield to "
            f"(bench/affinity_ceiling.py): routing at random reaches {pct(replayed['random'])}, "
            f"routing to the instance that holds most of the request's knowledge "
            f"{pct(replayed['holder_first'])}, {num(replayed['holder_first_over_random'])}× as much. "
            f"That ratio is about the most affinity can gain over load-only routing here.")
        if "whole_random" in replayed:
            parts.append(
                f"Of the knowledge requests, {pct(replayed['whole_random'])} find every id already "
                f"held where random routing sends them ({pct(replayed['whole_holder_first'])} "
                f"routed to the holder): above half, the median knowledge request moves no KV "
                f"under load-only routing either, so affinity can shorten its time to first token "
                f"only through the queues.")
    checks = targets(rows, replayed)
    if checks:
        parts.append("Targets (issue 16):\n\n" + table(
            ["target", "value", "result"], [[name, value, verdict(ok)] for name, value, ok in checks]))
    return "\n\n".join(p for p in parts if p)


def _rate(rows: dict[str, Any], name: str, key: str) -> float | None:
    row = rows.get(name)
    return None if row is None else row.get(key)


def targets(rows: dict[str, Any], replayed: dict[str, float] | None = None) -> list[tuple[str, str, bool | None]]:
    shared, ll = _rate(rows, SHARED, "resident_hit_rate"), _rate(rows, LEAST_LOAD, "resident_hit_rate")
    one, per = _rate(rows, ONE, "resident_hit_rate"), _rate(rows, PER_WORKER, "resident_hit_rate")
    p50, ll_p50 = _rate(rows, SHARED, "ttft_p50_ms"), _rate(rows, LEAST_LOAD, "ttft_p50_ms")
    p99, ll_p99 = _rate(rows, SHARED, "ttft_p99_ms"), _rate(rows, LEAST_LOAD, "ttft_p99_ms")
    peak = _rate(rows, SHARED, "max_share_over_mean")
    out: list[tuple[str, str, bool | None]] = []

    def check(name: str, value: float | None, ok: bool | None, fmt=num) -> None:
        out.append((name, fmt(value), None if value is None else ok))

    check("shared kv_aware hit rate / least_load's >= 1.5", shared / ll if shared and ll else None,
          bool(shared and ll and shared / ll >= 1.5))
    if replayed:
        ceiling = replayed.get("holder_first_over_random")
        check("(can routing alone reach 1.5x here? replayed holder_first / random >= 1.5)",
              ceiling, bool(ceiling and ceiling >= 1.5))
    check("shared kv_aware hit rate within 5 % of the 1-worker reference (shared / x1 >= 0.95)",
          shared / one if shared and one else None, bool(shared and one and shared / one >= 0.95))
    check("TTFT p50: shared kv_aware at least 30 % below least_load (ratio <= 0.70)",
          p50 / ll_p50 if p50 and ll_p50 else None, bool(p50 and ll_p50 and p50 / ll_p50 <= 0.70))
    check("TTFT p99: shared kv_aware no worse than least_load (ratio <= 1.00)",
          p99 / ll_p99 if p99 and ll_p99 else None, bool(p99 and ll_p99 and p99 / ll_p99 <= 1.0))
    check("per-worker index clearly below shared on hit rate (per_worker / shared <= 0.95)",
          per / shared if per and shared else None, bool(per and shared and per / shared <= 0.95))
    check("no instance above 1.5x the mean share (shared kv_aware)", peak, bool(peak and peak <= 1.5))
    return out
