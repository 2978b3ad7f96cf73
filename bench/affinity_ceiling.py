"""What routing alone can do for the resident-hit rate of bench_affinity's workload: the
seeded request sequence replayed offline against per-instance LRU caches of the same token
capacity as the simulated instances, under two routers that ignore load.

- `random`: any instance, uniformly (what load-only routing is to the caches: least_load's and
  round_robin's choices do not look at what an instance holds), averaged over seeds;
- `holder_first`: the instance that already holds the most of the request's knowledge tokens
  (a random one among equals), which is kv_aware with an unbounded credit and no load.

Their ratio is a practical ceiling on what affinity can gain over load-only routing on this
workload: holder_first has all the credit and no load to yield to. It is not a proven optimum
(a router that knew the future could do better).

Each replay also counts the requests whose every id was already held where they went (no
transfer at all): when more than half of them are such under random routing, the median
knowledge request moves no KV under load-only routing either, and affinity can lower its
time to first token only through the queues.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

Choose = Callable[[Sequence[str], list["LruCache"], random.Random], int]
SEEDS = 5


class LruCache:
    """The simulated instance's KV model: ids with their tokens, the least recent evicted
    until what is held fits the capacity."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.held: OrderedDict[str, int] = OrderedDict()
        self.used = 0

    def hit(self, kid: str, tokens: int) -> bool:
        if kid in self.held:
            self.held.move_to_end(kid)
            return True
        self.held[kid] = tokens
        self.used += tokens
        while self.used > self.capacity and self.held:
            self.used -= self.held.popitem(last=False)[1]
        return False


def random_choice(kids: Sequence[str], caches: list[LruCache], rng: random.Random) -> int:
    return rng.randrange(len(caches))


def holder_first(tokens: dict[str, int]) -> Choose:
    def choose(kids: Sequence[str], caches: list[LruCache], rng: random.Random) -> int:
        held = [sum(tokens[k] for k in kids if k in cache.held) for cache in caches]
        best = max(held)
        return rng.choice([i for i, h in enumerate(held) if h == best])
    return choose


class Replayed(NamedTuple):
    hit_rate: float  # of the ids requested, the share already held where their request went
    whole: float     # of the requests, the share whose every id was held there


def replay(requests: Sequence[Sequence[str]], tokens: dict[str, int], capacity_tokens: int,
           instances: int, choose: Choose, seed: int) -> Replayed:
    """`requests` (each the knowledge ids of one request) routed by `choose`."""
    rng = random.Random(seed)
    caches = [LruCache(capacity_tokens) for _ in range(instances)]
    hits = total = whole = 0
    for kids in requests:
        cache = caches[choose(kids, caches, rng)]
        held = sum([cache.hit(kid, tokens[kid]) for kid in kids])
        hits += held
        total += len(kids)
        whole += held == len(kids)
    return Replayed(hits / total if total else 0.0, whole / len(requests) if requests else 0.0)


def ceilings(requests: Sequence[Sequence[str]], tokens: dict[str, int], capacity_tokens: int,
             instances: int) -> dict[str, float]:
    """Both routers' hit rates and shares of whole hits (means over SEEDS seeds), and the ratio
    of the hit rates."""
    def mean_of(choose: Choose) -> Replayed:
        runs = [replay(requests, tokens, capacity_tokens, instances, choose, seed) for seed in range(SEEDS)]
        return Replayed(*(sum(values) / SEEDS for values in zip(*runs)))
    spread, held = mean_of(random_choice), mean_of(holder_first(tokens))
    return {"random": round(spread.hit_rate, 4), "holder_first": round(held.hit_rate, 4),
            "holder_first_over_random": round(held.hit_rate / spread.hit_rate, 3) if spread.hit_rate else 0.0,
            "whole_random": round(spread.whole, 4), "whole_holder_first": round(held.whole, 4)}
