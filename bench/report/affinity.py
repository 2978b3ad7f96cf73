"""The kv_aware section on simulated instances (bench/results/affinity*.json,
bench/bench_affinity.py): one row per contender (the medians of its runs), the offline ceiling,
and, for the knowledge64 workload, the targets checked against the rows."""

from __future__ import annotations

from typing import Any

from bench.harness.stats import median
from bench.report import blocks
from bench.report.fmt import num, pct, table, verdict

SHARED, PER_WORKER, ONE = "kv_aware shared x4", "kv_aware per_worker x4", "kv_aware x1"
LEAST_LOAD = "least_load x4"
TARGETED = "knowledge64"  # the workload the targets are set for


def _scenario(data: dict[str, Any]) -> str:
    w = data.get("workload") or {}
    low, high = w.get("kids_per_request") or (1, 1)
    ids = "one knowledge id" if (low, high) == (1, 1) else f"{low}–{high} knowledge ids"
    plain = (f"; {pct(w.get('plain_share'))} of the requests are plain chats over 4 shared system prompts"
             if w.get("plain_share") else "")
    burst = w.get("burst") or (None, None)
    calibration = data.get("calibration") or {}
    how = (f"least_load x4 completed {num(calibration.get('saturation_rps'))} req/s in a closed loop of "
           f"{num(calibration.get('concurrency'))} streams for {num(calibration.get('seconds'))} s"
           if "saturation_rps" in calibration else "given on the command line")
    return (f"Scenario (`{w.get('name')}`): {num(data.get('requests'))} streaming requests, each naming "
            f"{ids} of {num(w.get('knowledge_ids'))} drawn Zipf({num(w.get('zipf_s'))}){plain}; "
            f"{num(data.get('instances'))} simulated instances (one at {num(data.get('slow_factor'))}× the time), "
            f"each keeping {num(data.get('capacity_tokens'))} tokens of KV ({pct(w.get('capacity_share'))} of "
            f"the corpus) with heartbeat reports of its resident ids; time scale {num(data.get('time_scale'))}. "
            f"Load: saturation {num(data.get('saturation_rps'))} req/s ({how}); the run offers "
            f"{pct(data.get('load'))} of it on average, {num(data.get('mean_rate_rps'))} req/s over "
            f"{num(data.get('duration_s'))} s, alternating {num(w.get('burst_s'))} s at {num(burst[0])}× and "
            f"{num(w.get('burst_s'))} s at {num(burst[1])}× the mean (Poisson, seed {num(data.get('seed'))}). "
            f"Every contender starts from empty caches.")


# A contender's figures that vary from run to run: its row holds their medians.
MEDIAN_KEYS = ("resident_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "knowledge_ttft_p50_ms", "knowledge_ttft_p99_ms",
               "prefix_cache_hit_rate", "kdn_bytes", "kdn_injects", "kv_ids_pulled",
               "kv_ids_believed_resident_but_evicted", "proxy_skipped_ids", "kv_evictions", "guard_fired",
               "saved_ms_p50", "max_share_over_fair")
RUN_KEYS = ("resident_hit_rate", "ttft_p50_ms", "ttft_p99_ms")  # also kept run by run


