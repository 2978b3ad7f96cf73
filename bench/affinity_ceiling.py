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
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

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


def replay(requests: Sequence[Sequence[str]], tokens: dict[str, int], capacity_tokens: int,
           instances: int, choose: Choose, seed: int) -> float:
    """The resident-hit rate of `requests` (each the knowledge ids of one request) routed by
    `choose`."""
    rng = random.Random(seed)
    caches = [LruCache(capacity_tokens) for _ in range(instances)]
    hits = total = 0
    for kids in requests:
        cache = caches[choose(kids, caches, rng)]
        for kid in kids:
            total += 1
            hits += cache.hit(kid, tokens[kid])
    return hits / total if total else 0.0


def ceilings(requests: Sequence[Sequence[str]], tokens: dict[str, int], capacity_tokens: int,
             instances: int) -> dict[str, float]:
    """Both routers' hit rates (means over SEEDS seeds) and their ratio."""
    def mean_of(choose: Choose) -> float:
        return sum(replay(requests, tokens, capacity_tokens, instances, choose, seed)
                   for seed in range(SEEDS)) / SEEDS
    spread, held = mean_of(random_choice), mean_of(holder_first(tokens))
    return {"random": round(spread, 4), "holder_first": round(held, 4),
            "holder_first_over_random": round(held / spread, 3) if spread else 0.0}
