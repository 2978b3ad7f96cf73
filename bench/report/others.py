"""Sections for the older results files, in their own shapes: the selection path
(bench/results/select.json, bench/bench_select.py), a worker's own CPU per request
(pipeline_cost.json, bench/pipeline_cost.py), naming a chat prompt's blocks as the engine
does (prefix_keys.json, bench/bench_prefix_keys.py) and predicted pressure
(bench/results/pressure.json and pressure_vllm.json, bench/bench_pressure.py: simulated
instances, and real vLLM engines)."""

from __future__ import annotations

from typing import Any

from bench.report import blocks
from bench.report.fmt import label, num, table, verdict


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
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


def metrics_section(data: dict[str, Any]) -> str:
    """bench/results/metrics.json (bench/bench_metrics.py): a request's metrics, the product's
    file against prometheus_client's multiprocess values."""
    results = data.get("results") or {}
    rows = [[f"`{name}`", num(r.get("median_ns")), num(r.get("min_ns"))] for name, r in results.items()]
    parts = ["## A request's metrics (ns per call)", *blocks.header_blocks(data, "metrics.json")]
    if rows:
        ratios = data.get("prometheus_client_over_product") or {}
        parts.append(f"{num(data.get('repeats'))} interleaved loops of {num(data.get('calls'))} calls:\n\n"
                     + table(["case", "median (ns)", "fastest (ns)"], rows)
                     + "\n\nprometheus_client's multiprocess values over the product's: "
                     + "; ".join(f"`{k}` {num(v)}×" for k, v in ratios.items()))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)


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
                     + ("" if data.get("baseline_commit") is None else
                        f"; baseline: `{data.get('baseline_ref')}` ({data['baseline_commit']}), "
                        f"current: {data.get('commit')}"))
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