def medians(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender, in the order of its first run: the median of each of MEDIAN_KEYS and of
    each instance's share over its runs, requests and errors over all of them, RUN_KEYS run by
    run (`runs`), the rest as in its first run."""
    rows = []
    for name in dict.fromkeys(r["contender"] for r in results):
        mine = [r for r in results if r["contender"] == name]
        row = {k: v for k, v in mine[0].items() if k not in ("logs", "run")}
        row.update({key: median([r.get(key) for r in mine]) for key in MEDIAN_KEYS})
        row["share"] = {i: median([r["share"][i] for r in mine]) for i in mine[0].get("share") or {}}
        row["requests"], row["ok"] = sum(r.get("requests", 0) for r in mine), sum(r.get("ok", 0) for r in mine)
        row["errors"] = sorted({e for r in mine for e in r.get("errors") or ()})[:5]
        row["runs"] = {key: [r.get(key) for r in mine] for key in RUN_KEYS}
        rows.append(row)
    return rows


def section(data: dict[str, Any], source: str = "affinity.json", what: str | None = None) -> str:
    """The run's tables; `what`, if given, says how the run differs from the default one."""
    rows = {r["contender"]: r for r in medians(data.get("results") or [])}
    repeats = data.get("repeats") or 1
    name = (data.get("workload") or {}).get("name")
    title = "## kv_aware on simulated instances: knowledge KV from the KDN"
    if name != TARGETED:
        title += f" (workload `{name}`, no targets)"
    if what:
        title += f", {what}"
    parts = [title, *blocks.header_blocks(data, source), _scenario(data)]
    header = ["contender", "resident-hit rate", "KDN GB moved", "TTFT p50 (ms)", "TTFT p99 (ms)",
              "share per instance", "max share / fair share", "guard fired", "saved p50 (ms)", "errors"]
    body = []
    for contender, r in rows.items():
        share = " / ".join(num(v) for v in (r.get("share") or {}).values())
        guard = (f"{num(r.get('guard_fired'))} of {num(r.get('guard_decisions'))}"
                 if r.get("guard_decisions") else "–")
        body.append([contender, pct(r.get("resident_hit_rate")), num((r.get("kdn_bytes") or 0) / 1e9),
                     num(r.get("ttft_p50_ms")), num(r.get("ttft_p99_ms")), share,
                     num(r.get("max_share_over_fair")), guard, num(r.get("saved_ms_p50")),
                     num(r.get("requests", 0) - r.get("ok", 0))])
    parts.append(table(header, body))
    if repeats > 1:
        parts.append(f"Each figure is the median of {repeats} runs a contender, interleaved (each round "
                     f"reverses the one before); run by run:")
        parts.append(table(["contender", "resident-hit rate", "TTFT p50 (ms)", "TTFT p99 (ms)"],
                           [[contender, *(" / ".join(fmt(v) for v in r["runs"][key]) for key, fmt in
                                          (("resident_hit_rate", pct), ("ttft_p50_ms", num), ("ttft_p99_ms", num)))]
                            for contender, r in rows.items()]))
    fair = data.get("fair_share")
    if fair:
        parts.append("Fair share by speed: " + ", ".join(f"{k} {pct(v)}" for k, v in fair.items()) + ".")
    first = next(iter(rows.values()), {})
    if first.get("hit_rate_bound") is not None:
        parts.append(
            f"The first request for each id misses wherever it goes: {num(first.get('compulsory_misses'))} "
            f"of the {num(first.get('kv_ids_requested'))} ids requested, so no contender can pass "
            f"{pct(first.get('hit_rate_bound'))}.")
    replayed = data.get("replayed_without_load")
    if replayed:
        reached = _rate(rows, SHARED, "resident_hit_rate")
        share = f" kv_aware shared x4 reaches {pct(reached / replayed['holder_first'])} of that ceiling." \
            if reached and replayed.get("holder_first") else ""
        parts.append(
            f"The ceiling: replayed offline against LRU caches of the same capacity, with no load to yield "
            f"to (bench/affinity_ceiling.py), routing at random reaches {pct(replayed['random'])} and "
            f"routing each request to the instance that holds most of its knowledge "
            f"{pct(replayed['holder_first'])}, {num(replayed['holder_first_over_random'])}× as much.{share}")
    if name == TARGETED:
        checks = targets(rows)
        parts.append("Targets:\n\n" + table(
            ["target", "value", "result"], [[check, value, verdict(ok)] for check, value, ok in checks]))
    return "\n\n".join(p for p in parts if p)


def _rate(rows: dict[str, Any], name: str, key: str) -> float | None:
    row = rows.get(name)
    return None if row is None else row.get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(rows: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    shared, ll = _rate(rows, SHARED, "resident_hit_rate"), _rate(rows, LEAST_LOAD, "resident_hit_rate")
    one, per = _rate(rows, ONE, "resident_hit_rate"), _rate(rows, PER_WORKER, "resident_hit_rate")
    checks = [
        ("shared kv_aware hit rate / least_load's >= 1.5", _ratio(shared, ll), lambda v: v >= 1.5),
        ("TTFT p50: shared kv_aware / least_load <= 0.6",
         _ratio(_rate(rows, SHARED, "ttft_p50_ms"), _rate(rows, LEAST_LOAD, "ttft_p50_ms")), lambda v: v <= 0.6),
        ("TTFT p99: shared kv_aware / least_load <= 0.9",
         _ratio(_rate(rows, SHARED, "ttft_p99_ms"), _rate(rows, LEAST_LOAD, "ttft_p99_ms")), lambda v: v <= 0.9),
        ("per-worker index hit rate / shared's <= 0.8", _ratio(per, shared), lambda v: v <= 0.8),
        ("shared within 5 % of 1 worker (hit rate shared / x1 >= 0.95)", _ratio(shared, one), lambda v: v >= 0.95),
        ("no instance above 1.5x its fair share by speed (shared kv_aware)",
         _rate(rows, SHARED, "max_share_over_fair"), lambda v: v <= 1.5),
    ]
    return [(name, num(value), None if value is None else bool(ok(value))) for name, value, ok in checks]
