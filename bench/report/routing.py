"""The routing-quality section, from bench/results/routing.json (bench/routing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import blocks
from bench.report.fmt import DASH, num, pct, ratio, table, verdict

FILE = "routing.json"
COLUMNS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"),
           ("ttft_p99_ms", "TTFT p99 (ms)"), ("ttft_p99_pooled_ms", "TTFT p99 pooled (ms)"),
           ("total_p99_ms", "total p99 (ms)"),
           ("inflight_spread_mean", "spread mean"), ("inflight_spread_p95", "spread p95"),
           ("errors", "errors"), ("worker_cpu_peak", "worker CPU peak (cores)"))
RATIO_COLUMNS = (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                 ("total_p99_ms", "total p99"), ("inflight_spread_mean", "spread mean"))


def section(data: dict[str, Any], charts_dir: Path | None, link_base: str) -> str:
    """charts_dir None: no charts (matplotlib is missing)."""
    contenders = data.get("contenders", [])
    labels = data.get("instance_labels") or _labels_from(contenders)
    parts = ["## Routing quality with many workers", *blocks.header_blocks(data, FILE),
             scenario(data), checks(data), intervals(data)]
    parts += [medians(contenders, labels), ratios(data), per_repeat(contenders)]
    parts.append(chart_links(data, contenders, labels, charts_dir, link_base))
    parts += [blocks.method(data), blocks.notes(data)]
    return "\n\n".join(p for p in parts if p)


def _labels_from(contenders: list[dict[str, Any]]) -> list[str]:
    keys = contenders[0]["median"].keys() if contenders else []
    return [k[len("share_"):] for k in keys if k.startswith("share_")]


def scenario(data: dict[str, Any]) -> str:
    sc = data.get("scenario") or {}
    if not sc:
        return ""
    inst = ", ".join(f"`{i['label']}` (slow_factor {num(i['slow_factor'])}, max_concurrency "
                     f"{num(i['max_concurrency'])})" for i in sc.get("instances", []))
    sched = sc.get("schedule", {})
    load = data.get("offered_load", {})
    mix = lambda m: ", ".join(f"{v} ({w:.0%})" for v, w in m)  # noqa: E731
    return "\n".join([
        "Scenario (heterogeneous instances, bursty open-loop arrivals, streaming requests):", "",
        f"- instances: {inst}; simulated time scale {num(sc.get('time_scale'))}",
        f"- arrivals: {num(sched.get('duration_s'))} s of bursts with exponential gaps (mean "
        f"{num(sched.get('burst_gap_mean_s'))} s), {sched.get('burst_size', ['?', '?'])[0]}–"
        f"{sched.get('burst_size', ['?', '?'])[1]} requests per burst fired at once, seed {sched.get('seed')}",
        f"- max_tokens mix: {mix(sched.get('max_tokens_mix', []))}; prompt tokens mix: "
        f"{mix(sched.get('prompt_tokens_mix', []))}",
        f"- offered: {num(load.get('requests'))} requests in {num(load.get('bursts'))} bursts, "
        f"{num(load.get('mean_rate_per_s'))} requests/s on average, the same schedule for every "
        "contender and repeat",
        *_proxy_weights(sc),
    ])


def _proxy_weights(sc: dict[str, Any]) -> list[str]:
    """The least_load weight overrides every proxy contender ran with (absent in older files)."""
    overrides = sc.get("least_load_weights")
    if not overrides:
        return []
    pairs = ", ".join(f'"{name}": {num(weight)}' for name, weight in overrides)
    return [f"- every proxy contender: `PROXY_LEAST_LOAD_WEIGHTS='{{{pairs}}}'` "
            "(other weights at the original's defaults); each instance registers its "
            "max_concurrency as `meta.max_num_seqs`"]


def checks(data: dict[str, Any]) -> str:
    out = []
    for key, title in (("checks", "Checks (medians over repeats)"),
                       ("validity", "Validity of the measurement")):
        rows = [(c["name"], num(c.get("value")), num(c.get("threshold")), verdict(c.get("pass")))
                for c in data.get(key, [])]
        if rows:
            out.append(f"{title}:\n\n" + table(("check", "value", "threshold", "result"), rows))
    return "\n\n".join(out)


def intervals(data: dict[str, Any]) -> str:
    spread = data.get("uncertainty") or {}
    rows = [(" / ".join(f"`{name}`" for name in r["compares"]), r["statistic"], num(r.get("repeats")),
             ratio(r.get("ratio")), _interval(r.get("low"), r.get("high")))
            for r in spread.get("rows", [])]
    if not rows:
        return ""
    return ("How sure the checks are: the same comparisons with an interval (" + spread["method"]
            + "). One run's p99 is about its 3rd-slowest request, and the slowest requests come "
            "in clumps, so p99 ratios move a lot between repeats; p90 and p95 pool more of the "
            "tail:\n\n" + table(("comparison", "statistic", "repeats", "ratio", "interval"), rows))


def _interval(low: float | None, high: float | None) -> str:
    return DASH if low is None or high is None else f"{ratio(low)} – {ratio(high)}"


def medians(contenders: list[dict[str, Any]], labels: list[str]) -> str:
    header = ["contender", "workers", "strategy", "load view", *[c for _, c in COLUMNS]]
    rows = []
    for c in contenders:
        m = c.get("median", {})
        rows.append([f"`{c['name']}`", num(c.get("workers")), num(c.get("strategy")),
                     num(c.get("load_view")), *[num(m.get(k)) for k, _ in COLUMNS]])
    by_instance = [[f"`{c['name']}`", *[pct(c.get("median", {}).get(f"share_{lb}")) for lb in labels],
                    *[num(c.get("median", {}).get(f"ttft_p99_ms_{lb}")) for lb in labels]]
                   for c in contenders]
    return "\n\n".join([
        "Medians over repeats (TTFT and total latency at the client; \"pooled\": the p99 of every "
        "repeat's TTFTs together, steadier than the median of per-repeat p99s; spread = max − min "
        "of the instances' own inflight, sampled every 50 ms over the arrival window):\n\n"
        + table(header, rows),
        "By instance (share counted at the instances; TTFT p99 of the requests each one served, "
        "from the response headers; medians over repeats):\n\n" +
        table(["contender", *[f"share {lb}" for lb in labels], *[f"TTFT p99 {lb} (ms)" for lb in labels]],
              by_instance)])


def ratios(data: dict[str, Any]) -> str:
    r = data.get("ratios_to_nginx") or {}
    if not r:
        return ""
    rows = [[f"`{name}`", *[ratio(v.get(k)) for k, _ in RATIO_COLUMNS]] for name, v in r.items()]
    return "Ratios to nginx least_conn measured in the same run (lower is better):\n\n" + \
        table(["contender", *[c for _, c in RATIO_COLUMNS]], rows)


def per_repeat(contenders: list[dict[str, Any]]) -> str:
    repeats = max((len(c.get("runs", [])) for c in contenders), default=0)
    if repeats < 2:
        return ""
    rows = []
    for c in contenders:
        runs = sorted(c["runs"], key=lambda r: r.get("repeat", 0))
        rows.append([f"`{c['name']}`", *[f"{num(r.get('ttft_p99_ms'))} (#{r.get('position', 0) + 1})"
                                         for r in runs]])
    return "TTFT p99 (ms) of each repeat (#: position of the contender in that repeat's order):\n\n" + \
        table(["contender", *[f"repeat {i + 1}" for i in range(repeats)]], rows)


def chart_links(data: dict[str, Any], contenders: list[dict[str, Any]], labels: list[str],
                charts_dir: Path | None, link_base: str) -> str:
    if not contenders or charts_dir is None:
        return ""
    from bench.report import charts  # matplotlib only when charts are drawn

    names = [c["name"] for c in contenders]
    med = [c["median"] for c in contenders]
    shares = {c["name"]: {lb: c["median"].get(f"share_{lb}") for lb in labels} for c in contenders}
    written = [
        charts.share_bars(charts_dir / "routing_share.png", names, labels, shares),
        charts.ttft_bars(charts_dir / "routing_ttft.png", names, [m.get("ttft_p50_ms") for m in med],
                         [m.get("ttft_p99_ms") for m in med],
                         [[r["ttft_p99_ms"] for r in c["runs"] if r.get("ttft_p99_ms") is not None]
                          for c in contenders]),
    ]
    pooled = {c["name"]: {"samples": [v for r in c["runs"] for v in r.get("ttft_samples_ms", [])]}
              for c in contenders}
    if any(d["samples"] for d in pooled.values()):
        written.append(charts.latency_cdfs(charts_dir / "routing_ttft_cdf.png",
                                           {"TTFT at the client, every repeat pooled": pooled}))
    series = {c["name"]: c["runs"][0]["series"] for c in contenders
              if c.get("runs") and c["runs"][0].get("series", {}).get("t_s")}
    if series:
        window = (data.get("scenario") or {}).get("schedule", {}).get("duration_s")
        written.append(charts.inflight_over_time(charts_dir / "routing_inflight.png", series,
                                                 labels, window))
    return "\n\n".join(f"![{p.stem}]({link_base}/{p.name})" for p in written)
