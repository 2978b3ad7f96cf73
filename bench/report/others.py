"""Sections for the results files in their own shapes: the selection path
(bench/results/select.json, bench/bench_select.py), a worker's own CPU per request
(pipeline_cost.json, bench/pipeline_cost.py, pipeline_cost_metrics_ab.json, an A/B of it, and
instructions.json, bench/instructions.py, its variants in instructions),
naming a chat prompt's blocks as the engine does (prefix_keys.json, bench/bench_prefix_keys.py),
the sidecar's event cost (events*.json, bench/bench_events.py), predicted pressure
(pressure.json and pressure_vllm.json, bench/bench_pressure.py: simulated instances, and real
vLLM engines) and the soak (soak.json, bench/soak/)."""

from __future__ import annotations

import statistics

from typing import Any

from bench.report import blocks
from bench.report.fmt import DASH, label, num, table, verdict


def select_section(data: dict[str, Any]) -> str:
    results = data.get("results") or {}
    sizes: list[str] = []
    for per_size in results.values():
        sizes += [s for s in per_size if s not in sizes]
    rows = [[f"`{case}`", *[num((per_size.get(s) or {}).get("median_us")) for s in sizes]]
            for case, per_size in results.items()]
    parts = ["## Selection path (µs per call)", *blocks.header_blocks(data, "select.json")]
    if rows:
        parts.append("Median µs per call by number of instances:\n\n" +
                     table(["case", *[f"n={s}" if s.isdigit() else s for s in sizes]], rows))
    targets = data.get("targets") or {}
    if targets:
        met = [[label(k), verdict(v) if isinstance(v, bool) else num(v)] for k, v in targets.items()]
        parts.append("Targets:\n\n" + table(["target", "value / met"], met))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def pipeline_cost_section(data: dict[str, Any]) -> str:
    """bench/results/pipeline_cost.json (bench/pipeline_cost.py): a worker's own CPU per request."""
    results = data.get("results") or {}
    rows = [[name, num(r.get("min_us")), num(r.get("median_us")),
             "–" if r.get("part_us") is None else num(r["part_us"])] for name, r in results.items()]
    parts = ["## A worker's own CPU per request, without the client socket",
             *blocks.header_blocks(data, "pipeline_cost.json")]
    if rows:
        parts.append(f"{num(data.get('repeats'))} interleaved blocks of {num(data.get('requests_per_block'))} "
                     f"requests, {num(data.get('concurrency'))} at a time:\n\n" +
                     table(["variant", "fastest block (µs)", "median (µs)", "full − this, fastest (µs)"], rows))
    cold = data.get("cold") or {}
    if cold:
        cold_rows = [[name, num(r.get("median_us")), "–" if r.get("part_us") is None else num(r["part_us"])]
                     for name, r in cold.items()]
        parts.append(f"The same, one request at a time on evicted caches ({num(data.get('cold_requests'))} "
                     "each, median): what a request costs when requests come tens of milliseconds "
                     "apart on a machine the engines share:\n\n" +
                     table(["variant", "cold (µs)", "full − this (µs)"], cold_rows))
    parts += _profile_tables(data.get("profile") or {})
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def _profile_tables(profile: dict[str, Any]) -> list[str]:
    """The full path under cProfile: own time by package, then the functions that take most."""
    if not profile:
        return []
    full = num(profile.get("full_us"))
    packages = [[f"`{row['package']}`", f"{num(row['share'] * 100)} %", num(row["us"])]
                for row in profile.get("packages") or []]
    functions = [[f"`{row['function']}`", num(row["calls_per_request"]), f"{num(row['share'] * 100)} %",
                  num(row["us"])] for row in profile.get("functions") or []]
    return [f"The full path by package, under cProfile (own time; µs: that share of the {full} µs "
            "median):\n\n" + table(["package", "share", "µs"], packages),
            "The functions taking most of it:\n\n" +
            table(["function", "calls a request", "share", "µs"], functions)]


