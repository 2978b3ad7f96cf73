"""Instance selection: the policies by name, kv_aware's choice, the original Proxy's validation
plan for least_load, and the LoadView that feeds them from the shared segment."""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest

from cacheroute_proxy.config import ConfigError, Settings
from cacheroute_proxy.routing.load_view import LoadView
from cacheroute_proxy.routing.kv_aware import KvAwarePolicy, Prediction, engines_full
from cacheroute_proxy.routing.least_load import DEFAULT_WEIGHTS, LeastLoadPolicy, resolve_weights
from cacheroute_proxy.routing.registry import build_policy
from cacheroute_proxy.routing.round_robin import RoundRobinPolicy
from proxy_workers.router import Router
from shm_schema import DirectoryWriter, InstanceSlot, WorkerRow
from tests.shm_helpers import fresh_segment

CANDIDATES = ["a", "b", "c", "d"]


def picks(strategy, candidates, components, n):
    return [strategy.select(candidates, components) for _ in range(n)]


# --- factory --------------------------------------------------------------------------------------

@pytest.mark.parametrize("alias, canonical", [
    ("round_robin", "round_robin"), ("round-robin", "round_robin"), ("rr", "round_robin"),
    ("least_load", "least_load"), ("least-load", "least_load"), ("ll", "least_load"),
    (" LL ", "least_load"), ("Round-Robin", "round_robin"),
    ("kv_aware", "kv_aware"), ("kv-aware", "kv_aware"), ("kv", "kv_aware"), ("KV", "kv_aware"),
])
def test_factory_aliases(alias, canonical):
    assert build_policy(alias).name == canonical


@pytest.mark.parametrize("name", ["least_inflight", "random", "", "cache_aware"])
def test_unknown_strategy_is_a_value_error(name):
    with pytest.raises(ValueError, match="unknown instance strategy"):
        build_policy(name)


def test_default_strategy_is_round_robin():
    assert Settings().instance_strategy == "round_robin"
    assert Settings().strategy_name == "round_robin"


# --- kv_aware: the lowest predicted time to first token, within the balance guard ------------------
def _predicted(queue: float | None, prefill: float, transfer: float = 0.0,
               displace: float = 0.0) -> Prediction:
    return Prediction(queue, prefill, transfer, displace)


def test_kv_aware_a_holder_wins_unless_its_queue_costs_more_than_the_prefill_it_saves():
    kv = KvAwarePolicy()
    # The warm instance saves 30 ms of prefill (10 left against 40) and waits 20 ms: 30 < 40.
    warm, cold = _predicted(20.0, 10.0), _predicted(0.0, 40.0)
    chosen, guard = kv.select_by_predictions(["warm", "cold"], lambda: [2.0, 0.0], [2, 0], [warm, cold])
    assert (chosen, guard.fired) == ("warm", False)
    # Its queue grows past the saving: 35 + 10 > 0 + 40.
    chosen, _ = kv.select_by_predictions(["warm", "cold"], lambda: [2.0, 0.0], [2, 0],
                                         [_predicted(35.0, 10.0), cold])
    assert chosen == "cold"
    # A KV transfer counts as prefill does: the holder of the knowledge skips 50 ms of it.
    chosen, _ = kv.select_by_predictions(["holder", "other"], lambda: [1.0, 0.0], [1, 0],
                                         [_predicted(30.0, 20.0, 0.0), _predicted(0.0, 20.0, 50.0)])
    assert chosen == "holder"


def test_kv_aware_asks_for_least_loads_totals_only_where_they_decide():
    asked: list[int] = []

    def totals() -> list[float | None]:
        asked.append(1)
        return [1.0, 0.0]
    kv = KvAwarePolicy(balance_abs=2)
    known = [_predicted(0.0, 10.0), _predicted(0.0, 40.0)]
    assert kv.select_by_predictions(["a", "b"], totals, [1, 0], known)[0] == "a" and asked == []
    # An unknown prediction: least_load's totals choose, the request's own cost breaks ties.
    assert kv.select_by_predictions(["a", "b"], totals, [1, 0], [known[0], _predicted(None, 40.0)])[0] == "b"
    # The guard fires (spread 8 > 2, 9 > 1.5 x 1): least_load's totals choose.
    assert kv.select_by_predictions(["a", "b"], totals, [9, 1], known)[0] == "b" and len(asked) == 2


