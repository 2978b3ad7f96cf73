"""bench/bench_affinity_vllm.py's pure parts (workload, /metrics counters, aggregation) and its
report section, without engines."""

from __future__ import annotations

from collections import Counter

import pytest

from bench import bench_affinity_vllm as bench
from bench.report import affinity_vllm

METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 6400.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 3840.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 99.0
"""


def test_the_workload_is_seeded_zipf_popular_and_every_user_turn_distinct():
    planned = bench.plan(3, 45.0, 4.0)
    assert planned == bench.plan(3, 45.0, 4.0) != bench.plan(4, 45.0, 4.0)
    assert 120 < len(planned) < 240 and all(0 < p.at_s < 45.0 for p in planned)
    assert len({p.question for p in planned}) == len(planned)
    popular = Counter(p.system for p in planned).most_common()
    assert popular[0][1] > 4 * popular[-1][1]  # a head and a tail


def test_system_prompts_span_several_engine_blocks_and_differ_from_the_first():
    prompts = [bench.system_prompt(i) for i in range(bench.SYSTEM_PROMPTS)]
    assert len(set(prompts)) == len(prompts)
    assert len({p[:40] for p in prompts}) == len(prompts)  # they differ in the first KV block
    # ~1.5 characters a token with this tokenizer: 900 characters are 4+ blocks of 128 tokens,
    # and with a user turn and 8 tokens out well inside max_model_len 1024.
    assert all(len(p) == 900 for p in prompts)
    body = bench.body_of(bench.plan(1, 5.0, 4.0)[0])
    assert body["stream"] and body["max_tokens"] == bench.MAX_TOKENS
    assert [m["role"] for m in body["messages"]] == ["system", "user"]


def test_prefix_counters_read_the_totals_not_the_created_or_external_series():
    assert bench.prefix_counters(METRICS) == {"hits": 3840.0, "queries": 6400.0}
    with pytest.raises(RuntimeError, match="prefix_cache_hits_total"):
        bench.prefix_counters(METRICS.replace("vllm:prefix_cache_hits_total", "vllm:other"))


def test_hit_rate_is_the_counters_difference_over_both_engines():
    before = [{"hits": 100.0, "queries": 1000.0}, {"hits": 0.0, "queries": 0.0}]
    after = [{"hits": 700.0, "queries": 2000.0}, {"hits": 200.0, "queries": 1000.0}]
    rate = bench.hit_rate(before, after)
    assert rate["prefix_cache_hit_rate"] == round(800 / 2000, 4)
    assert [e["hit_rate"] for e in rate["per_engine"]] == [0.6, 0.2]


def _run(contender: str, hits: float, p50: float) -> dict:
    return {"contender": contender, "requests": 10, "ok": 10, "prefix_cache_hits": hits,
            "prefix_cache_queries": 1000.0, "prefix_cache_hit_rate": hits / 1000, "per_engine": [],
            "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "share": {"vllm-0": 6, "vllm-1": 4},
            "guard_fired": 1 if contender == "kv_aware" else 0,
            "guard_decisions": 10 if contender == "kv_aware" else 0, "credited": 3}


def test_runs_alternate_abba_and_aggregate_per_contender():
    assert bench.schedule(2) == ["kv_aware", "least_load", "least_load", "kv_aware"]
    three = bench.contenders(0.2)
    assert [c.name for c in bench.schedule(2, three)] == [
        "kv_aware", "least_load", "kv_aware credit_per_ms=0.2", "kv_aware credit_per_ms=0.2", "least_load", "kv_aware"]
    assert three[2].strategy == "kv_aware" and dict(three[2].env) == {"PROXY_KV_AWARE_CREDIT_PER_MS": "0.2"}
    assert [c.name for c in bench.contenders(None)] == ["kv_aware", "least_load"]
    publishing = [type("Engine", (), {"kv_events_endpoint": f"ipc:///tmp/kv-{i}"}) for i in range(2)]
    events = bench.contenders(None, publishing)[2]
    assert events.name == bench.ENGINE_EVENTS and events.strategy == "kv_aware"
    assert dict(events.env)["PROXY_KV_EVENTS"] == "vllm-0=ipc:///tmp/kv-0,vllm-1=ipc:///tmp/kv-1"
    assert dict(events.env)["PROXY_AFFINITY_BLOCK_TOKENS"] == "128"
    runs = [_run("kv_aware", 600, 50), _run("least_load", 300, 80), _run("least_load", 400, 90),
            _run("kv_aware", 700, 60)]
    rows = {r["contender"]: r for r in bench.aggregate(runs)}
    assert rows["kv_aware"]["prefix_cache_hit_rate"] == 0.65 and rows["least_load"]["prefix_cache_hit_rate"] == 0.35
    assert rows["kv_aware"]["ttft_p50_ms"] == 55 and rows["kv_aware"]["share"] == {"vllm-0": 12, "vllm-1": 8}
    text = affinity_vllm.section({"results": list(rows.values()), "runs": runs, "engine": {}})
    assert "65%" in text and "kv_aware's is 1.86× least_load's" in text and "2 of 20" in text