def prefix_keys_section(data: dict[str, Any]) -> str:
    """bench/results/prefix_keys.json (bench/bench_prefix_keys.py): a worker's CPU to name a
    chat request's blocks as the engine does, the whole prompt against the memo."""
    parts = ["## Naming a chat prompt's blocks as the engine does (µs of CPU per request)",
             *blocks.header_blocks(data, "prefix_keys.json")]
    for size, result in (data.get("results") or {}).items():
        rows = []
        for name, case in (result.get("cases") or {}).items():
            split = case.get("parts_us_median") or {}
            memo = case.get("memo") or {}
            rows.append([f"`{name}`", num((case.get("cpu_us_per_request") or {}).get("median")),
                         *[num(split.get(p)) for p in ("render", "tokenize", "hash", "other")],
                         " / ".join(num(memo.get(k)) for k in ("hits", "partial", "misses", "fallbacks"))])
        parts.append(
            f"Blocks of {size} tokens, prompts of ~{num(result.get('prompt_tokens_median'))} tokens; "
            f"{num(data.get('repeats'))} interleaved blocks of {num(data.get('requests_per_block'))} "
            "requests a case:\n\n"
            + table(["case", "median", "render", "tokenize", "hash", "other",
                     "memo hits / partial / misses / fallbacks"], rows)
            + f"\n\nwhole / memo {num(result.get('whole_over_memo'))}×; multiturn whole / memo "
            f"{num(result.get('multiturn_whole_over_memo'))}×; a miss costs "
            f"{num(result.get('miss_over_whole'))}× whole")
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def events_section(data: dict[str, Any], file_name: str = "events.json",
                   title: str = "Sidecar event cost (µs of CPU per request)") -> str:
    """bench/results/events.json (bench/bench_events.py): the sidecar's CPU per request;
    events_warm.json is the same benchmark ticking back to back (--poll-ms 0)."""
    results = data.get("results") or {}
    current, baseline = results.get("current") or {}, results.get("baseline") or {}
    speedup = data.get("speedup_vs_baseline") or {}
    parts = [f"## {title}", *blocks.header_blocks(data, file_name)]
    if data.get("poll_ms") is not None:
        parts.append(f"Tick interval: {num(data['poll_ms'])} ms"
                     + ("" if not data.get("baseline_ref") else
                        f"; baseline: the product at `{blocks.without_commits(data['baseline_ref'])}` "
                        "(`--baseline`), in its own process, interleaved with the current tree"))
    rows = []
    for case, now in current.items():
        before = baseline.get(case) or {}
        ratio = speedup.get(case) or {}
        rows.append([f"`{case}`", num(before.get("median_us_per_request")),
                     num(now.get("median_us_per_request")), num(ratio.get("median_ratio")),
                     num(ratio.get("per_repeat")), num(now.get("events_per_request"))])
    if rows:
        parts.append("Median µs of sidecar CPU per request (drain + apply + publish), by "
                     "instances:mode:\n\n" + table(
                         ["case", "baseline", "current", "× (median of repeats)", "× per repeat",
                          "events / request"], rows))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def pressure_section(data: dict[str, Any]) -> str:
    return _pressure("Predicted pressure against reality", "pressure.json", data)


def pressure_vllm_section(data: dict[str, Any]) -> str:
    return _pressure("Predicted pressure against real vLLM engines", "pressure_vllm.json", data)


def _pressure(title: str, file_name: str, data: dict[str, Any]) -> str:
    parts = [f"## {title}", *blocks.header_blocks(data, file_name)]
    workload = data.get("workload") or {}
    if workload:
        parts.append("Workload: " + "; ".join(f"{k} {num(v)}" for k, v in workload.items()))
    engine = data.get("engine") or {}
    if engine:
        parts.append("Engines: " + "; ".join(f"{k} {num(v)}" for k, v in engine.items()))
    rows = []
    for group in ("ttft_prediction_error_ms", "actual_ttft_ms", "snapshot_age_ms"):
        for key, value in (data.get(group) or {}).items():
            rows.append([label(group), key, num(value)])
    for key in ("requests_ok", "requests_failed"):
        if key in data:
            rows.append([label(key), "", num(data[key])])
    if rows:
        parts.append(table(["figure", "statistic", "value"], rows))
    failures = data.get("failures") or {}
    if failures:
        parts.append("Failures (most common):\n\n" +
                     "\n".join(f"- {num(count)} × `{reason}`" for reason, count in failures.items()))
    if data.get("loadavg_at_start"):
        parts.append(f"Load average at the start: {num(data['loadavg_at_start'])}")
    if data.get("loadavg"):
        parts.append(f"Load average at the end: {num(data['loadavg'])}")
    return "\n\n".join(p for p in parts if p)