def test_kv_aware_keeps_a_prompt_at_its_home_unless_the_home_queue_costs_more_than_moving_it():
    """The home is credited with the prompt (prefill 10 of 40); elsewhere its blocks would save
    30 ms there, which they would displace."""
    kv = KvAwarePolicy()
    home = _predicted(0.0, 10.0)
    # A duplicate away from home loses at equal queues: 10 < 10 + 30.
    duplicate = _predicted(0.0, 10.0, displace=30.0)
    assert kv.select_by_predictions(["home", "away"], lambda: [0.0, 0.0], [0, 0],
                                    [home, duplicate])[0] == "home"
    # ...and wins once the home's queue costs more than the displacement: 35 + 10 > 10 + 30.
    assert kv.select_by_predictions(["home", "away"], lambda: [2.0, 0.0], [2, 0],
                                    [_predicted(35.0, 10.0), duplicate])[0] == "away"
    # Moving the prompt to an instance that holds nothing costs its prefill and the displacement:
    # 50 + 10 < 0 + 40 + 30, so the home keeps it; at 65 ms of queue it moves.
    cold = _predicted(0.0, 40.0, displace=30.0)
    assert kv.select_by_predictions(["home", "away"], lambda: [2.0, 0.0], [2, 0],
                                    [_predicted(50.0, 10.0), cold])[0] == "home"
    assert kv.select_by_predictions(["home", "away"], lambda: [2.0, 0.0], [2, 0],
                                    [_predicted(65.0, 10.0), cold])[0] == "away"
    # The trace's TTFT is the time to first token alone.
    assert (cold.total_ms, cold.score_ms()) == (40.0, 70.0)


def test_kv_aware_weighs_the_work_a_choice_adds_as_the_delay_it_causes_those_behind_it():
    """With the work counted twice, moving the prompt costs 2 x (40 + 30) against 2 x 10 at home:
    a home queue of 65 ms keeps it, one over 120 ms moves it."""
    kv = KvAwarePolicy(work_weight=2.0)
    cold = _predicted(0.0, 40.0, displace=30.0)
    assert cold.score_ms(2.0) == 140.0
    for queue, chosen in ((65.0, "home"), (119.0, "home"), (121.0, "away")):
        assert kv.select_by_predictions(["home", "away"], lambda: [2.0, 0.0], [2, 0],
                                        [_predicted(queue, 10.0), cold])[0] == chosen


def test_kv_aware_weighs_a_homed_prompts_work_by_its_own_weight_and_knowledge_by_the_other():
    """Work weight 2, 3 for a prompt with a home (charged displacement away from it): at a home
    queue of 130 ms the prompt stays (3 x (40 + 30) = 210 > 130 + 3 x 10), where at weight 2 it
    would move (140 < 150); a knowledge request, charged no displacement, still counts twice."""
    kv = KvAwarePolicy(work_weight=2.0, prompt_work_weight=3.0)
    cold = _predicted(0.0, 40.0, displace=30.0)
    assert kv.select_by_predictions(["home", "away"], lambda: [2.0, 0.0], [2, 0],
                                    [_predicted(130.0, 10.0), cold])[0] == "home"
    assert KvAwarePolicy(work_weight=2.0).select_by_predictions(
        ["home", "away"], lambda: [2.0, 0.0], [2, 0], [_predicted(130.0, 10.0), cold])[0] == "away"
    # Knowledge: 41 + 2 x 10 = 61 > 0 + 2 x 30 = 60 moves it; 3 x would keep it (71 < 90).
    holder, other = _predicted(41.0, 10.0), _predicted(0.0, 30.0)
    assert kv.select_by_predictions(["holder", "other"], lambda: [1.0, 0.0], [1, 0], [holder, other])[0] == "other"


