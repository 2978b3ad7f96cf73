"""The sections for bench/results/flow_profile*.json (bench/flow_profile.py): where a plain
request's (or a whole stream's) CPU goes in the running proxy, by layer against the relay floor,
then by function."""

from __future__ import annotations

from typing import Any

from bench.report import blocks
from bench.report.fmt import num, table

FILES = ("flow_profile.json", "flow_profile_stream.json")
PROXY, FLOOR = "proxy-w2-ll", "relay-floor-w2"
TITLES = {"plain": "Where a plain request's CPU goes, in flow, by function",
          "stream": "Where a stream's CPU goes, in flow, by function (a request: one whole stream)"}


def section(data: dict[str, Any], file_name: str) -> str:
    parts = [f"## {TITLES.get(data.get('load') or 'plain', file_name)}", *blocks.header_blocks(data, file_name)]
    points = data.get("points") or {}
    if points:
        parts.append("CPU per request of each role at the unprofiled point (µs, user + system), and the "
                     "req/s of both points (py-spy stops a process for each sample):\n\n" + table(
                         ["contender", "role", "user", "system", "req/s", "req/s profiled"],
                         [[f"`{name}`", role, num(cpu.get("user")), num(cpu.get("system")),
                           num(point["unprofiled"].get("rps")), num(point["profiled"].get("rps"))]
                          for name, point in points.items()
                          for role, cpu in (point["unprofiled"].get("cpu_us_per_request") or {}).items()
                          if cpu.get("user") or cpu.get("system")]))
    profiles = data.get("profiles") or {}
    compared = [name for name in (f"{PROXY} workers", f"{FLOOR} relay") if name in profiles]
    if compared:
        layers = [row["layer"] for row in profiles[compared[0]]["layers"]]
        us = {name: {row["layer"]: row.get("us") for row in profiles[name]["layers"]} for name in compared}
        parts.append("By layer, µs per request:\n\n" + table(
            ["layer", *[f"`{name}`" for name in compared]],
            [[layer, *[num(us[name].get(layer)) for name in compared]] for layer in layers]
            + [["**total**", *[num(round(sum(v or 0 for v in us[name].values()), 1)) for name in compared]]]))
    for name, profile in profiles.items():
        rows = [[f"`{row['function']}`", row["layer"], f"{num(row['share'] * 100)} %", num(row.get("us"))]
                for row in profile.get("functions") or []]
        if rows:
            parts.append(f"`{name}`: the functions taking most of its user time ({num(profile.get('user_samples'))} "
                         "samples):\n\n" + table(["function", "layer", "share of user time", "µs per request"], rows))
    parts.append(blocks.method(data))
    return "\n\n".join(p for p in parts if p)
