"""PNG charts with matplotlib's Agg backend (no display). Each function takes plain data
already picked out of a results file and returns the path it wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter  # noqa: E402

DPI = 110
QUANTILE_TICKS = (0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def share_bars(path: Path, contenders: list[str], labels: list[str],
               shares: dict[str, dict[str, float | None]]) -> Path:
    """Grouped bars: for each contender, the share of requests each instance served."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(contenders))]
        ys = [(shares[c].get(label) or 0.0) * 100 for c in contenders]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(contenders)), [_wrap(c) for c in contenders], fontsize=8)
    ax.set_ylabel("share of requests (%)")
    ax.set_title("Requests served by each instance (counted at the instance; median over repeats)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def ttft_bars(path: Path, contenders: list[str], p50: list[float | None], p99: list[float | None],
              per_repeat_p99: list[list[float]]) -> Path:
    """TTFT p50 and p99 (medians over repeats) per contender; dots: each repeat's p99."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = list(range(len(contenders)))
    ax.bar([x - 0.2 for x in xs], [v or 0 for v in p50], 0.4, label="TTFT p50 (median)")
    bars = ax.bar([x + 0.2 for x in xs], [v or 0 for v in p99], 0.4, label="TTFT p99 (median)")
    ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    for x, values in zip(xs, per_repeat_p99, strict=True):
        ax.scatter([x + 0.2] * len(values), values, color="black", s=10, zorder=3,
                   label="p99 of each repeat" if x == 0 else None)
    ax.set_xticks(xs, [_wrap(c) for c in contenders], fontsize=8)
    ax.set_ylabel("ms (client side)")
    ax.set_title("Time to first token at the client")
    ax.legend(fontsize=8)
    return _save(fig, path)


def inflight_over_time(path: Path, series: dict[str, dict[str, Any]], labels: list[str],
                       window_s: float | None) -> Path:
    """One panel per contender: each instance's own inflight gauge over time and the spread
    (max - min) between instances; the arrival window is shaded."""
    names = list(series)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.9 * len(names) + 0.6), sharex=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        t, rows = series[name]["t_s"], series[name]["inflight"]
        for j, label in enumerate(labels):
            ax.plot(t, [r[j] for r in rows], linewidth=0.8, label=label)
        ax.plot(t, [max(r) - min(r) for r in rows], color="black", linewidth=1.3, label="spread")
        if window_s:
            ax.axvspan(0, window_s, color="0.93", zorder=0)
        ax.set_ylabel("inflight", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
    axes[0, 0].legend(fontsize=7, ncol=len(labels) + 1, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the first arrival (shaded: arrivals; then the drain)")
    fig.suptitle("Inflight at each instance, sampled every 50 ms (first repeat)", fontsize=10)
    return _save(fig, path)


def latency_cdfs(path: Path, panels: dict[str, dict[str, dict[str, list[float]]]]) -> Path:
    """One panel per distribution (e.g. non-streaming latency, stream TTFT); per contender a
    CDF, from raw samples ("samples") or from percentile points ("quantiles", "values")."""
    titles = list(panels)
    cols = min(2, len(titles))
    rows = (len(titles) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.flat[len(titles):]:
        ax.set_visible(False)
    for ax, title in zip(axes.flat, titles):
        for name, dist in panels[title].items():
            xs, ys = _cdf_points(dist)
            if xs:
                ax.plot(xs, ys, linewidth=1.2, label=name, marker="" if "samples" in dist else ".")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        # A logit axis spreads the tail (90 %, 99 %, 99.9 %) as evenly as the middle.
        ax.set_yscale("logit")
        ax.yaxis.set_major_locator(FixedLocator(QUANTILE_TICKS))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda q, _: f"{q * 100:g} %"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of requests ≤ x (logit scale)")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _cdf_points(dist: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    """(latency, quantile) points; samples at plotting positions (i + 0.5) / n, so neither
    0 nor 1 (which a logit axis cannot show) occurs."""
    if "samples" in dist:
        values = sorted(v for v in dist["samples"] if v is not None and v > 0)
        n = len(values)
        return values, [(i + 0.5) / n for i in range(n)]
    pairs = sorted(zip(dist.get("values", []), dist.get("quantiles", []), strict=False))
    kept = [(v, q) for v, q in pairs if v and v > 0 and 0 < q < 1]
    return [v for v, _ in kept], [q for _, q in kept]


def _wrap(name: str) -> str:
    return name.replace("-", "\n", 2) if len(name) > 14 else name
