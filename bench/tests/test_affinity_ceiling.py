"""The offline replay behind bench_affinity's ceiling line."""

from __future__ import annotations

import random

from bench.affinity_ceiling import LruCache, ceilings, holder_first, random_choice, replay


def test_the_cache_evicts_the_least_recent_until_what_it_holds_fits():
    cache = LruCache(300)
    assert [cache.hit(k, 100) for k in ("a", "b", "c", "a", "d")] == [False, False, False, True, False]
    assert list(cache.held) == ["c", "a", "d"] and cache.used == 300  # b went, the least recent
    assert cache.hit("big", 250) is False and list(cache.held) == ["big"]


def test_holding_first_keeps_repeated_ids_where_they_are_and_random_spreads_them():
    tokens = {f"k{i}": 100 for i in range(6)}
    requests = [(f"k{i % 6}",) for i in range(600)]
    # Two ids fit an instance: holder_first settles the six ids two to an instance after a few misses.
    assert replay(requests, tokens, 200, 3, random_choice, seed=1).hit_rate < 0.5
    assert replay(requests, tokens, 200, 3, holder_first(tokens), seed=1).hit_rate > 0.95
    result = ceilings(requests, tokens, 200, 3)
    assert result["holder_first"] > 0.95 and result["random"] < 0.5
    assert abs(result["holder_first_over_random"] - result["holder_first"] / result["random"]) < 0.01
    # One id a request: a whole hit is a hit.
    assert result["whole_holder_first"] == result["holder_first"]
    assert result["whole_random"] == result["random"]


def test_a_whole_hit_needs_every_id_of_the_request_held_there():
    tokens = {"a": 100, "b": 100, "c": 100}
    # Room for two ids: ("a", "b") twice is a whole hit the second time; then ("a", "c") holds
    # a but not c (a half hit), and c pushes b out, so ("a", "b") holds a only.
    requests = [("a", "b"), ("a", "b"), ("a", "c"), ("a", "b")]
    result = replay(requests, tokens, 200, 1, random_choice, seed=0)
    assert result.whole == 0.25  # the second request alone
    assert result.hit_rate == 4 / 8  # a, b; a; a


def test_holder_first_breaks_ties_at_random_and_picks_the_biggest_holder():
    tokens = {"a": 100, "b": 500}
    caches = [LruCache(1000) for _ in range(3)]
    caches[0].hit("a", 100)
    caches[2].hit("b", 500)
    choose = holder_first(tokens)
    assert choose(("a", "b"), caches, random.Random(0)) == 2
    assert {choose((), caches, random.Random(s)) for s in range(20)} == {0, 1, 2}
