"""The hot path's A/B probes (bench/results/hotpath*.json, bench/hotpath.py): one section a file,
a row a contender (medians over the repeats) with the strategy it ran, the settings each side ran
with, the change's paired ratio where a baseline ran beside it, and the ratios to nginx where it
ran."""

from __future__ import annotations

import statistics
from typing import Any

from bench.peers.targets import per_repeat_ratios
from bench.report import blocks
from bench.report.fmt import num, ratio, table

# (scenario, figure, column); a scenario's columns appear when any contender has them.
COLUMNS = (("json_c1", "added_p50_ms", "added p50 c1 JSON (ms)"), ("json_c32", "rps", "req/s c32 JSON"),
           ("json_c32", "cpu_s_per_1k", "CPU s / 1k req c32 JSON"),
           ("stream_c1", "added_p50_ms", "added p50 c1 stream (ms)"), ("stream_c32", "rps", "streams/s c32"),
           ("stream_c32", "cpu_s_per_1k", "CPU s / 1k streams c32"))


def section(data: dict[str, Any], file_name: str) -> str:
    contenders = data.get("contenders") or []
    columns = [(f"{scenario}.{figure}", head) for scenario, figure, head in COLUMNS
               if any(f"{scenario}.{figure}" in (c.get("median") or {}) for c in contenders)]
    parts = [f"## The worker's hot path, A/B: `{file_name}`", *blocks.header_blocks(data, file_name)]
    method = data.get("method") or {}
    settings = [f"{who}: " + ", ".join(f"`{k}={v}`" for k, v in env.items())
                for who, env in (("every proxy", method.get("proxy_env") or {}),
                                 ("the baseline (`base-*`) over that", method.get("base_env") or {})) if env]
    if settings:
        parts.append("Settings: " + "; ".join(settings) + ".")
    if method.get("base_python"):
        parts.append(f"Interpreters: every proxy `{method.get('python')}`, but the baseline (`base-*`) "
                     f"`{method['base_python']}`.")
    rows = [[f"`{c['name']}`", num(c.get("kind")), num(c.get("workers")), num(c.get("strategy")),
             *[num((c.get("median") or {}).get(key)) for key, _ in columns],
             num(sum(r.get("errors", 0) for r in c.get("runs") or []))] for c in contenders]
    parts.append(f"Medians over {num(method.get('repeats'))} repeats of "
                 f"{num(method.get('seconds_per_point'))} s points (`base-*`: the proxy as it was at the `--baseline` commit, in the same run):\n\n"
                 + table(["contender", "kind", "workers", "strategy", *[head for _, head in columns], "errors"], rows))
    parts += [paired for c in contenders if c.get("kind") == "proxy" and not c["name"].startswith("base-")
              if (paired := _paired_cpu(c, contenders))]
    to_nginx = data.get("ratios_to_nginx") or {}
    if to_nginx:
        keys = list(dict.fromkeys(k for values in to_nginx.values() for k in values))
        rows_to_nginx = [[f"`{name}`", *[ratio(v.get(k)) for k in keys]] for name, v in to_nginx.items()]
        parts.append("Ratios to nginx in the same run:\n\n" + table(["contender", *keys], rows_to_nginx))
    parts += [blocks.method(data), blocks.notes(data)]
    return "\n\n".join(p for p in parts if p)


def _paired_cpu(proxy: dict[str, Any], contenders: list[dict[str, Any]]) -> str:
    """The proxy's CPU per request at c32 over its baseline's (`base-<n>w` beside `proxy-<n>w`),
    repeat by repeat: a change smaller than the host's drift between repeats shows here first."""
    base = next((c for c in contenders if c["name"] == "base-" + proxy["name"].removeprefix("proxy-")), None)
    if base is None:
        return ""
    ratios = [r for r in per_repeat_ratios(proxy, base, "json_c32", "cpu_s_per_1k") if r is not None]
    if not ratios:
        return ""
    return (f"`{proxy['name']}` over `{base['name']}`, CPU per request at c32 repeat by repeat: "
            f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}; "
            f"lower in {sum(r < 1 for r in ratios)} of {len(ratios)}).")
