"""Where each shared prompt lives: the sidecar balances the prompts' homes by their traffic.

kv_aware credits a prompt's home with holding it and charges any other instance the
displacement of its blocks (docs/architecture.md, "Homes"), so a prompt stays at its home until
that queue costs more than moving it. Rendezvous hashing names a home every worker agrees on
without talking, but it balances prompts by count: with a skewed popularity the prompts homed
on one instance can draw most of the requests, and that instance is slower all along (batch
interference the timeline does not see as queue).

The sidecar sees every request's prompt: the PREFIX event that names it carries the prompt's
size in blocks. It keeps a decayed rate of each prompt's blocks (half-life
PROXY_AFFINITY_HOME_HALFLIFE_S) and, once a round, moves a prompt from the instance furthest
above its share of the work (shares by speed: 1 / its learned pace) to the one furthest below,
when the first is above by more than PROXY_AFFINITY_HOME_TOLERANCE and the move brings the
two closer; then again, up to MOVES_A_ROUND moves. Learned paces within SPEED_BAND of each other
count as one speed (speed_classes): identical engines' paces drift apart under uneven load, and
a move on that drift only costs misses. Only moved prompts are published
(shm_schema.homes); every other prompt keeps its rendezvous home, and a prompt whose rate decays
away is forgotten.

Homes also respect each instance's KV cache: the prompts homed on an instance that came back
(FOOTPRINT_REQUESTS) must fit its room (its KV capacity in blocks, less a block for each request
it runs at once). Past it, its engine evicts its own prompts to prefill them again, each one a
miss, however even the work. So a round first moves prompts off an instance past its room (to
one they fit on, the move that leaves the work most even), and a move for the work never takes
an instance past its room: where no single prompt fits, two prompts swap homes.
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
# A prompt takes room in its home's cache once it came back: this many decayed requests. A
# prompt seen once (a one-off conversation) is no home's lasting tenant.
FOOTPRINT_REQUESTS = 2.0
FORGET_BELOW = 0.05  # decayed blocks: a prompt unseen for several half-lives
# A prompt that moved stays this long before it moves for the work again: its move has cost
# its misses, and the next rounds' rates and paces still carry the disturbance of the move (on
# the real-engine bench a prompt moved there and back in two rounds, missing twice each way).
STAY_S = 10.0
# Speeds closer than this ratio are one class. On the real-engine bench two identical engines,
# one drawing two thirds of the requests, learned paces up to ~1.3x apart (batching the profile
# does not model), now and then enough to move a prompt, and each such run lost hits
# (BENCHMARKS.md, the prompt weight runs); an instance half as fast is 2x apart.
SPEED_BAND = 1.5


class Candidate(NamedTuple):
    """An instance a home can be on."""
    where: Where
    instance_id: str
    speed: float  # 1 / pace: work it does in the time the profile predicts for one unit
    kv_capacity_tokens: int = 0  # its KV cache (0: not known)
    slots: int = 0  # requests it runs at once, each holding a block of its own


class _Split(NamedTuple):
    """The homes of one round's candidates and what they weigh on each."""
    homes: dict[int, int]   # prompt key -> candidate index
    load: list[float]       # decayed blocks a candidate's prompts drew
    due: list[float]        # its share of all of them, by speed
    footprint: list[float]  # blocks of the prompts homed there that came back

    def ratio(self, n: int) -> float:
        """Candidate n's work over its share: above 1, more than it is due."""
        return self.load[n] / self.due[n]

    def after(self, source: int, dest: int, shift: float) -> float:
        """The higher of the two ratios once `shift` of work moved from `source` to `dest`."""
        return max((self.load[source] - shift) / self.due[source],
                   (self.load[dest] + shift) / self.due[dest])


