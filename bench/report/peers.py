"""The side-by-side section (this proxy, nginx, an LLM router), from bench/results/peers.json
(bench/peers). Only the shared schema is assumed: contenders with `median` figures, ratios to
nginx, notes; latency samples are found by their key names (see `distributions`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from bench.report import blocks
from bench.report.fmt import label, num, ratio, table

FILE = "peers.json"
SAMPLE_WORDS = ("sample", "latenc", "ttft", "percentile")
MIN_SAMPLES = 3
MAX_DEPTH = 3


def section(data: dict[str, Any], charts_dir: Path | None, link_base: str) -> str:
    """charts_dir None: no charts (matplotlib is missing)."""
    contenders = data.get("contenders", [])
    parts = ["## This proxy against nginx and an LLM router", *blocks.header_blocks(data, FILE),
             medians(contenders), ratios(data), flagged(contenders),
             chart_link(contenders, charts_dir, link_base), blocks.method(data), blocks.notes(data)]
    return "\n\n".join(p for p in parts if p)


def metric_keys(contenders: list[dict[str, Any]]) -> list[str]:
    """Every scalar figure any contender has a median for, in first-seen order."""
    keys: list[str] = []
    for c in contenders:
        for key, value in (c.get("median") or {}).items():
            if key not in keys and (value is None or isinstance(value, (int, float))):
                keys.append(key)
    return keys


def medians(contenders: list[dict[str, Any]]) -> str:
    if not contenders:
        return ""
    keys = metric_keys(contenders)
    rows = [[f"`{c['name']}`", num(c.get("kind")), num(c.get("workers")), num(c.get("strategy")),
             *[num((c.get("median") or {}).get(k)) for k in keys]] for c in contenders]
    return "Medians over repeats:\n\n" + table(["contender", "kind", "workers", "strategy",
                                                *[label(k) for k in keys]], rows)


def ratios(data: dict[str, Any]) -> str:
    r = data.get("ratios_to_nginx") or {}
    keys: list[str] = []
    for values in r.values():
        keys += [k for k in values if k not in keys]
    if not keys:
        return ""
    rows = [[f"`{name}`", *[ratio(values.get(k)) for k in keys]] for name, values in r.items()]
    return "Ratios to nginx measured in the same run:\n\n" + \
        table(["contender", *[label(k, units=False) for k in keys]], rows)


def flagged(contenders: list[dict[str, Any]]) -> str:
    bad = [c["name"] for c in contenders
           if any(v for k, v in (c.get("median") or {}).items()
                  if "error" in k and isinstance(v, (int, float)))]
    if not bad:
        return ""
    return "Contenders with errors (their figures are suspect): " + ", ".join(f"`{b}`" for b in bad)


def distributions(contender: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Latency distributions of one contender, by a title made from the key path:
    a list of numbers under a key naming samples/latency/TTFT (concatenated over runs), or
    percentile points ({"50": v, ...}, {"p99": v, ...}, [[q, v], ...])."""
    found: dict[str, dict[str, list[float]]] = {}
    sources = [contender, *contender.get("runs", [])]
    for source in sources:
        # Runs of different scenarios (bench/peers: "c1", "c32", "stream32") stay apart.
        prefix = (str(source["scenario"]),) if isinstance(source.get("scenario"), str) else ()
        for path, value in _walk(source, prefix):
            title = " / ".join(path)
            if not any(w in title.lower() for w in SAMPLE_WORDS):
                continue
            if _numbers(value) and len(value) >= MIN_SAMPLES:
                found.setdefault(title, {"samples": []})["samples"] += [float(v) for v in value]
            elif (points := _percentile_points(value)) is not None and title not in found:
                found[title] = points
    return {t: d for t, d in found.items() if d.get("samples") or d.get("values")}


def _walk(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    if not isinstance(node, dict) or len(path) >= MAX_DEPTH:
        return
    for key, value in node.items():
        if key in ("median", "runs"):
            continue
        yield (*path, str(key)), value
        if isinstance(value, dict):
            yield from _walk(value, (*path, str(key)))


def _numbers(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _percentile_points(value: Any) -> dict[str, list[float]] | None:
    """{"50": v, "99.9": v}, {"p99": v} or [[percent, v], ...] (wrk's); quantiles as fractions
    when every key is <= 1, else as percents."""
    raw: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        raw = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        raw = [(q, v) for q, v in value]
    pairs = [(_number(q), v) for q, v in raw]
    if len(pairs) < 2 or any(q is None or not isinstance(v, (int, float)) for q, v in pairs):
        return None
    scale = 100.0 if max(q for q, _ in pairs) > 1 else 1.0
    pairs = sorted((q / scale, float(v)) for q, v in pairs)
    return {"quantiles": [q for q, _ in pairs], "values": [v for _, v in pairs]}


def _number(key: Any) -> float | None:
    try:
        return float(str(key).lower().lstrip("p").rstrip("%"))
    except ValueError:
        return None


def chart_link(contenders: list[dict[str, Any]], charts_dir: Path | None, link_base: str) -> str:
    if charts_dir is None:
        return ""
    from bench.report import charts  # matplotlib only when charts are drawn

    panels: dict[str, dict[str, dict[str, list[float]]]] = {}
    for c in contenders:
        for title, dist in distributions(c).items():
            panels.setdefault(title, {})[c["name"]] = dist
    if not panels:
        return "(No latency samples in peers.json: no distribution chart.)"
    path = charts.latency_cdfs(charts_dir / "peers_latency.png", panels)
    return f"Latency distributions (CDF, log scale):\n\n![{path.stem}]({link_base}/{path.name})"
