"""Numbers and Markdown tables, formatted one way everywhere in the report."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

DASH = "–"


def num(value: Any) -> str:
    """A figure with as many digits as make sense for its size; '–' for unknown."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e6:
            return f"{int(value):,}"  # 3.0 workers, 0.0 errors: no false precision
        size = abs(value)
        if size >= 1000:
            return f"{value:,.0f}"
        if size >= 100:
            return f"{value:.0f}"
        if size >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if size >= 0.1 or value == 0 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(num(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def pct(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}"


def ratio(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


def verdict(passed: bool | None) -> str:
    return "not measured" if passed is None else ("**PASS**" if passed else "**FAIL**")


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def label(metric: str, units: bool = True) -> str:
    """`ttft_p99_ms` -> `TTFT p99 (ms)`: readable column names from metric keys (a ratio has
    no unit: units=False)."""
    unit = ""
    for suffix, name in (("_ms", "ms"), ("_s", "s"), ("_mb", "MB"), ("_per_s", "/s"), ("_pct", "%")):
        if metric.endswith(suffix):
            metric, unit = metric[: -len(suffix)], name
            break
    words = [w.upper() if w in {"ttft", "cpu", "rss", "rps"} else w
             for w in metric.split("_")]
    text = " ".join(words)
    return f"{text} ({unit})" if unit and units else text
