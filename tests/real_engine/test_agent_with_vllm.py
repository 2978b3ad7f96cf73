"""The instance agent beside a plain vLLM: the proxy learns what the engine says of itself (the
served model, its max_model_len, vLLM's version, its KV capacity) and what the operator told the agent
(max_num_seqs); no KV cache feature is registered (the engine has no KV connector), and the
host's resources arrive."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import Cluster, get, wait_until
from tests.real_engine.engines import MAX_MODEL_LEN, MAX_NUM_SEQS, SERVED_MODEL, VllmEngine

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]


def test_the_agent_registers_what_vllm_says(proxy: Callable[..., Cluster],
                                            healthy_engines: list[VllmEngine]) -> None:
    cluster = proxy(engines=1, workers=1)
    iid = f"vllm-{healthy_engines[0].port}"
    row = next(r for r in get(f"{cluster.cp_url}/v1/instance/list") if r["instance_id"] == iid)
    assert row["capabilities"]["model"]["identifier"] == SERVED_MODEL
    assert row["capabilities"]["runtime"] == {"vllm_version": "0.32.0", "supported_cache_features": []}
    assert row["meta"]["max_model_len"] == MAX_MODEL_LEN and row["meta"]["max_num_seqs"] == MAX_NUM_SEQS
    # VLLM_CPU_KVCACHE_SPACE=1 GiB at 2 layers x 2 KV heads x 64 dims x (K, V) x 4 bytes = 2,048
    # bytes a token: the capacity vllm:cache_config_info states, registered for the affinity index.
    assert row["meta"]["kv_capacity_tokens"] == 1024 ** 3 // 2048
    resources = wait_until(lambda: next((r["resource"] for r in get(f"{cluster.cp_url}/debug/instance_resources")
                                         ["instances"] if r["instance_id"] == iid and r["resource"]), None),
                           15, message="a resource snapshot from the agent")
    assert resources["cpu_util"] is not None and resources["memory_total_mb"] > 0
    assert resources["admission_state"] in ("accepting", "degraded", "rejecting")
