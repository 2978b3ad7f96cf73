"""The KV the simulated Instance keeps (cacheroute_sim/instance/residency.py): LRU eviction of
knowledge KV by token capacity, the fast acknowledgement of resident ids on
/v1/kv/inject_ready, the cheaper prefill of resident knowledge and cached prompt blocks
(measured by the simulator's own reported prefill time, not wall clock), the resident set in
/sim/stats, and resident_keys in heartbeats with --report-resident."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheroute_sim.instance import timing
from cacheroute_sim.instance.config import Knobs
from cacheroute_sim.instance.residency import PREFIX_BLOCK_CHARS, Residency, block_hashes, tokens_per_id
from cacheroute_sim.instance.stats import Stats
from cacheroute_sim.processes import free_port
from tests.sim_harness import SimProcess, http, running_sim
from tests.test_sim_instance_control_plane import FakeControlPlane

# One parallel test worker runs them all: they share the module's simulated instance and KDN.
pytestmark = pytest.mark.xdist_group(__name__)

# --- units -----------------------------------------------------------------------------------------


def _residency(capacity: int) -> tuple[Residency, Stats, Knobs]:
    stats = Stats()
    return Residency(128.0, stats), stats, Knobs(kv_capacity_tokens=capacity)


def test_eviction_is_least_recently_used_first_by_tokens():
    residency, stats, knobs = _residency(1000)
    for kid in ("a", "b", "c"):
        residency.admit(kid, 300, knobs)
    assert residency.resident(["a"], knobs) == ["a"]  # used: now the most recent
    residency.admit("d", 300, knobs)  # 1200 > 1000: the least recent (b) goes
    assert residency.resident_ids() == ["c", "a", "d"]
    residency.admit("e", 650, knobs)  # c and a go (d was admitted after them)
    assert residency.resident_ids() == ["d", "e"]
    assert (stats.kv_evictions, stats.kv_evicted_tokens_total) == (3, 900)
    # A shrunk capacity (POST /sim/config) evicts on the next look.
    assert residency.snapshot(Knobs(kv_capacity_tokens=700))["knowledge_ids"] == ["e"]


def test_default_capacity_is_the_registered_kv_memory():
    residency = Residency(2.0, Stats())
    assert residency.kv_capacity_tokens(Knobs()) == int(2.0 / timing.KV_GB_PER_TOKEN) == 52493
    assert residency.prefix_capacity_blocks(Knobs(prefix_caching=True)) == 52493 // 16
    assert residency.prefix_capacity_blocks(Knobs()) == 0  # prefix caching off


def test_a_prefill_uses_the_leading_resident_ids_only():
    residency, stats, knobs = _residency(10_000)
    residency.admit("k1", 1000, knobs)
    residency.admit("k3", 500, knobs)
    hit = residency.lookup(["k1", "k2", "k3"], [], 5000, knobs)  # k2 missing ends the prefix
    assert (hit.resident_tokens, hit.cached_tokens) == (1000, 1000)
    assert (stats.kv_resident_hits, stats.kv_resident_misses) == (1, 2)
    assert residency.lookup(["k1"], [], 800, knobs).resident_tokens == 799  # one token computed


def test_block_hashes_chain_on_the_prefix():
    block = "x" * PREFIX_BLOCK_CHARS
    a = block_hashes(block + "y" * PREFIX_BLOCK_CHARS + "partial")
    b = block_hashes(block + "z" * PREFIX_BLOCK_CHARS)
    c = block_hashes("w" * PREFIX_BLOCK_CHARS + "y" * PREFIX_BLOCK_CHARS)
    assert len(a) == len(b) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # the same block after another prefix is another block


def test_prefix_cache_evicts_least_recent_blocks():
    stats = Stats()
    residency = Residency(128.0, stats)
    knobs = Knobs(prefix_caching=True, prefix_cache_blocks=3)
    first = block_hashes("a" * PREFIX_BLOCK_CHARS * 2)
    second = block_hashes("b" * PREFIX_BLOCK_CHARS * 2)
    residency.remember_prompt(first, knobs)
    residency.remember_prompt(second, knobs)  # 4 blocks > 3: the first prompt's first block goes
    assert residency.lookup([], first, 32, knobs).prefix_hit_tokens == 0  # its head is gone
    assert residency.lookup([], second, 40, knobs).prefix_hit_tokens == 32
    assert (stats.prefix_cache_evictions, stats.prefix_cache_queries, stats.prefix_cache_hits) == (1, 72, 32)


def test_cached_prefill_costs_a_fraction():
    full = timing.prefill_ms(3000)
    assert timing.cached_prefill_ms(3000, 0, 0.1) == full
    cheap = timing.cached_prefill_ms(3000, 2500, 0.1)
    assert cheap == pytest.approx(0.1 * timing.prefill_ms(2500) + timing.prefill_ms(500))
    assert cheap < 0.3 * full


def test_tokens_per_id_shares_the_payload():
    assert tokens_per_id({"payload_bytes": 2_000_000}, ["a", "b"], 1000) == 1000
    assert tokens_per_id({"payload_bytes": 0}, ["a"], 1000) == 0
    assert tokens_per_id({}, ["a"], 1000) == 0


# --- a real simulator and KDN ---------------------------------------------------------------------

# DOC1 1000 tokens, doc3 10, doc4 600, all kv_ready; doc2 text only. 1000 bytes a token.
KNOWLEDGE = [{"id": "DOC1", "content": "d" * 4000, "kv_ready": True},
             {"id": "doc2", "content": "e" * 400, "kv_ready": False},
             {"id": "doc3", "content": "f" * 40, "kv_ready": True},
             {"id": "doc4", "content": "g" * 2400, "kv_ready": True}]
KDN_ARGS = ("--kv-bytes-per-token", "1000", "--bandwidth-mbps", "80", "--link-efficiency", "1",
            "--rtt-ms", "0")


@pytest.fixture(scope="module")
def kdn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    tmp = tmp_path_factory.mktemp("kdn")
    (tmp / "k.json").write_text(json.dumps(KNOWLEDGE))
    with running_sim(tmp / "kdn.log", "--knowledge", str(tmp / "k.json"), *KDN_ARGS,
                     module="cacheroute_sim.kdn") as process:
        yield process


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with running_sim(log, "--no-register", "--time-scale", "0.02", "--instance-id", "sim-r",
                     "--cp-port", str(free_port()), "--kdn-kv-bytes-per-token", "1000",
                     "--kv-capacity-tokens", "1700") as process:
        yield process


@pytest.fixture
def sim(instance: SimProcess) -> Iterator[SimProcess]:
    for path in ("/sim/config/reset", "/sim/kv/clear", "/sim/stats/reset"):
        http("POST", instance.url + path)
    yield instance


def _inject(sim: SimProcess, kdn: SimProcess, kids: list[str]) -> tuple[int, Any]:
    assert sim.cp_url is not None
    status, _, ack = http("POST", sim.cp_url + "/v1/kv/inject_ready",
                          {"request_id": 1, "kdn_addr": f"127.0.0.1:{kdn.port}", "model": "m",
                           "knowledge_ids": kids})
    return status, ack


def _stats(sim: SimProcess) -> dict[str, Any]:
    return http("GET", sim.url + "/sim/stats")[2]


def _kdn_injects(kdn: SimProcess) -> int:
    return http("GET", kdn.url + "/sim/stats")[2]["injects"]


def _complete(sim: SimProcess, prompt: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One one-token completion; the simulator's own record of its prefill."""
    import urllib.request
    req = urllib.request.Request(sim.url + "/v1/completions", method="POST",
                                 headers={"content-type": "application/json", **(headers or {})},
                                 data=json.dumps({"prompt": prompt, "max_tokens": 1}).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        r.read()
    return _stats(sim)["last_prefill"]


def test_a_resident_id_is_acknowledged_at_once_without_the_kdn(sim, kdn):
    status, first = _inject(sim, kdn, ["DOC1"])
    assert status == 200 and first["injected_kids"] == ["doc1"] and "resident_kids" not in first
    pulls = _kdn_injects(kdn)
    status, again = _inject(sim, kdn, ["doc1"])
    assert status == 200 and _kdn_injects(kdn) == pulls  # the KDN was not asked
    assert again == {"ok": True, "injected_kids": ["doc1"], "text_only_kids": [], "miss_kids": [],
                     "keys_injected": 0, "payload_bytes": 0, "payload_files": 0,
                     "network_sim_enabled": False, "resident_kids": ["doc1"], "detail": "resident"}
    # Partly resident: only doc3 is asked of the KDN; the answer names both, doc1 as resident.
    status, mixed = _inject(sim, kdn, ["doc1", "doc3"])
    assert status == 200 and _kdn_injects(kdn) == pulls + 1
    assert (mixed["injected_kids"], mixed["resident_kids"], mixed["payload_bytes"]) == (
        ["doc1", "doc3"], ["doc1"], 10 * 1000)
    stats = _stats(sim)
    assert (stats["kv_injects"], stats["kv_inject_fast_acks"], stats["kv_inject_resident_ids"],
            stats["kv_inject_pulled_ids"]) == (3, 1, 2, 2)
    assert stats["residency"] == {"kv_capacity_tokens": 1700, "kv_resident_tokens": 1010,
                                  "knowledge_ids": ["doc1", "doc3"],
                                  "prefix_cache_capacity_blocks": 0, "prefix_cache_blocks": 0,
                                  "prefix_block_tokens": 16}


def test_injects_past_the_capacity_evict_the_least_recent(sim, kdn):
    for kids in (["doc1"], ["doc3"]):
        assert _inject(sim, kdn, kids)[0] == 200
    assert _inject(sim, kdn, ["doc1"])[1]["detail"] == "resident"  # doc1 is now the most recent
    assert _inject(sim, kdn, ["doc4"])[0] == 200  # 1000 + 10 + 600 = 1610: all fit
    http("POST", sim.url + "/sim/config", {"kv_capacity_tokens": 1605})
    stats = _stats(sim)  # the shrunk capacity drops the least recent: doc3
    assert stats["residency"]["knowledge_ids"] == ["doc1", "doc4"]
    assert (stats["kv_evictions"], stats["kv_evicted_tokens_total"]) == (1, 10)
    pulls = _kdn_injects(kdn)
    assert "resident_kids" not in _inject(sim, kdn, ["doc3"])[1]  # gone: pulled again
    assert _kdn_injects(kdn) == pulls + 1
    assert _stats(sim)["residency"]["knowledge_ids"] == ["doc4", "doc3"]  # doc1 evicted for it


def test_resident_knowledge_is_prefilled_at_a_fraction(sim, kdn):
    prompt = "d" * 4000 + "\nWhat is it?"  # the context as the proxy puts it, then the question
    hint = {"x-cacheroute-kv-knowledge-ids": "DOC1"}
    cold = _complete(sim, prompt, hint)  # named, not resident: computed in full
    assert (cold["cached_tokens"], cold["resident_tokens"]) == (0, 0)
    assert cold["ms"] == pytest.approx(timing.prefill_ms(cold["prompt_tokens"]), abs=1e-3)
    assert _inject(sim, kdn, ["doc1"])[0] == 200
    warm = _complete(sim, prompt, hint)
    assert warm["resident_tokens"] == warm["cached_tokens"] == 1000
    assert warm["ms"] == pytest.approx(timing.cached_prefill_ms(warm["prompt_tokens"], 1000, 0.1),
                                       abs=1e-3)
    assert warm["ms"] < 0.4 * cold["ms"]
    stats = _stats(sim)
    assert (stats["kv_resident_hits"], stats["kv_resident_misses"],
            stats["kv_resident_hit_tokens_total"], stats["prefills"]) == (1, 1, 1000, 2)
    assert stats["prefill_ms_total"] == pytest.approx(cold["ms"] + warm["ms"], abs=1e-2)
    # The factor is a knob.
    http("POST", sim.url + "/sim/config", {"cached_prefill_factor": 0.5})
    assert _complete(sim, prompt, hint)["ms"] == pytest.approx(
        timing.cached_prefill_ms(warm["prompt_tokens"], 1000, 0.5), abs=1e-3)


def test_prefix_caching_prefills_a_repeated_prefix_at_a_fraction(sim):
    http("POST", sim.url + "/sim/config", {"prefix_caching": True})
    system = "s" * 2000  # 500 tokens shared: 31 full blocks (496 tokens)
    first = _complete(sim, system + "first question")
    assert first["prefix_hit_tokens"] == 0
    second = _complete(sim, system + "another one!!")
    assert second["prefix_hit_tokens"] == second["cached_tokens"] == 496
    assert second["ms"] == pytest.approx(
        timing.cached_prefill_ms(second["prompt_tokens"], 496, 0.1), abs=1e-3)
    assert second["ms"] < 0.4 * first["ms"]
    stats = _stats(sim)
    assert stats["prefix_cache_hits"] == 496
    assert stats["prefix_cache_queries"] == first["prompt_tokens"] + second["prompt_tokens"]
    assert stats["residency"]["prefix_cache_blocks"] == 31  # both prompts' full blocks are the shared ones
    # Off again: nothing is looked up, the repeated prompt costs its whole prefill.
    http("POST", sim.url + "/sim/config", {"prefix_caching": False})
    assert _complete(sim, system + "another one!!")["cached_tokens"] == 0


@pytest.mark.timeout(30)
def test_report_resident_puts_the_resident_ids_in_heartbeats(tmp_path: Path, kdn):
    with FakeControlPlane(free_port()) as cp, \
            running_sim(tmp_path / "hb.log", "--proxy-cp-url", cp.url, "--heartbeat-interval",
                        "0.1", "--report-resident", "--cp-port", str(free_port()),
                        "--kdn-kv-bytes-per-token", "1000", "--instance-id", "sim-hb") as sim:
        beats = [c for c in cp.wait_for_calls(2) if c["path"] == "/v1/instance/heartbeat"]
        assert beats and beats[0]["body"]["resident_keys"] == []
        for kids in (["doc4"], ["DOC1"]):
            assert _inject(sim, kdn, kids)[0] == 200
        seen = len(cp.calls)
        calls = cp.wait_for_calls(seen + 2)
        last = [c for c in calls[seen:] if c["path"] == "/v1/instance/heartbeat"][-1]
        assert last["body"] == {"instance_id": "sim-hb", "capability_fingerprint": "sha256:fake",
                                "resident_keys": ["doc4", "doc1"]}
    # Without the flag, heartbeats stay as they were (tests/test_sim_instance_control_plane.py).