def test_kv_aware_equal_predictions_rotate():
    kv = KvAwarePolicy()
    same = [_predicted(0.0, 40.0)] * 2
    chosen = {kv.select_by_predictions(["a", "b"], lambda: [0.0, 0.0], [0, 0], same)[0] for _ in range(4)}
    assert chosen == {"a", "b"}


def test_kv_aware_without_a_fresh_snapshot_least_load_chooses_and_the_requests_cost_breaks_ties():
    kv = KvAwarePolicy()
    unknown = [_predicted(None, 40.0), _predicted(None, 10.0), _predicted(None, 5.0)]
    # least_load's totals decide first: c is busier, so the tie between a and b goes to b,
    # which holds more of the request.
    chosen, guard = kv.select_by_predictions(["a", "b", "c"], lambda: [1.0, 1.0, 2.0], [1, 1, 2], unknown)
    assert (chosen, guard.fired) == ("b", False)


def test_an_engine_is_full_at_its_slots_and_unknown_without_them_or_its_inflight():
    def engine(slots: int) -> InstanceSlot:
        return InstanceSlot(0, 1, "i", "127.0.0.1", 1, True, 0, 0, None, max_num_seqs=slots)
    engines = [engine(4), engine(4), engine(0), engine(4)]
    assert engines_full(engines, [4, 3, 9, None]) == [True, False, None, None]
    assert engines_full(engines, [5, 0, 0, 0]) == [True, False, None, False]


def test_kv_aware_guard_fires_only_past_both_bounds_and_then_least_load_chooses():
    kv = KvAwarePolicy(balance_abs=4.0, balance_rel=1.5)
    assert kv.guard([10, 5]).fired  # spread 5 > 4 and 10 > 7.5
    assert not kv.guard([10, 7]).fired  # spread 3 <= 4
    assert not kv.guard([20, 15]).fired  # spread 5 > 4 but 20 <= 22.5
    assert not kv.guard([10, None]).fired  # one known load: nothing to balance
    # The hot instance holds the prompt and is predicted the faster, but the guard fires.
    chosen, guard = kv.select_by_predictions(["hot", "idle"], lambda: [12.0, 5.0], [10, 5],
                                             [_predicted(5.0, 1.0), _predicted(0.0, 40.0)])
    assert (chosen, guard.fired) == ("idle", True) and "least_load" in guard.reason


def test_kv_aware_guard_bounds_a_prompt_with_a_home_by_its_own_spread():
    """Displacement is charged away from a prompt's home: such a request spreads by the prompt
    bound; one charged none (knowledge, a prompt without a home) by balance_abs."""
    kv = KvAwarePolicy(balance_abs=4.0, balance_rel=1.5, prompt_balance_abs=16.0)
    homed = [_predicted(5.0, 1.0), _predicted(0.0, 40.0, displace=30.0)]
    chosen, guard = kv.select_by_predictions(["home", "idle"], lambda: [12.0, 5.0], [10, 5], homed)
    assert (chosen, guard.fired) == ("home", False) and "bound 16" in guard.reason
    chosen, guard = kv.select_by_predictions(["home", "idle"], lambda: [22.0, 5.0], [22, 5], homed)
    assert (chosen, guard.fired) == ("idle", True)  # spread 17 > 16
    knowledge = [_predicted(5.0, 1.0), _predicted(0.0, 1.0, transfer=40.0)]
    chosen, guard = kv.select_by_predictions(["holder", "idle"], lambda: [12.0, 5.0], [10, 5], knowledge)
    assert (chosen, guard.fired) == ("idle", True) and "bound 4" in guard.reason
    assert KvAwarePolicy(balance_abs=4.0).prompt_balance_abs == 4.0  # unset: one bound for all


