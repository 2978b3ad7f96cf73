"""Where each shared prompt lives: the sidecar places the prompts' homes by their traffic.

kv_aware credits a prompt's home with holding it and charges any other instance the
displacement of its blocks (docs/architecture.md, "Homes"), so a prompt stays at its home until
that queue costs more than moving it. Where the homes are decides how the work splits: with a
skewed popularity, the prompts homed on one instance can draw most of the requests, and that
instance is slower all along (batch interference the timeline does not see as queue).

The sidecar sees every request's prompt: the PREFIX event that names it carries the prompt's
size in blocks and the instance the request went to. It keeps a decayed rate of each prompt's
blocks (half-life PROXY_AFFINITY_HOME_HALFLIFE_S) and each instance's work, the rates of the
prompts homed there.

A prompt's home is where its first request went, and that is the **next home** the sidecar
names (shm_schema.homes), again after every PREFIX event: the instance furthest below its share
of the work (shares by speed: 1 / its learned pace), among those with room for one more prompt.
Hot prompts show up first, so placing each newcomer by the work so far splits the traffic far
closer than a hash of the prompt would, and costs no miss: nothing moves. Then, once a round,
a prompt moves from the instance furthest above its share to the one furthest below, when the
first is above by more than PROXY_AFFINITY_HOME_TOLERANCE and the move brings the two closer;
then again, up to MOVES_A_ROUND moves. Learned paces within SPEED_BAND of each other count as
one speed (speed_classes): identical engines' paces drift apart under uneven load, and a move on
that drift only costs misses. The busiest HOME_ENTRIES homes are published once a round, and
at once when a new prompt's first request went where it does not fit (its home is then the next
home); a prompt the table does not list lives where its requests go, and one whose rate decays
away is forgotten.

Homes also respect each instance's KV cache: the prompts homed on an instance that came back
(FOOTPRINT_REQUESTS) must fit its room (its KV capacity in blocks, less a block for each request
it runs at once). Past it, its engine evicts its own prompts to prefill them again, each one a
miss, however even the work. So a round first moves prompts off an instance past its room (to
one they fit on, the move that leaves the work most even), and a move for the work never takes
an instance past its room: where no single prompt fits, two prompts swap homes.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, NamedTuple, Sequence

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
# Speeds closer than this ratio are one class. On the real-engine bench two identical engines
# learn paces apart (batching the profile does not model): up to ~1.3x with one drawing two
# thirds of the requests, 1.65x three seconds into an evenly split run at 60 % load; each move
# that drift made lost hits (BENCHMARKS.md, the prompt weight runs). An instance half as fast
# is 2x apart.
SPEED_BAND = 1.8


class Candidate(NamedTuple):
    """An instance a home can be on."""
    where: Where
    instance_id: str
    speed: float  # 1 / pace: work it does in the time the profile predicts for one unit
    kv_capacity_tokens: int = 0  # its KV cache (0: not known)
    slots: int = 0  # requests it runs at once, each holding a block of its own


class _Split(NamedTuple):
    """The homes of a round's candidates and what they weigh on each; between rounds, each
    PREFIX event adds its request."""
    index: dict[Where, int]  # candidate -> its index
    homes: dict[int, int]    # prompt key -> candidate index
    load: list[float]        # decayed blocks a candidate's prompts drew
    share: list[float]       # its share of all of them, by speed (the shares add up to 1)
    footprint: list[float]   # blocks of the prompts homed there that came back
    held: list[float]        # blocks of every prompt homed there
    room: list[float]        # the prompt blocks its cache keeps

    def ratio(self, n: int) -> float:
        """Candidate n's work over its share: above 1, more than it is due."""
        total = sum(self.load)
        return self.load[n] / (self.share[n] * total) if total else 0.0

    def after(self, source: int, dest: int, shift: float) -> float:
        """The higher of the two ratios once `shift` of work moved from `source` to `dest`."""
        total = sum(self.load)
        return max((self.load[source] - shift) / (self.share[source] * total),
                   (self.load[dest] + shift) / (self.share[dest] * total))


