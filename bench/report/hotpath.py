"""The hot path's A/B probes (bench/results/hotpath*.json, bench/hotpath.py): one section a file,
a row a contender (medians over the repeats), the settings each side ran with, and the ratios to
nginx where it ran."""

from __future__ import annotations

from typing import Any

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
    rows = [[f"`{c['name']}`", num(c.get("kind")), num(c.get("workers")),
             *[num((c.get("median") or {}).get(key)) for key, _ in columns],
             num(sum(r.get("errors", 0) for r in c.get("runs") or []))] for c in contenders]
    parts.append(f"Medians over {num(method.get('repeats'))} repeats of "
                 f"{num(method.get('seconds_per_point'))} s points (`base-*`: the proxy as it was at the `--baseline` commit, in the same run):\n\n"
                 + table(["contender", "kind", "workers", *[head for _, head in columns], "errors"], rows))
    to_nginx = data.get("ratios_to_nginx") or {}
    if to_nginx:
        keys = list(dict.fromkeys(k for values in to_nginx.values() for k in values))
        rows_to_nginx = [[f"`{name}`", *[ratio(v.get(k)) for k in keys]] for name, v in to_nginx.items()]
        parts.append("Ratios to nginx in the same run:\n\n" + table(["contender", *keys], rows_to_nginx))
    parts += [blocks.method(data), blocks.notes(data)]
    return "\n\n".join(p for p in parts if p)