# --- least_load semantics ------------------------------------------------------------------------

def test_lower_inflight_wins():
    ll = LeastLoadPolicy()
    assert picks(ll, CANDIDATES, {"inflight": [3, 1, 2, 5]}, 5) == ["b"] * 5
    assert ll.select(CANDIDATES, {"inflight": [0, 1, 2, 5]}) == "a"
    assert ll.select(CANDIDATES, {"inflight": [9, 9, 9, 8]}) == "d"


def test_ties_rotate_instead_of_always_picking_the_first():
    ll = LeastLoadPolicy()
    chosen = picks(ll, CANDIDATES, {"inflight": [4, 1, 1, 1]}, 6)
    assert chosen == ["b", "c", "d", "b", "c", "d"]
    assert set(picks(ll, CANDIDATES, {"inflight": [0, 0, 0, 0]}, 8)) == set(CANDIDATES)


def test_ties_use_the_injected_cursor():
    cursor = iter(range(100, 200)).__next__
    ll = LeastLoadPolicy(tie_cursor=cursor)
    assert picks(ll, CANDIDATES, {"inflight": [0, 0, 7, 7]}, 3) == ["a", "b", "a"]


def test_all_unknown_falls_back_to_round_robin():
    ll = LeastLoadPolicy()
    unknown = {"inflight": [None] * 4, "qps_1m": [None] * 4}
    assert picks(ll, CANDIDATES, unknown, 8) == CANDIDATES * 2
    ll = LeastLoadPolicy()
    assert picks(ll, CANDIDATES[:3], None, 3) == ["a", "b", "c"]
    assert picks(ll, CANDIDATES[:3], {}, 3) == ["a", "b", "c"]


def test_unknown_is_not_zero():
    ll = LeastLoadPolicy()
    # a and c are unknown: dropped while b and d are known, even though b/d carry load.
    chosen = picks(ll, CANDIDATES, {"inflight": [None, 7, None, 5]}, 6)
    assert chosen == ["d"] * 6
    assert picks(ll, CANDIDATES, {"inflight": [None, 3, None, 3]}, 4) == ["b", "d", "b", "d"]


def test_zero_weight_excludes_a_component():
    # qps_1m defaults to weight 0: a known qps alone does not make a score.
    ll = LeastLoadPolicy()
    assert ll.totals(2, {"qps_1m": [0.5, 9.0]}) == [None, None]
    assert picks(ll, ["a", "b"], {"qps_1m": [0.5, 9.0]}, 4) == ["a", "b", "a", "b"]
    # Excluding inflight: the decision follows active_prepare alone.
    ll = LeastLoadPolicy({"inflight": 0.0})
    components = {"inflight": [0, 50], "active_prepare": [3, 1]}
    assert ll.select(["a", "b"], components) == "b"
    assert "inflight" not in ll.explain(0, components, {}, "none")["components"]
    # A non-zero qps weight brings it in.
    ll = LeastLoadPolicy({"qps_1m": 2.0})
    assert ll.totals(2, {"inflight": [1, 1], "qps_1m": [0.5, None]}) == [2.0, 1.0]


def test_weighted_sum_of_known_components():
    ll = LeastLoadPolicy()
    components = {"inflight": [2, 1], "prepare_queue_depth": [0, 8], "predicted_total_backlog_ms": [None, 500.0]}
    assert ll.totals(2, components) == [2.0, 1 + 0.25 * 8 + 0.001 * 500]
    assert ll.select(["a", "b"], components) == "a"


def test_empty_candidates_raise_no_instances():
    for strategy in (LeastLoadPolicy(), RoundRobinPolicy()):
        with pytest.raises(RuntimeError) as err:
            strategy.select([], {"inflight": []})
        assert str(err.value) == "no instances"