def instructions_section(data: dict[str, Any]) -> str:
    """bench/results/instructions.json (bench/instructions.py): pipeline_cost's variants counted
    in instructions a request by callgrind, which the machine's load does not move."""
    results = data.get("results") or {}
    full = (results.get("full") or {}).get("per_request")
    floor = (results.get("relay floor") or {}).get("per_request")
    product = None if full is None or floor is None else full - floor
    rows = [[name, num(r.get("per_request")), DASH if r.get("part") is None else num(r["part"]),
             DASH if r.get("part") is None or not product else f"{num(100 * r['part'] / product)} %"]
            for name, r in results.items()]
    parts = ["## A worker's own instructions per request (callgrind)",
             *blocks.header_blocks(data, "instructions.json")]
    if rows:
        parts.append(f"Instructions a request, {num(data.get('requests'))} requests between the two runs "
                     f"of each variant; the product's own (full − relay floor): {num(product)}:\n\n" +
                     table(["variant", "instructions a request", "full − this", "of the product's own"], rows))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def pipeline_cost_ab_section(data: dict[str, Any]) -> str:
    """bench/results/pipeline_cost_metrics_ab.json: bench/pipeline_cost.py run alternately from
    two trees (the first one named is "before"); µs of CPU a request, fastest block."""
    runs = data.get("runs") or []
    trees = list(dict.fromkeys(r.get("tree") for r in runs))
    names = {tree: name for tree, name in zip(trees, ("before", "after"))}
    parts = ["## A worker's own CPU per request, before and after a change (A/B of pipeline_cost)",
             blocks.provenance(data, "pipeline_cost_metrics_ab.json"),
             blocks.machine(runs[0] if runs else {})]
    if data.get("note"):
        parts.append(blocks.without_dates(blocks.without_commits(data["note"])) + ".")
    rows = []
    for r in runs:
        results = r.get("results") or {}
        full = (results.get("full") or {}).get("min_us")
        floor = (results.get("relay floor") or {}).get("min_us")
        rows.append([num(r.get("run")), names.get(r.get("tree"), DASH), num(full), num(floor),
                     num(None if full is None or floor is None else full - floor),
                     num((results.get("without metrics") or {}).get("part_us"))])
    if rows:
        parts.append("µs of CPU a request, fastest block of each run, the trees alternating:\n\n" + table(
            ["run", "tree", "full path", "relay floor", "full − floor", "metrics part (full − without)"], rows))
    return "\n\n".join(p for p in parts if p)


