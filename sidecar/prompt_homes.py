"""Where each shared prompt lives: the sidecar balances the prompts' homes by their traffic.

kv_aware credits a prompt's home with holding it and charges any other instance the
displacement of its blocks (docs/architecture.md, "Homes"), so a prompt stays at its home until
that queue costs more than moving it. Rendezvous hashing names a home every worker agrees on
without talking, but it balances prompts by count: with a skewed popularity the prompts homed
on one instance can draw most of the requests, and that instance is slower all along (batch
interference the timeline does not see as queue).

The sidecar sees every request's prompt: the PREFIX event that names it carries how many
blocks the request sent. It keeps a decayed rate of each prompt's blocks (half-life
PROXY_AFFINITY_HOME_HALFLIFE_S) and, once a round, moves a prompt from the instance furthest
above its share of the work (shares by speed: 1 / its learned pace) to the one furthest below,
when the first is above by more than PROXY_AFFINITY_HOME_TOLERANCE and the move brings the
two closer; then again, up to MOVES_A_ROUND moves. Only moved prompts are published
(shm_schema.homes); every other prompt keeps its rendezvous home, and a prompt whose rate decays
away is forgotten.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

from cacheroute_proxy.affinity_keys import rendezvous_home
from shm_schema import Segment
from shm_schema.events import Event, residency
from shm_schema.homes import HOME_ENTRIES, HomeWriter

Where = tuple[int, int]  # (slot, generation)
ROUND_S = 1.0
# Moves a round at most: enough to balance a skewed start within a round or two (the first
# requests of each prompt miss wherever it is homed), few enough that one round's rates,
# still noisy, cannot shuffle every home.
MOVES_A_ROUND = 4
# Decayed requests (all prompts) before the first move: fewer say little about popularity.
MIN_REQUESTS = 32.0
FORGET_BELOW = 0.05  # decayed blocks: a prompt unseen for several half-lives


class Candidate(NamedTuple):
    """An instance a home can be on."""
    where: Where
    instance_id: str
    speed: float  # 1 / pace: work it does in the time the profile predicts for one unit


class PromptHomes:
    def __init__(self, seg: Segment, halflife_s: float, tolerance: float) -> None:
        self._writer = HomeWriter(seg)
        self._decay_per_s = math.log(2) / halflife_s
        self._tolerance = tolerance
        self._rates: dict[int, float] = {}  # prompt key -> decayed blocks
        self._requests = 0.0                # decayed requests, every prompt
        self._moved: dict[int, Where] = {}  # prompt key -> its home, where not its rendezvous one
        self._decayed_at: float | None = None
        self._next_round = 0.0
        self.stats = {"moves": 0, "published": 0}

    def adopt(self) -> int:
        """A restarted sidecar keeps the homes the previous one published, each prompt at the
        rate of one block: forgotten after several half-lives unless its requests come again."""
        self._moved = self._writer.read()
        self._rates = dict.fromkeys(self._moved, 1.0)
        return len(self._moved)

    def observe(self, event: Event) -> None:
        """A PREFIX event; the one that names its prompt counts toward the prompt's rate."""
        blocks = event.request_key
        if blocks:
            key = residency(event).key_0
            self._rates[key] = self._rates.get(key, 0.0) + blocks
            self._requests += 1.0

    def tick(self, now: float, candidates_now: Callable[[], Sequence[Candidate]]) -> None:
        """A round, once ROUND_S has passed since the last: decay, forget, move prompts one at
        a time while a move brings the work closer to the shares (at most MOVES_A_ROUND)."""
        if now < self._next_round:
            return
        self._next_round = now + ROUND_S
        self._decay(now)
        candidates = candidates_now()
        live = {c.where for c in candidates}
        changed = self._forget(live)
        if len(candidates) > 1 and self._requests >= MIN_REQUESTS:
            for _ in range(MOVES_A_ROUND):
                if not self._move_one(candidates):
                    break
                changed = True
        if changed:
            self._writer.publish(self._moved)
            self.stats["published"] += 1

    def describe(self) -> dict[str, Any]:
        return {**self.stats, "prompts": len(self._rates), "moved": len(self._moved),
                "requests_decayed": round(self._requests, 1)}

    # --- a round ------------------------------------------------------------------------------
    def _decay(self, now: float) -> None:
        if self._decayed_at is not None:
            factor = math.exp(-self._decay_per_s * (now - self._decayed_at))
            self._rates = {key: rate * factor for key, rate in self._rates.items()}
            self._requests *= factor
        self._decayed_at = now

    def _forget(self, live: set[Where]) -> bool:
        """Prompts no longer seen, and homes on instances that left; True if a home went."""
        rates = self._rates
        for key in [k for k, rate in rates.items() if rate < FORGET_BELOW]:
            del rates[key]
        gone = [key for key, where in self._moved.items() if key not in rates or where not in live]
        for key in gone:
            del self._moved[key]
        return bool(gone)

    def _homes(self, candidates: Sequence[Candidate], names: list[str]) -> dict[int, int]:
        """Each prompt's home, as an index into `candidates` (whose ids are `names`)."""
        index_of = {c.where: n for n, c in enumerate(candidates)}
        return {key: index_of[self._moved[key]] if key in self._moved else rendezvous_home(key, names)
                for key in self._rates}

    def _move_one(self, candidates: Sequence[Candidate]) -> bool:
        names = [c.instance_id for c in candidates]
        homes = self._homes(candidates, names)
        load = [0.0] * len(candidates)
        for key, n in homes.items():
            load[n] += self._rates[key]
        total_speed, total = sum(c.speed for c in candidates), sum(load)
        due = [c.speed / total_speed * total for c in candidates]  # each one's share of the work
        ratio = [load[n] / due[n] for n in range(len(candidates))]
        over = max(range(len(candidates)), key=ratio.__getitem__)
        under = min(range(len(candidates)), key=ratio.__getitem__)
        if ratio[over] <= 1.0 + self._tolerance:
            return False
        best: tuple[float, int] | None = None
        for key, n in homes.items():
            if n == over:
                rate = self._rates[key]
                worse = max((load[over] - rate) / due[over], (load[under] + rate) / due[under])
                if worse < ratio[over] and (best is None or worse < best[0]):
                    best = (worse, key)
        if best is None:
            return False
        key = best[1]
        if rendezvous_home(key, names) == under:
            self._moved.pop(key, None)
        elif len(self._moved) < HOME_ENTRIES or key in self._moved:
            self._moved[key] = candidates[under].where
        else:
            return False
        self.stats["moves"] += 1
        return True