def test_round_robin_ignores_components():
    rr = RoundRobinPolicy()
    assert picks(rr, CANDIDATES[:3], {"inflight": [0, 100, 100]}, 6) == ["a", "b", "c"] * 2
    shared = iter(range(5, 50)).__next__
    rr = RoundRobinPolicy(shared)
    assert picks(rr, CANDIDATES, None, 3) == ["b", "c", "d"]


def test_explain_returns_the_full_score_object():
    ll = LeastLoadPolicy({"qps_1m": 0.5})
    components = {"inflight": [3, None], "qps_1m": [2.0, 4.0], "ready_queue_depth": [None, 2]}
    sources = {"inflight": "shared_table_inflight", "qps_1m": "instance_heartbeat"}
    score = ll.explain(0, components, sources, "sidecar_snapshot")
    assert set(score) == {"total", "components", "weighted_components", "source",
                          "queue_source", "weights"}
    assert score["total"] == 3 * 1.0 + 2.0 * 0.5
    assert score["components"] == {"inflight": 3, "qps_1m": 2.0}
    assert score["weighted_components"] == {"inflight": 3.0, "qps_1m": 1.0}
    assert score["source"]["inflight"] == "shared_table_inflight"
    assert score["source"]["pending_prefill_count"] == "unavailable"
    assert set(score["source"]) == set(DEFAULT_WEIGHTS)
    assert score["queue_source"] == "sidecar_snapshot"
    assert score["weights"] == {**DEFAULT_WEIGHTS, "qps_1m": 0.5}
    unknown = ll.explain(1, {"inflight": [3, None]}, sources, "none")
    assert unknown["total"] is None and unknown["components"] == {}


def test_weights_validation():
    assert resolve_weights(None) == DEFAULT_WEIGHTS
    assert resolve_weights({"inflight": 2})["inflight"] == 2.0
    with pytest.raises(ConfigError, match="unknown component 'bogus'"):
        resolve_weights({"bogus": 1.0})
    with pytest.raises(ConfigError, match="PROXY_LEAST_LOAD_WEIGHTS"):
        LeastLoadPolicy({"inflight": -1})
    with pytest.raises(ConfigError, match="must be a finite number >= 0"):
        build_policy("ll", weights={"inflight": "heavy"})
    assert isinstance(ConfigError("x"), ValueError)


@pytest.mark.parametrize("weight", [math.nan, math.inf])
def test_non_finite_weight_is_a_config_error(weight):
    with pytest.raises(ConfigError, match="PROXY_LEAST_LOAD_WEIGHTS"):
        resolve_weights({"inflight": weight})


# --- LoadView over a real segment ----------------------------------------------------------------

@pytest.fixture
def table():
    with fresh_segment(instance_capacity=8, worker_capacity=4) as seg:
        writer = DirectoryWriter(seg)
        insts = [writer.allocate(f"inst-{i}", "127.0.0.1", 9000 + i, now_ms=1000 + i) for i in range(3)]
        rows = [WorkerRow.claim(seg, 0), WorkerRow.claim(seg, 1)]
        try:
            yield seg, writer, insts, rows
        finally:
            for row in rows:
                row.release()


def test_shared_view_sees_every_workers_begin(table):
    seg, _, insts, (one, two) = table
    for _ in range(2):
        assert one.begin(insts[0].slot, insts[0].generation)
    for _ in range(3):
        assert two.begin(insts[1].slot, insts[1].generation)
    assert one.begin(insts[1].slot, insts[1].generation)
    view = LoadView(seg, "shared")
    cands = view.candidates()
    assert [c.instance_id for c in cands] == ["inst-0", "inst-1", "inst-2"]
    assert view.inflight(cands) == [2, 4, 0]
    components = view.components(cands)
    assert components["inflight"] == [2, 4, 0] and components["qps_1m"] == [None, None, None]
    # Queue lanes are host-wide counters: known zeros. No sidecar has published a pressure
    # snapshot, so the predicted layer is unknown, not zero.
    assert all(components[name] == [0, 0, 0] for name in
               ("active_ready", "active_prepare", "prepare_queue_depth", "ready_queue_depth"))
    assert all(components[name] == [None, None, None] for name in
               ("pending_prefill_count", "active_decode_count", "predicted_total_backlog_ms"))
    assert view.predicted_source() == "unavailable"
    assert view.sources["inflight"] == "shared_table_inflight"
    assert LeastLoadPolicy().select(cands, view.components(cands)).instance_id == "inst-2"
    assert view.inflight([]) == []