class PromptHomes:
    def __init__(self, seg: Segment, halflife_s: float, tolerance: float, block_tokens: int) -> None:
        self._writer = HomeWriter(seg)
        self._block_tokens = block_tokens
        self._decay_per_s = math.log(2) / halflife_s
        self._tolerance = tolerance
        self._rates: dict[int, float] = {}  # prompt key -> decayed blocks
        self._sizes: dict[int, int] = {}    # prompt key -> fewest blocks a request of it named
        self._requests = 0.0                # decayed requests, every prompt
        self._moved: dict[int, Where] = {}  # prompt key -> its home, where not its rendezvous one
        self._settles_at: dict[int, float] = {}  # prompt key -> when it may move for the work again
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
            self._sizes[key] = min(blocks, self._sizes.get(key, blocks))
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
        changed = self._forget(live, now)
        if len(candidates) > 1 and self._requests >= MIN_REQUESTS:
            for _ in range(MOVES_A_ROUND):
                if not self._move_one(candidates, now):
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

    def _forget(self, live: set[Where], now: float) -> bool:
        """Prompts no longer seen, and homes on instances that left; True if a home went."""
        rates = self._rates
        for key in [k for k, rate in rates.items() if rate < FORGET_BELOW]:
            del rates[key]
            self._sizes.pop(key, None)
        gone = [key for key, where in self._moved.items() if key not in rates or where not in live]
        for key in gone:
            del self._moved[key]
        self._settles_at = {key: at for key, at in self._settles_at.items() if at > now}
        return bool(gone)

    def _split(self, candidates: Sequence[Candidate]) -> _Split:
        names = [c.instance_id for c in candidates]
        index_of = {c.where: n for n, c in enumerate(candidates)}
        homes = {key: index_of[self._moved[key]] if key in self._moved else rendezvous_home(key, names)
                 for key in self._rates}
        load = [0.0] * len(candidates)
        footprint = [0.0] * len(candidates)
        for key, n in homes.items():
            load[n] += self._rates[key]
            footprint[n] += self._footprint(key)
        speeds = speed_classes([c.speed for c in candidates])
        total_speed, total = sum(speeds), sum(load)
        return _Split(homes, load, [speed / total_speed * total for speed in speeds], footprint)

    def _room(self, candidate: Candidate) -> float:
        """The prompt blocks the candidate's cache keeps: its capacity less a block a slot."""
        if not candidate.kv_capacity_tokens:
            return math.inf
        return candidate.kv_capacity_tokens // self._block_tokens - candidate.slots

    def _footprint(self, key: int) -> float:
        """The blocks a prompt keeps in its home's cache: its size once it came back (none for
        a prompt adopted from a previous sidecar until a request of it says its size)."""
        size = self._sizes.get(key, 0)
        return size if self._rates[key] >= FOOTPRINT_REQUESTS * size else 0.0

    def _move_one(self, candidates: Sequence[Candidate], now: float) -> bool:
        split = self._split(candidates)
        room = [self._room(c) for c in candidates]
        past = [n for n in range(len(candidates)) if split.footprint[n] > room[n]]
        move = self._relief(split, room, max(past, key=lambda n: split.footprint[n] - room[n])) \
            if past else None
        move = move or self._evening(split, room)
        if move is None:
            return False
        names = [c.instance_id for c in candidates]
        published = {key: candidates[to].where for key, to in move if rendezvous_home(key, names) != to}
        if len(self._moved.keys() | published.keys()) > HOME_ENTRIES:
            return False  # the table is full: the rest keep their homes
        for key, _ in move:
            self._moved.pop(key, None)
            self._settles_at[key] = now + STAY_S
        self._moved.update(published)
        self.stats["moves"] += 1
        return True

    def _relief(self, split: _Split, room: list[float], full: int) -> list[tuple[int, int]] | None:
        """The move off `full`, past its room, to where the prompt fits that leaves the work
        most even; None if no prompt of it fits anywhere."""
        best: tuple[float, int, int] | None = None
        for key, n in split.homes.items():
            size = self._footprint(key)
            if n != full or not size:
                continue
            for to in range(len(room)):
                if to != full and split.footprint[to] + size <= room[to]:
                    worse = split.after(full, to, self._rates[key])
                    if best is None or worse < best[0]:
                        best = (worse, key, to)
        return None if best is None else [(best[1], best[2])]

    def _evening(self, split: _Split, room: list[float]) -> list[tuple[int, int]] | None:
        """The move (or swap of two homes) from the instance furthest above its share of the
        work to the one furthest below that brings them closest, within both rooms; None if the
        work is within the tolerance or nothing brings it closer."""
        count = len(room)
        over = max(range(count), key=split.ratio)
        under = min(range(count), key=split.ratio)
        if split.ratio(over) <= 1.0 + self._tolerance:
            return None
        settled = [key for key in split.homes if key not in self._settles_at]
        mine = [key for key in settled if split.homes[key] == over]
        theirs = [key for key in settled if split.homes[key] == under]
        best: tuple[float, list[tuple[int, int]]] | None = None
        for key in mine:
            for other in (None, *theirs):
                shift = self._rates[key] - (self._rates[other] if other is not None else 0.0)
                grown = self._footprint(key) - (self._footprint(other) if other is not None else 0.0)
                if shift <= 0 or split.footprint[under] + grown > room[under] \
                        or split.footprint[over] - grown > room[over]:
                    continue
                worse = split.after(over, under, shift)
                if worse < split.ratio(over) and (best is None or worse < best[0]):
                    best = (worse, [(key, under)] + ([] if other is None else [(other, over)]))
        return None if best is None else best[1]


def speed_classes(speeds: Sequence[float]) -> list[float]:
    """Each speed as its class's: sorted, a speed within SPEED_BAND of its class's slowest joins
    it, and a class counts at the geometric mean of its members."""
    order = sorted(range(len(speeds)), key=speeds.__getitem__)
    classes: list[list[int]] = []
    for n in order:
        if classes and speeds[n] <= SPEED_BAND * speeds[classes[-1][0]]:
            classes[-1].append(n)
        else:
            classes.append([n])
    result = [0.0] * len(speeds)
    for members in classes:
        mean = math.exp(sum(math.log(speeds[n]) for n in members) / len(members))
        for n in members:
            result[n] = mean
    return result
