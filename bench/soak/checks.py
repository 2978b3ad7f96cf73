"""The end: once the load has stopped, wait for the counters to settle (`settle`: every queue
lane zero everywhere, the event channel drained; at most `quiesce_timeout_s`), keep that final
snapshot, and judge the end invariants against it (`end_checks`, `clean_stop`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.soak.config import SoakConfig
from bench.soak.monitor import Lineage
from bench.soak.processes import SoakProcesses

QUEUE_LANES = ("inflight", "active_prepare", "active_ready", "prepare_queue_depth",
               "ready_queue_depth")


@dataclass
class FinalState:
    # {"loads": {source: /debug/instance_loads}, "status": /debug/status, "health": {i: /healthz},
    #  "sim_stats": {instance id: /sim/stats}}
    snapshot: dict[str, Any] = field(default_factory=dict)
    quiesced_after_s: float | None = None  # None: never settled within quiesce_timeout_s


async def _snapshot(procs: SoakProcesses, workers: int) -> dict[str, Any]:
    sources = {"control_plane": procs.cp_url,
               **{f"worker{i}": procs.worker_url(i) for i in range(workers)}}
    loads = {}
    for name, base in sources.items():
        loads[name] = await procs.get(f"{base}/debug/instance_loads")
    health = {i: await procs.get(f"{procs.worker_url(i)}/healthz") for i in range(workers)}
    status = await procs.get(f"{procs.cp_url}/debug/status")
    return {"loads": loads, "status": status, "health": health}


def _settled(snap: dict[str, Any]) -> bool:
    ch = snap["status"]["event_channel"]
    lanes_zero = all(row.get(lane) == 0 for loads in snap["loads"].values()
                     for row in loads["instances"] for lane in QUEUE_LANES)
    return lanes_zero and ch["pending_reservations"] == 0 and ch["decoding"] == 0


async def settle(cfg: SoakConfig, procs: SoakProcesses, errors: list[str]) -> FinalState:
    """Snapshots every 0.5 s until one is settled (and at least 1 s has passed) or the time is
    up; the last one, with every instance's `/sim/stats`."""
    final = FinalState()
    t_quiet = time.monotonic()
    deadline = t_quiet + cfg.quiesce_timeout_s
    snap: dict[str, Any] = {}
    while True:
        try:
            snap = await _snapshot(procs, cfg.workers)
            if _settled(snap) and time.monotonic() - t_quiet >= 1.0:
                final.quiesced_after_s = round(time.monotonic() - t_quiet, 2)
                break
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            errors.append(f"quiesce snapshot: {exc!r}")
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    if not snap:
        snap = await _snapshot(procs, cfg.workers)
    final.snapshot = snap
    stats = {}
    for i, inst_id in enumerate(procs.instance_ids):
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            stats[inst_id] = await procs.get(f"{procs.instance_url(i)}/sim/stats")
    final.snapshot["sim_stats"] = stats
    return final


def end_checks(cfg: SoakConfig, final: FinalState, *, instance_ids: list[str],
               lineages: dict[tuple[int, int], Lineage], sidecar_pids: set[int],
               kills: list[dict[str, Any]], errors: list[str],
               outcomes: dict[str, Any], rss: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each invariant: {"pass": bool, and what it was judged on}."""
    snap = final.snapshot
    status = snap.get("status", {})
    ch = status.get("event_channel", {})
    nonzero = []
    for source, loads in snap.get("loads", {}).items():
        for row in loads["instances"]:
            bad = {lane: row.get(lane) for lane in QUEUE_LANES if row.get(lane) != 0}
            if bad:
                nonzero.append({"source": source, "instance": row["instance_id"],
                                "alive": row["is_alive"], **bad})
    alive_ids = sorted(r["instance_id"] for r in snap.get("loads", {}).get("control_plane", {})
                       .get("instances", []) if r["is_alive"])
    workers_alive = [w for w in status.get("workers", []) if w["alive"]]
    health_pids = sorted(h["pid"] for h in snap.get("health", {}).values())
    dropped_rows = {f"w{w['worker_index']}-pid{w['pid']}": w["events_dropped"]
                    for w in status.get("workers", [])}
    dropped_lineages = {f"w{l.worker_index}-pid{l.pid}": l.events_dropped_max
                        for l in lineages.values() if l.events_dropped_max}
    checks: dict[str, dict[str, Any]] = {
        "inflight_and_lanes_zero_everywhere": {
            "pass": not nonzero and bool(snap.get("loads")),
            "sources": sorted(snap.get("loads", {})), "lanes": list(QUEUE_LANES),
            "nonzero": nonzero, "quiesced_after_s": final.quiesced_after_s},
        "every_instance_alive": {"pass": alive_ids == sorted(instance_ids), "alive": alive_ids},
        "no_event_dropped": {
            "pass": ch.get("events_dropped_by_workers") == 0 and not any(dropped_rows.values())
            and not dropped_lineages,
            "events_dropped_by_workers": ch.get("events_dropped_by_workers"),
            "workers_events_dropped": dropped_rows,
            "dropped_by_any_lineage_while_alive": dropped_lineages},
        "timelines_drained": {
            "pass": ch.get("pending_reservations") == 0 and ch.get("decoding") == 0,
            "pending_reservations": ch.get("pending_reservations"), "decoding": ch.get("decoding"),
            "expired_reservations": ch.get("expired_reservations"),
            "events_consumed": ch.get("events_consumed"),
            "events_from_previous_epoch": ch.get("events_from_previous_epoch")},
        "reaper": {
            "pass": status.get("reaper", {}).get("reaped", 0) >= len(kills)
            and all(k.get("reaped") and k.get("new_pid") for k in kills),
            "corrections": status.get("reaper", {}).get("corrections"),
            "reaped": status.get("reaper", {}).get("reaped"),
            "subtracted": status.get("reaper", {}).get("subtracted"),
            "kills": len(kills)},
        "workers_all_alive": {
            "pass": len(workers_alive) == cfg.workers
            and sorted(w["pid"] for w in workers_alive) == health_pids,
            "alive_rows": len(workers_alive), "rows": len(status.get("workers", []))},
        "sidecar_never_restarted": {"pass": len(sidecar_pids) == 1,
                                    "pids": sorted(sidecar_pids)},
        "no_unexpected_outcome": {"pass": outcomes["categories"]["unexpected"] == 0,
                                  "unexpected": outcomes["categories"]["unexpected"],
                                  "by_outcome": outcomes["unexpected_by_outcome"]},
        "chaos_ran_cleanly": {"pass": not errors, "errors": errors[:20]},
    }
    if cfg.check_rss:
        checks["worker_rss_growth_under_limit"] = {
            "pass": rss["max_growth_pct"] is not None
            and rss["max_growth_pct"] < cfg.rss_growth_limit_pct,
            "max_growth_pct": rss["max_growth_pct"], "limit_pct": cfg.rss_growth_limit_pct,
            "reported_lineages": rss["reported_lineages"]}
    return checks


def clean_stop(stop_result: dict[str, Any]) -> dict[str, Any]:
    """Everything stopped: the segment removed, no worker left, the supervisor exited 0."""
    return {"pass": bool(stop_result.get("segment_removed"))
            and not stop_result.get("supervisor_children_left")
            and stop_result.get("exit_codes", {}).get("supervisor") == 0,
            **stop_result}