def test_per_worker_view_sees_only_its_own_share(table):
    seg, _, insts, (one, two) = table
    for _ in range(2):
        assert one.begin(insts[0].slot, insts[0].generation)
    for _ in range(3):
        assert two.begin(insts[1].slot, insts[1].generation)
    cands = LoadView(seg).candidates()
    assert LoadView(seg, "per_worker", one).inflight(cands) == [2, 0, 0]
    assert LoadView(seg, "per_worker", two).inflight(cands) == [0, 3, 0]
    assert LoadView(seg, "per_worker", one).sources["inflight"] == "worker_local_counter"
    with pytest.raises(ValueError, match="own row"):
        LoadView(seg, "per_worker")


def test_a_requests_decode_batch_is_the_host_wide_inflight_up_to_the_engines_slots(table):
    seg, writer, insts, (one, two) = table
    engine = writer.allocate("engine", "127.0.0.1", 9200, max_num_seqs=4)
    for row, count in ((one, 3), (two, 3)):  # six in flight on it from two workers
        for _ in range(count):
            assert row.begin(engine.slot, engine.generation)
    assert one.begin(insts[0].slot, insts[0].generation)
    for _ in range(2):
        assert two.begin(insts[0].slot, insts[0].generation)
    shared, now_us = LoadView(seg, "shared"), time.time_ns() // 1000

    def batch(view: LoadView, instance) -> int:
        return view.booking(instance, now_us)[1]
    assert batch(shared, engine) == 4           # its 4 slots, however many wait
    assert batch(shared, insts[0]) == 3          # no known limit: every one in flight
    assert batch(shared, insts[2]) == 1          # none yet: the request alone
    assert LoadView(seg, "per_worker", one).booking(insts[0], now_us) == (None, 1)


def test_reused_slot_reads_as_unknown_in_the_shared_view(table):
    seg, writer, insts, (one, _) = table
    assert one.begin(insts[1].slot, insts[1].generation)
    old = LoadView(seg).candidates()
    writer.free(insts[1].slot)
    replacement = writer.allocate("inst-new", "127.0.0.1", 9100)
    assert replacement.slot == insts[1].slot
    assert LoadView(seg, "shared").inflight(old) == [0, None, 0]
    assert LoadView(seg, "per_worker", one).inflight(old) == [0, 1, 0]  # its own old share
    fresh = LoadView(seg).candidates()
    assert [c.instance_id for c in fresh] == ["inst-0", "inst-2", "inst-new"]
    assert LoadView(seg, "per_worker", one).inflight(fresh) == [0, 0, 0]
    assert LoadView(seg, "shared").inflight(fresh) == [0, 0, 0]


def test_router_least_load_follows_the_shared_table(table):
    seg, _, insts, (one, two) = table
    settings = Settings(instance_strategy="ll", shm_name=seg.name, shm_instance_capacity=8,
                        shm_worker_capacity=4, workers=2)
    router_one, router_two = Router(settings, seg, one), Router(settings, seg, two)
    # Each worker's begin is seen by the other at once: six requests spread 2/2/2.
    leases = [(router_one if i % 2 else router_two).acquire() for i in range(6)]
    assert Counter(lease.instance.instance_id for lease in leases) == \
        {"inst-0": 2, "inst-1": 2, "inst-2": 2}
    for lease in leases:
        assert lease.release()
    rr = Router(Settings(shm_name=seg.name, shm_instance_capacity=8, shm_worker_capacity=4,
                         workers=2), seg, one)
    assert len({rr.choose().instance_id for _ in range(3)}) == 3
