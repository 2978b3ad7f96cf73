"""The side-by-side section (this proxy, nginx, an LLM router), from bench/results/peers.json
(bench/peers): one subsection per backend (`backends`: sim, starlette), each with its medians,
ratios, the peer targets, per-repeat ratios and this proxy's CPU split by role. A file
without `backends` (written before there were two) is rendered as one backend. Only the shared
schema is assumed: contenders with `median` figures, ratios, notes; latency samples are found
by their key names (see `distributions`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from bench.report import blocks
from bench.report.fmt import label, num, ratio, table, verdict

FILE = "peers.json"
BACKEND_TITLES = {"sim": "the project's simulated instances (cacheroute_sim)",
                  "starlette": "a plain Starlette/uvicorn OpenAI fake (bench/peers/openai_fake.py)"}
SAMPLE_WORDS = ("sample", "latenc", "ttft", "percentile")
MIN_SAMPLES = 3
MAX_DEPTH = 3
TITLE = "This proxy against nginx and an LLM router"


def section(data: dict[str, Any], charts_dir: Path | None, link_base: str, file_name: str = FILE,
            title: str = TITLE) -> str:
    """charts_dir None: no charts (matplotlib is missing). Another run of the same harness
    (`file_name`) gets its own title and charts."""
    parts = [f"## {title}", *blocks.header_blocks(data, file_name)]
    tag = "" if file_name == FILE else "_" + Path(file_name).stem
    for name, backend in backends(data):
        parts += backend_parts(name, backend, charts_dir, link_base, tag)
    parts += [blocks.method(data), blocks.notes(data)]
    return "\n\n".join(p for p in parts if p)


def backends(data: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """(backend name, its section) in run order; a file without `backends` is one unnamed one."""
    if isinstance(data.get("backends"), dict):
        return list(data["backends"].items())
    return [(None, data)]


def backend_heading(name: str) -> str:
    return f"### Backend `{name}`: {BACKEND_TITLES.get(name, name)}"


def backend_parts(name: str | None, backend: dict[str, Any], charts_dir: Path | None,
                  link_base: str, tag: str = "") -> list[str]:
    contenders = backend.get("contenders", [])
    heading = backend_heading(name) if name else ""
    chart = f"peers_latency_{name}{tag}.png" if name else f"peers_latency{tag}.png"
    parts = [heading, targets_table(backend.get("targets") or []), medians(contenders),
             ratios(backend.get("ratios_to_nginx") or {}, "nginx"),
             ratios(backend.get("ratios_to_router") or {}, "vllm-router (power_of_two)"),
             ratios(backend.get("ratios_to_floor") or {},
                    "the relay floor (this proxy's server and client, nothing between)"),
             repeat_ratios(backend.get("repeat_ratios") or []), cpu_split(contenders),
             idle_cpu(backend.get("idle_cpu_cores_per_contender") or {}),
             flagged(contenders), chart_link(contenders, charts_dir, link_base, chart)]
    if name:
        parts.append(blocks.notes({"notes": backend.get("notes") or []}))
    return parts


def idle_cpu(cores: dict[str, Any]) -> str:
    """What each contender burns while another is measured (every contender is up all run)."""
    if not cores:
        return ""
    return "Idle CPU (cores) of each contender while nothing is sent: " + \
        ", ".join(f"`{name}` {num(value)}" for name, value in cores.items())


def targets_table(verdicts: list[dict[str, Any]]) -> str:
    """The peer targets for this backend: measured (ratio of medians or the median itself),
    the bound, PASS/FAIL, and each repeat's figure."""
    if not verdicts:
        return ""
    rows = []
    for v in verdicts:
        show = ratio if v.get("versus") else _absolute(v.get("figure", ""))
        bound = f"{'≥' if v.get('at_least') else '≤'} {show(v.get('bound'))}"
        rows.append([v["target"], f"`{v.get('contender')}`", num(v.get("figure")),
                     show(v.get("measured")), bound, verdict(v.get("passed")),
                     ", ".join(show(x) for x in v.get("per_repeat") or []) or "–"])
    return "Targets (the data-plane targets), from this run's medians:\n\n" + table(
        ["target", "contender", "figure", "measured", "bound", "verdict", "per repeat"], rows)


def _absolute(figure: str) -> Any:
    unit = " ms" if figure.endswith("_ms") else ""
    return lambda value: num(value) + (unit if value is not None else "")


def repeat_ratios(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cells = [[f"`{r['contender']}`", num(r.get("figure")),
              ", ".join(ratio(x) for x in r.get("to_nginx") or []) or "–",
              ", ".join(ratio(x) for x in r.get("to_router") or []) or "–"] for r in rows]
    return "Per-repeat ratios (each repeat's contender / nginx and / vllm-router-p2):\n\n" + \
        table(["contender", "figure", "× nginx per repeat", "× vllm-router per repeat"], cells)


def cpu_split(contenders: list[dict[str, Any]]) -> str:
    """CPU seconds per 1,000 requests (c32) and streams (stream32), and per 1M relayed tokens
    (stream256), by role, for the contenders whose points carry a split (this proxy), beside the
    whole tree's."""
    rows = []
    for c in contenders:
        m = c.get("median") or {}
        split = m.get("cpu_s_per_1k_by_role") or {}
        if not split:
            continue
        roles = sorted({role for by_role in split.values() for role in by_role})
        for role in roles:
            rows.append([f"`{c['name']}`", role, num((split.get("req") or {}).get(role)),
                         num((split.get("streams") or {}).get(role)),
                         num((split.get("1m tokens") or {}).get(role))])
        rows.append([f"`{c['name']}`", "**whole tree**", num(m.get("cpu_s_per_1k_req")),
                     num(m.get("cpu_s_per_1k_streams")), num(m.get("cpu_s_per_1m_tokens"))])
    if not rows:
        return ""
    return "CPU split by role (medians; roles by command line: launcher = the supervisor):\n\n" + \
        table(["contender", "role", "CPU s/1k requests (c32)", "CPU s/1k streams (stream32)",
               "CPU s/1M tokens (stream256)"], rows)


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


def ratios(r: dict[str, dict[str, Any]], base: str) -> str:
    keys: list[str] = []
    for values in r.values():
        keys += [k for k in values if k not in keys]
    if not keys:
        return ""
    rows = [[f"`{name}`", *[ratio(values.get(k)) for k in keys]] for name, values in r.items()]
    return f"Ratios to {base} measured in the same run:\n\n" + \
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


def chart_link(contenders: list[dict[str, Any]], charts_dir: Path | None, link_base: str,
               file_name: str = "peers_latency.png") -> str:
    if charts_dir is None:
        return ""
    from bench.report import charts  # matplotlib only when charts are drawn

    panels: dict[str, dict[str, dict[str, list[float]]]] = {}
    for c in contenders:
        for title, dist in distributions(c).items():
            panels.setdefault(title, {})[c["name"]] = dist
    if not panels:
        return "(No latency samples in peers.json: no distribution chart.)"
    path = charts.latency_cdfs(charts_dir / file_name, panels)
    return f"Latency distributions (CDF, log scale):\n\n![{path.stem}]({link_base}/{path.name})"
