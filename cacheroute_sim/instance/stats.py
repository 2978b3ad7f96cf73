"""Counters the tests read through ``GET /sim/stats``.

Single event loop, so plain integers are enough. Every request received ends in exactly one
of completed / failed / dropped / disconnected (or is still in flight).
"""

from __future__ import annotations

from typing import Any

import msgspec


class Stats(msgspec.Struct, kw_only=True):
    inflight: int = 0      # received and not yet answered in full (queued, active, held)
    active: int = 0        # holding a concurrency slot now
    max_active: int = 0    # high-water mark of active since the last reset
    queued: int = 0        # waiting for a concurrency slot now
    decoding: int = 0      # past prefill, generating tokens now (the ITL batch size)
    held: int = 0          # hung, held or stalled now, waiting for /sim/release
    total: int = 0         # generation requests received (valid ones)
    completed: int = 0
    failed: int = 0        # answered with the fail_status knob
    dropped: int = 0       # connection cut on purpose (drop_after_chunks)
    disconnected: int = 0  # the client went away first
    invalid: int = 0       # rejected with 400
    # KV path (control plane and the x-cacheroute-kv-prefix-tokens hint).
    kv_injects: int = 0              # valid POST /v1/kv/inject_ready calls
    kv_inject_failed: int = 0        # of which the KDN call failed (answered 502)
    kv_prefix_hits: int = 0          # generation requests prefilled with a KV prefix hit
    kv_prefix_tokens_total: int = 0  # prompt tokens those hits skipped
    # The KV kept (residency.py); what is held now is GET /sim/stats' "residency".
    kv_inject_fast_acks: int = 0     # injects answered at once: every id resident already
    kv_inject_resident_ids: int = 0  # ids an inject found resident (not asked of the KDN)
    kv_inject_pulled_ids: int = 0    # ids an inject had the KDN copy in
    kv_resident_hits: int = 0        # ids a prefill found resident (x-cacheroute-kv-knowledge-ids)
    kv_resident_misses: int = 0      # ids a prefill named but had to compute (evicted, never in)
    kv_resident_hit_tokens_total: int = 0  # prompt tokens those hits covered
    kv_evictions: int = 0            # knowledge ids evicted
    kv_evicted_tokens_total: int = 0
    prefix_cache_queries: int = 0    # prompt tokens looked up in the prefix cache (as vLLM counts)
    prefix_cache_hits: int = 0       # of which found cached
    prefix_cache_evictions: int = 0  # blocks evicted
    prefills: int = 0
    prefill_ms_total: float = 0.0    # simulated prefill time, GPU ms before --time-scale
    last_prefill: dict[str, float] = {}  # the last one: prompt, cached, resident, prefix tokens, ms

    def reset(self) -> None:
        """Zero the counters; gauges (active, queued, ...) describe the present and stay."""
        self.total = self.completed = self.failed = self.dropped = 0
        self.disconnected = self.invalid = 0
        self.kv_injects = self.kv_inject_failed = 0
        self.kv_prefix_hits = self.kv_prefix_tokens_total = 0
        self.kv_inject_fast_acks = self.kv_inject_resident_ids = self.kv_inject_pulled_ids = 0
        self.kv_resident_hits = self.kv_resident_misses = self.kv_resident_hit_tokens_total = 0
        self.kv_evictions = self.kv_evicted_tokens_total = 0
        self.prefix_cache_queries = self.prefix_cache_hits = self.prefix_cache_evictions = 0
        self.prefills = 0
        self.prefill_ms_total = 0.0
        self.last_prefill = {}
        self.max_active = self.active

    def snapshot(self, instance_id: str) -> dict[str, Any]:
        return {"instance_id": instance_id, **msgspec.structs.asdict(self)}