class PromptHomes:
    def __init__(self, seg: Segment, halflife_s: float, tolerance: float, block_tokens: int) -> None:
        self._writer = HomeWriter(seg)
        self._block_tokens = block_tokens
        self._decay_per_s = math.log(2) / halflife_s
        self._tolerance = tolerance
        self._rates: dict[int, float] = {}  # prompt key -> decayed blocks
        self._sizes: dict[int, int] = {}    # prompt key -> fewest blocks a request of it named
        self._requests = 0.0                # decayed requests, every prompt
        self._homes: dict[int, Where] = {}  # prompt key -> its home
        self._listed: dict[int, Where] = {}  # the homes the table lists (published)
        self._settles_at: dict[int, float] = {}  # prompt key -> when it may move for the work again
        self._decayed_at: float | None = None
        self._next_round = 0.0
        # The last round's candidates and split, which each PREFIX event keeps up to date
        # until the next: the next home is named from them.
        self._candidates: list[Candidate] = []
        self._now: _Split | None = None
        self._next_home: Where | None = None
        self._relist = False  # a home was placed away from its request: list the homes now
        self.stats = {"moves": 0, "published": 0}

    def adopt(self) -> int:
        """A restarted sidecar keeps the homes the previous one published, each prompt at the
        rate of one block: forgotten after several half-lives unless its requests come again."""
        self._homes = self._writer.read()
        self._listed = dict(self._homes)
        self._rates = dict.fromkeys(self._homes, 1.0)
        return len(self._homes)

    def observe(self, event: Event) -> None:
        """A PREFIX event; the one that names its prompt counts toward the prompt's rate, on its
        home (`_place`)."""
        blocks = event.request_key
        if not blocks:
            return
        key = residency(event).key_0
        before = self._homes.get(key)
        home = self._place(key, before, (event.slot, event.generation), blocks)
        rate = self._rates.get(key, 0.0)
        self._rates[key] = rate + blocks
        self._sizes[key] = size = min(blocks, self._sizes.get(key, blocks))
        self._requests += 1.0
        split = self._now
        if split is None:
            return
        if before is not None and before != home and before in split.index:  # it left `before`
            n = split.index[before]
            split.load[n] -= rate
            split.held[n] -= size
        n = split.index.get(home)
        if n is not None:
            split.homes[key] = n
            split.load[n] += blocks if before == home else rate + blocks
            split.held[n] += 0 if before == home else size
        self._name_next_home()

    def _place(self, key: int, home: Where | None, went: Where, blocks: int) -> Where:
        """The prompt's home once a request of it went to `went`. A listed home stays. A new
        prompt's is where its first request went if the prompt fits there (beside the prompts
        homed there, within its room), else the next home: a request spilled, or two new
        prompts took the same next home before the sidecar named another. A prompt the table
        does not list yet follows its requests where it fits. A home not where the request went
        is listed at once, so the workers' requests follow it."""
        if home == went or (home is not None and key in self._listed):
            return home
        split = self._now
        n = None if split is None else split.index.get(went)
        if n is None or split.held[n] + blocks <= split.room[n]:
            placed = went
        else:
            placed = home or self._next_home or went
        self._homes[key] = placed
        self._relist = self._relist or placed != went
        return placed

    def tick(self, now: float, candidates_now: Callable[[], Sequence[Candidate]]) -> None:
        """A round, once ROUND_S has passed since the last: decay, forget, move prompts one at
        a time while a move brings the work closer to the shares (at most MOVES_A_ROUND), name
        the next home, list the homes. Between rounds, list them if a home was placed away
        from its request. While fewer than two candidates were known, a tick that finds two is a
        round: the next home is named before the first requests come."""
        if now < self._next_round and (self._now is not None or len(candidates_now()) < 2):
            if self._relist:
                self._list()
            return
        self._next_round = now + ROUND_S
        self._decay(now)
        candidates = self._candidates = list(candidates_now())
        self._forget({c.where for c in candidates}, now)
        if len(candidates) > 1 and self._requests >= MIN_REQUESTS:
            for _ in range(MOVES_A_ROUND):
                if not self._move_one(candidates, now):
                    break
        self._now = self._split(candidates) if len(candidates) > 1 else None
        self._name_next_home()
        self._list()

    def _list(self) -> None:
        """Publish the busiest HOME_ENTRIES homes, if they changed."""
        self._relist = False
        listed = dict(heapq.nlargest(HOME_ENTRIES, self._homes.items(), key=lambda kv: self._rates[kv[0]]))
        if listed != self._listed:
            self._writer.publish(listed)
            self._listed = listed
            self.stats["published"] += 1

    def describe(self) -> dict[str, Any]:
        named = [c.instance_id for c in self._candidates if c.where == self._next_home]
        return {**self.stats, "prompts": len(self._rates), "listed": len(self._listed),
                "next_home": named[0] if named else None, "requests_decayed": round(self._requests, 1)}

    # --- the next home ------------------------------------------------------------------------
    def _name_next_home(self) -> None:
        """Name the instance furthest below its share of the work among those with room for one
        more prompt of the usual size (any, where none has), if that changed."""
        split, where = self._now, None
        if split is not None:
            usual = sum(split.held) / max(1, len(split.homes))
            roomy = [n for n, room in enumerate(split.room) if split.held[n] + usual <= room]
            # Furthest below its share: the lowest work per share (the total is common to all).
            where = self._candidates[min(roomy or range(len(split.room)),
                                         key=lambda n: split.load[n] / split.share[n])].where
        if where != self._next_home:
            self._writer.set_next_home(where)
            self._next_home = where

    # --- a round ------------------------------------------------------------------------------
    def _decay(self, now: float) -> None:
        if self._decayed_at is not None:
            factor = math.exp(-self._decay_per_s * (now - self._decayed_at))
            self._rates = {key: rate * factor for key, rate in self._rates.items()}
            self._requests *= factor
        self._decayed_at = now

    def _forget(self, live: set[Where], now: float) -> None:
        """Prompts no longer seen, and homes on instances that left (the prompt's next request
        names its home again)."""
        rates = self._rates
        for key in [k for k, rate in rates.items() if rate < FORGET_BELOW]:
            del rates[key]
            self._sizes.pop(key, None)
        for key in [key for key, where in self._homes.items() if key not in rates or where not in live]:
            del self._homes[key]
        self._settles_at = {key: at for key, at in self._settles_at.items() if at > now}

    def _split(self, candidates: Sequence[Candidate]) -> _Split:
        index = {c.where: n for n, c in enumerate(candidates)}
        homes = {key: index[where] for key, where in self._homes.items() if where in index}
        load = [0.0] * len(candidates)
        footprint = [0.0] * len(candidates)
        held = [0.0] * len(candidates)
        for key, n in homes.items():
            load[n] += self._rates[key]
            footprint[n] += self._footprint(key)
            held[n] += self._sizes.get(key, 0)
        speeds = speed_classes([c.speed for c in candidates])
        total_speed = sum(speeds)
        return _Split(index, homes, load, [speed / total_speed for speed in speeds], footprint, held,
                      [self._room(c) for c in candidates])

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
        past = [n for n in range(len(candidates)) if split.footprint[n] > split.room[n]]
        move = self._relief(split, max(past, key=lambda n: split.footprint[n] - split.room[n])) \
            if past else None
        move = move or self._evening(split)
        if move is None:
            return False
        for key, to in move:
            self._homes[key] = candidates[to].where
            self._settles_at[key] = now + STAY_S
        self.stats["moves"] += 1
        return True

    def _relief(self, split: _Split, full: int) -> list[tuple[int, int]] | None:
        """The move off `full`, past its room, to where the prompt fits that leaves the work
        most even; None if no prompt of it fits anywhere."""
        room = split.room
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

    def _evening(self, split: _Split) -> list[tuple[int, int]] | None:
        """The move (or swap of two homes) from the instance furthest above its share of the
        work to the one furthest below that brings them closest, within both rooms (counting
        every prompt homed there: one that has not come back yet soon may); None if the work is
        within the tolerance or nothing brings it closer."""
        room = split.room
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
                grown = self._sizes.get(key, 0) - (self._sizes.get(other, 0) if other is not None else 0)
                if shift <= 0 or split.held[under] + grown > room[under] \
                        or split.held[over] - grown > room[over]:
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
