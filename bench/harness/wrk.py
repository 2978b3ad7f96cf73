"""wrk (the C load generator) with a POST Lua script whose done() hook prints a JSON summary,
and one measured point: a wrk run against a contender, its process tree's CPU charged to it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Protocol

from bench.harness.cpu import Charged, charged, per_1k


# Percentiles wrk's done() hook reports, for latency-distribution charts (p in percent).
WRK_PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99)
WRK_DONE_MARK = "WRK_JSON "
_WRK_DONE_LUA = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('%s{"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d,' ..
    '"min_us":%%d,"max_us":%%d,"mean_us":%%.1f,"percentiles_us":[',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout, latency.min, latency.max, latency.mean))
  for i, p in ipairs({%s}) do
    if i > 1 then io.write(",") end
    io.write(string.format("[%%s,%%d]", p, latency:percentile(p)))
  end
  io.write("]}\\n")
end
"""


def wrk_post_script(path: Path, body: str, url_path: str | None = None,
                    headers: dict[str, str] | None = None) -> Path:
    """Write a wrk Lua script that POSTs `body` (JSON text, no single quotes) with `headers`
    besides its content type, and prints the summary, error counts and latency percentiles as
    one JSON line (read by run_wrk)."""
    if "'" in body or "\n" in body:
        raise ValueError("the body must be one line of JSON without single quotes")
    lines = ['wrk.method = "POST"', f"wrk.body = '{body}'",
             *(f'wrk.headers["{name}"] = "{value}"'
               for name, value in {"Content-Type": "application/json", **(headers or {})}.items())]
    if url_path:
        lines.append(f'wrk.path = "{url_path}"')
    percentiles = ",".join(str(p) for p in WRK_PERCENTILES)
    path.write_text("\n".join(lines) + "\n" + _WRK_DONE_LUA % (WRK_DONE_MARK, percentiles))
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float, *, threads: int = 1,
            timeout_s: float = 5.0) -> dict[str, Any]:
    """One `wrk -t<threads> -c<connections> -d<seconds>` run (bounded: killed at seconds + 30).

    Returns requests, rps, p50_ms / p99_ms, errors (socket errors + non-2xx/3xx), error_kinds,
    percentiles_ms ([[percent, ms], ...]) and, when wrk failed, the end of its output."""
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--timeout", f"{timeout_s:g}s", "-s", str(script), url]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=False)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # run() has killed it
        out, code = f"wrk did not finish: {exc}", -1
    return _wrk_result(out, code)


class Target(Charged, Protocol):
    """A contender (bench/harness/contenders.py) as wrk_point sees it: its URL and its CPU."""

    url: str


def wrk_point(contender: Target, script: Path, connections: int, seconds: float) -> dict[str, Any]:
    """run_wrk against the contender's URL, with its CPU over the run (cpu_s, per 1,000
    requests, by role where it has roles) and its RSS after it."""
    result = charged(contender, lambda: run_wrk(contender.url, script, connections, seconds))
    return per_1k(result, result.get("requests"))


def _wrk_result(out: str, code: int) -> dict[str, Any]:
    import json

    line = next((ln for ln in out.splitlines() if ln.startswith(WRK_DONE_MARK)), None)
    if line is None:
        return {"requests": 0, "rps": 0.0, "errors": 0, "wrk_failed": True, "wrk_output": out[-800:]}
    raw = json.loads(line[len(WRK_DONE_MARK):])
    kinds = {k: raw[k] for k in ("connect", "read", "write", "status", "timeout")}
    seconds = raw["duration_us"] / 1e6
    pct = [[p, round(us / 1000, 4)] for p, us in raw["percentiles_us"]]
    by_p = {p: ms for p, ms in pct}
    result: dict[str, Any] = {
        "requests": raw["requests"], "seconds": round(seconds, 3),
        "rps": round(raw["requests"] / seconds, 1) if seconds else 0.0,
        "p50_ms": by_p.get(50), "p99_ms": by_p.get(99), "mean_ms": round(raw["mean_us"] / 1000, 4),
        "max_ms": round(raw["max_us"] / 1000, 4), "errors": sum(kinds.values()),
        "error_kinds": kinds, "percentiles_ms": pct}
    if code != 0:
        result["wrk_output"] = out[-800:]
    return result
