"""The category of each request's outcome (`classify`: one of ACCEPTABLE_CATEGORIES or
"unexpected"; the package docstring says when each applies), and the request totals
(`summarize`: counts, the unexpected ones, the mix, latency percentiles of the `ok` ones)."""

from __future__ import annotations

from typing import Any

from bench.harness.stats import percentile

# The proxy's own error codes (docs/protocol.md, "Error bodies"): a 5xx carrying one of these did not come
# from an instance.
PROXY_ERROR_CODES = frozenset({
    "invalid_json", "invalid_request_payload", "payload_too_large", "no_instance", "queue_full",
    "queue_timeout", "upstream_unavailable", "upstream_failed", "upstream_timeout",
    "internal_error"})
ACCEPTABLE_CATEGORIES = ("ok", "client_cancelled", "expected_worker_kill", "expected_flap")


def _overlaps(rec: dict[str, Any], start: float, end: float, slack: float = 0.5) -> bool:
    return rec["t_start"] <= end + slack and rec["t_end"] >= start - slack


def classify(rec: dict[str, Any], kills: list[dict[str, Any]], fail_windows: list[tuple[float, float]],
             restart_windows: list[tuple[float, float]], flapper_id: str, kill_grace_s: float) -> str:
    """One of ACCEPTABLE_CATEGORIES, or "unexpected" (package docstring)."""
    outcome = rec["outcome"]
    if outcome == "ok":
        return "ok"
    if outcome.startswith("client_cancelled"):
        return "client_cancelled"
    # A worker SIGKILLed mid-request: the connection resets (before or after the head).
    broken = outcome.startswith("conn_error") or outcome == "stream_truncated"
    if broken:
        for kill in kills:
            if rec.get("worker_pid") == kill["pid"] and rec["t_end"] >= kill["t"] - 0.1:
                return "expected_worker_kill"
            if rec.get("worker_pid") is None and rec["t_start"] <= kill["t"] + kill_grace_s \
                    and rec["t_end"] >= kill["t"] - 0.1:
                return "expected_worker_kill"
    if rec.get("instance") == flapper_id:
        status, code = rec.get("status"), rec.get("error_code")
        if status == 503 and code not in PROXY_ERROR_CODES \
                and any(_overlaps(rec, a, b) for a, b in fail_windows):
            return "expected_flap"
        restarting = any(_overlaps(rec, a, b) for a, b in restart_windows)
        if restarting and (outcome == "stream_truncated"
                           or (status == 502 and code in ("upstream_unavailable", "upstream_failed"))):
            return "expected_flap"
    return "unexpected"


def _ms(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"count": len(values), "p50_ms": round(1000 * percentile(values, 0.50), 1),
            "p99_ms": round(1000 * percentile(values, 0.99), 1), "max_ms": round(1000 * max(values), 1)}


def summarize(records: list[dict[str, Any]], *, kills: list[dict[str, Any]],
              fail_windows: list[tuple[float, float]], restart_windows: list[tuple[float, float]],
              flapper_id: str, kill_grace_s: float, duration_s: float,
              worker_index_by_pid: dict[int, int]) -> dict[str, Any]:
    """The `requests` part of the report; sets each record's `category`."""
    outcomes: dict[str, int] = {}
    categories: dict[str, int] = {c: 0 for c in (*ACCEPTABLE_CATEGORIES, "unexpected")}
    unexpected_by_outcome: dict[str, int] = {}
    unexpected_samples: list[dict[str, Any]] = []
    for rec in records:
        outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
        category = classify(rec, kills, fail_windows, restart_windows, flapper_id, kill_grace_s)
        rec["category"] = category
        categories[category] += 1
        if category == "unexpected":
            unexpected_by_outcome[rec["outcome"]] = unexpected_by_outcome.get(rec["outcome"], 0) + 1
            if len(unexpected_samples) < 40:
                unexpected_samples.append({k: (round(v, 3) if isinstance(v, float) else v)
                                           for k, v in rec.items()})
    ok = [r for r in records if r["outcome"] == "ok"]
    by_instance: dict[str, int] = {}
    by_worker_index: dict[str, int] = {}
    for r in ok:
        by_instance[r["instance"]] = by_instance.get(r["instance"], 0) + 1
        w = str(worker_index_by_pid.get(r["worker_pid"], "?"))
        by_worker_index[w] = by_worker_index.get(w, 0) + 1
    five_xx = {k: v for k, v in outcomes.items() if k.startswith("http_5")}
    five_xx_unexpected = sum(1 for r in records
                             if r["category"] == "unexpected" and (r.get("status") or 0) >= 500)
    return {
        "total": len(records),
        "per_second": round(len(records) / duration_s, 1),
        "outcomes": dict(sorted(outcomes.items(), key=lambda kv: -kv[1])),
        "categories": categories,
        "acceptable_categories": list(ACCEPTABLE_CATEGORIES),
        "unexpected_by_outcome": unexpected_by_outcome,
        "unexpected_samples": unexpected_samples,
        "http_5xx": five_xx, "http_5xx_unexpected": five_xx_unexpected,
        "client_cancels_attempted": sum(1 for r in records if r["cancel"]),
        "retried_on_another_instance": sum(1 for r in ok if r.get("retries")),
        "mix": {"stream": sum(1 for r in records if r["stream"]),
                "non_stream": sum(1 for r in records if not r["stream"]),
                "scheduler": sum(1 for r in records if r["shape"] == "scheduler"),
                "openai": sum(1 for r in records if r["shape"] == "openai")},
        "ok_by_instance": by_instance, "ok_by_worker_index": by_worker_index,
        "latency": {
            "all_ok": _ms([r["latency_s"] for r in ok]),
            "stream_ok": _ms([r["latency_s"] for r in ok if r["stream"]]),
            "non_stream_ok": _ms([r["latency_s"] for r in ok if not r["stream"]]),
            "stream_ttft": _ms([r["ttft_s"] for r in ok if r["stream"] and "ttft_s" in r]),
        },
    }
