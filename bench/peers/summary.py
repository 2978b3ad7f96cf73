"""From raw points to what the results file and the table show: medians per contender, ratios
to nginx, error flags, one log line per point and the Markdown table."""

from __future__ import annotations

from typing import Any

from bench.harness.stats import median, ratio

# median key -> (scenario, key in that scenario's points)
METRICS: dict[str, tuple[str, str]] = {
    "added_p50_ms": ("c1", "added_p50_ms"),
    "added_p99_ms": ("c1", "added_p99_ms"),
    "c1_p50_ms": ("c1", "p50_ms"),
    "c1_p99_ms": ("c1", "p99_ms"),
    "rps_c32": ("c32", "rps"),
    "c32_p50_ms": ("c32", "p50_ms"),
    "c32_p99_ms": ("c32", "p99_ms"),
    "cpu_s_per_1k_req": ("c32", "cpu_s_per_1k"),
    "streams_per_s_c32": ("stream32", "streams_per_s"),
    "ttft_p50_ms": ("stream32", "ttft_p50_ms"),
    "ttft_p99_ms": ("stream32", "ttft_p99_ms"),
    "cpu_s_per_1k_streams": ("stream32", "cpu_s_per_1k"),
    "streams_per_s_256": ("stream256", "streams_per_s"),
    "cpu_s_per_1m_tokens": ("stream256", "cpu_s_per_1m_tokens"),
}


def contender_entry(described: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """{name, kind, workers, strategy, runs, median, errors, flagged}: the median of each metric
    over its points (for direct's c1, every baseline run), RSS after its last point."""
    medians: dict[str, Any] = {}
    for metric, (scenario, key) in METRICS.items():
        medians[metric] = median([r.get(key) for r in runs if r.get("scenario") == scenario])
    medians["cpu_s_per_1k_by_role"] = _role_medians(runs)
    medians["rss_mb"] = runs[-1].get("rss_mb") if runs else None
    errors = sum(r.get("errors", 0) or 0 for r in runs) + sum(1 for r in runs if r.get("wrk_failed"))
    medians["errors"] = errors
    return {**described, "runs": runs, "median": medians, "errors": errors, "flagged": errors > 0}


# scenario -> (what it is counted by, the point's CPU split by role)
ROLE_SCENARIOS = {"c32": ("req", "cpu_s_per_1k_by_role"),
                  "stream32": ("streams", "cpu_s_per_1k_by_role"),
                  "stream256": ("1m tokens", "cpu_s_per_1m_tokens_by_role")}


def _role_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """{"req": {role: median CPU s/1k}, "streams": {...}, "1m tokens": {role: CPU s/1M}} for a
    contender whose points carry a CPU split by role (this proxy: launcher, sidecar, workers);
    {} for the others."""
    out: dict[str, dict[str, float | None]] = {}
    for scenario, (counted, split) in ROLE_SCENARIOS.items():
        points = [r.get(split) or {} for r in runs if r.get("scenario") == scenario]
        roles = sorted({role for point in points for role in point})
        if roles:
            out[counted] = {role: median([p.get(role) for p in points]) for role in roles}
    return out


def ratios_to(entries: list[dict[str, Any]], base_name: str) -> dict[str, dict[str, float | None]]:
    """Each contender's median / the base's median, metric by metric (None where undefined)."""
    base = next((e for e in entries if e["name"] == base_name), None)
    if base is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for entry in entries:
        out[entry["name"]] = {
            metric: ratio(entry["median"].get(metric), base["median"].get(metric), 3)
            for metric in [*METRICS, "rss_mb"]}
    return out


def flag_notes(entries: list[dict[str, Any]]) -> list[str]:
    notes = []
    for e in entries:
        if e["flagged"]:
            kinds: dict[str, int] = {}
            for r in e["runs"]:
                for kind, n in (r.get("error_kinds") or {}).items():
                    kinds[kind] = kinds.get(kind, 0) + n
            notes.append(f"FLAGGED {e['name']}: {e['errors']} errors over the run {kinds}")
    return notes


def one_line(scenario: str, point: dict[str, Any]) -> str:
    if scenario == "stream256":
        return (f"{point.get('streams_per_s', 0):8.1f} streams/s  cpu/1M tokens "
                f"{point.get('cpu_s_per_1m_tokens')} s  errors {point.get('errors', 0)}")
    if scenario == "stream32":
        text = (f"{point.get('streams_per_s', 0):8.1f} streams/s  ttft p50 "
                f"{point.get('ttft_p50_ms')} ms")
    elif scenario == "c32":
        text = f"{point.get('rps', 0):8.1f} req/s  p50 {point.get('p50_ms')} ms"
    else:
        text = f"p50 {point.get('p50_ms')} ms  p99 {point.get('p99_ms')} ms"
        if "added_p50_ms" in point:
            text += f"  added p50 {point['added_p50_ms']} ms"
    return f"{text}  cpu/1k {point.get('cpu_s_per_1k')} s  errors {point.get('errors', 0)}"


COLUMNS = [  # header, median key, format
    ("added p50 ms", "added_p50_ms", "{:.3f}"), ("added p99 ms", "added_p99_ms", "{:.3f}"),
    ("req/s c32", "rps_c32", "{:.0f}"), ("CPU s/1k req", "cpu_s_per_1k_req", "{:.3f}"),
    ("streams/s c32", "streams_per_s_c32", "{:.0f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.2f}"),
    ("CPU s/1k streams", "cpu_s_per_1k_streams", "{:.3f}"),
    ("streams/s 256 tok", "streams_per_s_256", "{:.0f}"),
    ("CPU s/1M tokens", "cpu_s_per_1m_tokens", "{:.2f}"), ("RSS MB", "rss_mb", "{:.0f}"),
]
RATIO_COLUMNS = [("req/s ×nginx", "rps_c32"), ("streams/s ×nginx", "streams_per_s_c32"),
                 ("CPU/1k req ×nginx", "cpu_s_per_1k_req")]


def table(result: dict[str, Any]) -> str:
    """The Markdown table of medians (and a few ratios to nginx) for the report."""
    head = ["contender", *(h for h, _, _ in COLUMNS), *(h for h, _ in RATIO_COLUMNS), "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = result.get("ratios_to_nginx", {})
    for e in result["contenders"]:
        m = e["median"]
        cells = [e["name"]]
        cells += [_fmt(m.get(key), fmt) for _, key, fmt in COLUMNS]
        cells += [_fmt(ratios.get(e["name"], {}).get(key), "{:.2f}") for _, key in RATIO_COLUMNS]
        cells.append(f"{e['errors']}{' FLAGGED' if e['flagged'] else ''}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def target_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """One console line per target of bench/peers/targets.py: verdict, figure, per repeat."""
    lines = []
    for v in verdicts:
        word = {None: "NOT MEASURED", True: "PASS", False: "FAIL"}[v["passed"]]
        lines.append(f"{word:12} {v['target']}: {v['measured']} (per repeat {v['per_repeat']})")
    return lines
