"""The soak's JSON report (`build_report`) and the summary printed at the end
(`summary_lines`)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from bench.harness.results import Run

if TYPE_CHECKING:
    from bench.soak.run import Soak


def build_report(soak: Soak, provenance: Run, outcomes: dict[str, Any], rss: dict[str, Any],
                 checks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cfg, chaos, procs = soak.cfg, soak.chaos, soak.procs
    status = soak.final.snapshot.get("status", {})
    return {
        **provenance.record(),
        "passed": all(c["pass"] for c in checks.values()),
        "failed_checks": [name for name, c in checks.items() if not c["pass"]],
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "setup": {"workers": cfg.workers, "strategy": cfg.strategy,
                  "instances": procs.instance_ids, "flapper": chaos.flapper_id,
                  "sim_time_scale": cfg.time_scale, "shm_name": procs.shm_name,
                  "log_dir": str(soak.run_dir)},
        "requests": outcomes,
        "chaos": {"worker_kills": len(chaos.kills),
                  "flap_503_windows": len(chaos.fail_windows),
                  "flapper_restarts": len(chaos.restart_windows),
                  "flapper_503_answered": sum(chaos.flapper_failed.values()),
                  "flapper_503_seen_by_clients": sum(
                      1 for r in soak.load.records if r.get("instance") == chaos.flapper_id
                      and r.get("status") == 503),
                  "events": sorted(chaos.log, key=lambda e: e["t"])},
        "worker_rss": rss,
        "end_checks": checks,
        "final_status": {k: status.get(k) for k in ("event_channel", "reaper", "workers", "sidecar")},
        "sim_stats": soak.final.snapshot.get("sim_stats"),
        "wall_s": round(time.time() - soak.started_wall, 1),
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    req = report["requests"]
    lat = req["latency"]
    rss = report["worker_rss"]
    verdict = "PASSED" if report["passed"] else "FAILED: " + ", ".join(report["failed_checks"])
    chaos = report["chaos"]
    lines = [
        (f"soak {report['config']['duration_s']:.0f}s: {req['total']} requests "
         f"({req['per_second']}/s), {verdict}"),
        f"  categories: {req['categories']}",
        f"  outcomes:   {req['outcomes']}",
        (f"  latency ok: p50 {lat['all_ok']['p50_ms']} ms, p99 {lat['all_ok']['p99_ms']} ms; "
         f"stream TTFT p50 {lat['stream_ttft']['p50_ms']} ms, p99 {lat['stream_ttft']['p99_ms']} ms"),
        (f"  chaos: {chaos['worker_kills']} worker kills, {chaos['flap_503_windows']} 503 windows, "
         f"{chaos['flapper_restarts']} flapper restarts; the flapper answered "
         f"{chaos['flapper_503_answered']} 503s, clients saw {chaos['flapper_503_seen_by_clients']}"),
        (f"  worker RSS: max growth {rss['max_growth_pct']} % over {rss['reported_lineages']} "
         f"lineages (limit {rss['limit_pct']} %); sidecar {rss['sidecar']}"),
    ]
    for name, check in report["end_checks"].items():
        detail = {k: v for k, v in check.items() if k != "pass" and not isinstance(v, (list, dict))}
        lines.append(f"  [{'ok' if check['pass'] else 'FAIL'}] {name} {detail}")
    return lines