def soak_section(data: dict[str, Any], name: str = "soak.json", title: str = "Soak under chaos") -> str:
    """bench/results/soak.json or another soak's file (bench/soak/): the verdict, the traffic,
    the chaos and every end invariant."""
    requests, chaos, rss = data.get("requests") or {}, data.get("chaos") or {}, data.get("worker_rss") or {}
    latency = requests.get("latency") or {}
    failed = ", ".join(data.get("failed_checks") or [])
    categories = ", ".join(f"{k} {num(v)}" for k, v in (requests.get("categories") or {}).items())
    parts = [f"## {title}", *blocks.header_blocks(data, name),
             ("**PASSED**" if data.get("passed") else f"**FAILED**: {failed}")
             + f": {num(requests.get('total'))} requests ({num(requests.get('per_second'))}/s); "
             f"outcomes by category: {categories}",
             f"Chaos: {num(chaos.get('worker_kills'))} workers SIGKILLed, {num(chaos.get('flap_503_windows'))} "
             f"windows of the flapper's 503s, {num(chaos.get('flapper_restarts'))} flapper restarts. Worker RSS: "
             f"largest growth {num(rss.get('max_growth_pct'))} % over {num(rss.get('reported_lineages'))} "
             f"worker lineages (limit {num(rss.get('limit_pct'))} %)."]
    lat_rows = [[name, num(v.get("count")), num(v.get("p50_ms")), num(v.get("p99_ms")), num(v.get("max_ms"))]
                for name, v in latency.items()]
    if lat_rows:
        parts.append("Latency of the `ok` requests (ms):\n\n"
                     + table(["requests", "count", "p50", "p99", "max"], lat_rows))
    checks = data.get("end_checks") or {}
    if checks:
        parts.append("End invariants:\n\n" + table(
            ["invariant", "result"], [[f"`{name}`", verdict(c.get("pass"))] for name, c in checks.items()]))
    return "\n\n".join(p for p in parts if p)


def idle_section(data: dict[str, Any], file_name: str = "idle.json", title: str = "At rest") -> str:
    """bench/results/idle.json, or another run of bench/idle.py: each tree's CPU at rest, by
    role, and the target."""
    target = data.get("target") or {}
    rows = []
    for name, result in (data.get("results") or {}).items():
        windows = result.get("windows") or []
        by_role = _median_by_role(windows, "by_role")
        rows.append([name, num(result.get("cpu_s_median")),
                     f"{num(100 * result.get('share_of_a_core_median', 0))} %", by_role,
                     ", ".join(num(w.get("cpu_s")) for w in windows)])
    parts = [f"## {title}", *blocks.header_blocks(data, file_name),
             f"{num(data.get('workers'))} workers, {num(data.get('seconds'))} s windows without traffic "
             f"(medians; every window beside them). Target ≤ "
             f"{num(100 * target.get('share_of_a_core_at_most', 0))} % of a core: **{target.get('verdict')}**.",
             table(["tree", "CPU s", "of a core", "by role (median)", "windows (CPU s)"], rows)]
    return "\n\n".join(p for p in parts if p)


def gate_wait_section(data: dict[str, Any], file_name: str = "gate_wait.json",
                      title: str = "Paced streams, half of them waiting at the ready gate") -> str:
    """bench/results/gate_wait.json, or another run of bench/gate_wait.py: the proxy's CPU per
    relayed token of paced streams, per tree."""
    rows = []
    for name, result in (data.get("results") or {}).items():
        windows = result.get("windows") or []
        by_role = _median_by_role(windows, "cpu_s_by_role")
        rows.append([name, num(result.get("cpu_us_per_token_median")),
                     ", ".join(num(w.get("cpu_us_per_token")) for w in windows),
                     num(statistics.median(w.get("streams_ok", 0) for w in windows)),
                     num(statistics.median(w.get("ttft_p50_ms") or 0.0 for w in windows)), by_role])
    parts = [f"## {title}", *blocks.header_blocks(data, file_name),
             f"{num(data.get('workers'))} workers, least_load, READY_CONCURRENCY 8; {num(data.get('streams'))} "
             f"clients streaming {num(data.get('tokens'))} tokens {num(data.get('token_interval_ms'))} ms apart, "
             f"{num(data.get('seconds'))} s windows (medians; every window beside them).",
             table(["tree", "CPU µs per token", "windows", "streams a window", "TTFT p50 (ms)",
                    "CPU by role (median)"], rows)]
    return "\n\n".join(p for p in parts if p)


def _median_by_role(windows: list[dict[str, Any]], key: str) -> str:
    """"role N s, ...": each role's median CPU seconds over the windows' `key` dicts."""
    roles = sorted({role for w in windows for role in w.get(key, {})})
    return ", ".join(f"{role} {num(statistics.median(w[key].get(role, 0.0) for w in windows))} s"
                     for role in roles)
