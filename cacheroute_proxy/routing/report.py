"""`/debug/instance_loads`: the same report from every worker and from the control plane.

Everything in it is read from the shared table, so at a quiescent moment every process returns
the same numbers; only `answered_by` differs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.health import slot_health
from shm_schema import InstanceSlot, read_all

from .load_view import LoadView
from .least_load import LeastLoadPolicy

# The 9 per-instance queue fields of the original's row; null means
# unknown, never 0.
QUEUE_FIELDS = ("prepare_queue_depth", "ready_queue_depth", "active_prepare", "active_ready",
                "pending_prefill_count", "active_decode_count", "next_slot_ready_in_ms",
                "prefill_free_in_ms", "predicted_total_backlog_ms")


# kv_aware's part (a worker's, for a request given in the query): instances, their least_load
# totals and inflight in, one object per instance and a summary (the guard's verdict) out.
AffinityReport = Callable[[Sequence[InstanceSlot], list[float | None], list[int | None]],
                          tuple[list[dict[str, Any]], dict[str, Any]]]


def instance_loads(view: LoadView, scorer: LeastLoadPolicy, *, strategy: str, ttl_s: float,
                   answered_by: dict[str, Any], include_dead: bool = True,
                   affinity: AffinityReport | None = None) -> dict[str, Any]:
    snapshot = view.directory.snapshot()
    instances = [i for i in read_all(view.directory.segment) if include_dead or i.alive]
    components = view.components(instances, with_raw=True)
    predicted = view.predicted_source()
    queue_source = "shared_table" if view.mode == "shared" else "unavailable"
    rows = []
    for index, inst in enumerate(instances):
        row: dict[str, Any] = {
            "instance_id": inst.instance_id,
            "address": f"{inst.host}:{inst.port}",
            "slot": inst.slot,
            "slot_generation": inst.generation,
            "is_alive": inst.alive,
            "health": slot_health(inst),
            "inflight": components["inflight"][index],
            "qps_1m": inst.qps_1m,
            "last_seen_ms": inst.last_seen_ms,
        }
        row.update({name: components[name][index] if name in components else None
                    for name in QUEUE_FIELDS})
        row["least_load_score"] = scorer.explain(index, components, view.sources,
                                                 f"{queue_source}; predicted: {predicted}")
        rows.append(row)
    extra: dict[str, Any] = {}
    if affinity is not None:
        per_instance, extra["kv_aware"] = affinity(instances, [r["least_load_score"]["total"] for r in rows],
                                                   components["inflight"])
        for row, part in zip(rows, per_instance):
            row["affinity"] = part
    return {
        "ok": True,
        "ttl_s": ttl_s,
        "generated_at": now_ms(),
        "strategy": strategy,
        "load_view": view.mode,
        "directory_seq": snapshot.seq,
        "answered_by": answered_by,
        "metric_source": {"inflight": view.sources["inflight"], "qps_1m": "instance_heartbeat",
                          "queue_depth": queue_source, "predicted_pressure": predicted},
        "snapshot_age_ms": view.snapshot_age_ms(),
        "instances": rows,
        **extra,
    }
