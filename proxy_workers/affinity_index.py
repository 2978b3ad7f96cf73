"""What each instance holds of kv_aware's keys, or is about to.

A key is held by an instance when the affinity index confirms it (the sidecar heard the inject
acknowledged, the prompt sent, or the engine's own KV event) or when a routing decision claims
it (`Claim`): the deciding worker appends the claim to the shared claims ring the moment it
chooses, so a second request for the same knowledge or prompt, on any worker, goes the same
way before anything is confirmed. A claim ends when the index confirms its keys, when its
request withdraws what it did not make resident (a failed attempt, a refused inject) or after
PROXY_AFFINITY_PENDING_S.

Two views, by PROXY_AFFINITY_VIEW:
- `SharedAffinity` (the default) reads the host-wide index the sidecar publishes in the shared
  segment (shm_schema.affinity), every worker's claims (shm_schema.claims) and the prompts'
  homes the sidecar balanced (shm_schema.homes), and shares the keys of the leading messages
  (system prompts) each worker tokenized (`lead`, `share_lead`: LEADs of the claims ring);
- `PerWorkerAffinity`, the ablation, knows only what this worker itself sent, claimed and
  tokenized, with the same LRU bound (the capacity the sidecar publishes for the instance),
  like N proxies that each keep their own index.
Both report what this worker sends (acknowledged knowledge, forwarded prefix blocks) to the
sidecar as RESIDENT / PREFIX events, so the shared index hears from every worker.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from typing import Any, Callable, Collection, Container, NamedTuple, Protocol, Sequence

from cacheroute_proxy.clock import now_us
from cacheroute_proxy.config import Settings
from shm_schema import InstanceSlot, Segment
from shm_schema.affinity import AFFINITY_ENTRIES, AffinityReader
from shm_schema.claims import ClaimReader, Claimed, ClaimWriter, KeyGroup, Lead, LeadParts
from shm_schema.homes import HomeReader
from shm_schema.records import AFFINITY_KNOWLEDGE, AFFINITY_PREFIX, CLAIM_OP_CLAIM, CLAIM_OP_LEAD

from .event_channel import EventChannelWriter

Where = tuple[int, int, int]  # (slot, generation, kind)
# What a claim keeps once made resident (an inject acknowledged, a prompt's answer ended) stands
# this long for the index to confirm it (the sidecar publishes at its next tick, milliseconds
# later); then the index alone says whether it is resident.
ACKNOWLEDGED_CLAIM_S = 0.5
HandOver = Callable[[Callable[[], None]], object]  # runs the callback ACKNOWLEDGED_CLAIM_S from now
PRUNE_EVERY_US = 1_000_000
LEADS_KEPT = 256  # other workers' leading messages known here, most recently used first


def hand_over_later(callback: Callable[[], None]) -> None:
    """The HandOver of a running worker: the callback on its event loop."""
    asyncio.get_running_loop().call_later(ACKNOWLEDGED_CLAIM_S, callback)


class Residency(NamedTuple):
    """What the index confirms an instance holds."""
    knowledge: frozenset[int]
    prefix: frozenset[int]
    engine_fed: bool = False  # the prefix blocks are its engine's own account (KV events)


_NOTHING = Residency(frozenset(), frozenset())


class PendingClaims:
    """Routing decisions the index has not confirmed yet: per (instance, kind), key -> {claim id:
    expiry (us)}. A key is pending while one of its claims stands."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_us = int(ttl_s * 1e6)
        self._held: dict[Where, dict[int, dict[int, int]]] = {}
        self._next_prune_us = 0

    def add(self, where: Where, keys: Sequence[int], claim: int, t_us: int) -> None:
        held = self._held.setdefault(where, {})
        expires = t_us + self._ttl_us
        for key in keys:
            held.setdefault(key, {})[claim] = expires

    def remove(self, where: Where, keys: Sequence[int], claim: int) -> None:
        held = self._held.get(where)
        if not held:
            return
        for key in keys:
            claims = held.get(key)
            if claims is not None:
                claims.pop(claim, None)
                if not claims:
                    del held[key]

    def apply(self, record: Claimed) -> None:
        """A record of the claims ring (any worker's)."""
        where = (record.slot, record.generation, record.kind)
        if record.op == CLAIM_OP_CLAIM:
            self.add(where, record.keys, record.claim, record.t_us)
        else:
            self.remove(where, record.keys, record.claim)

    def holds(self, where: Where, key: int, now: int, besides: int = -1) -> bool:
        """A claim (other than `besides`) stands on `key`."""
        held = self._held.get(where)
        claims = held.get(key) if held else None
        if not claims:
            return False
        if max(claims.values()) <= now:
            del held[key]  # type: ignore[union-attr]  # every claim on it lapsed
            return False
        return besides not in claims or any(expiry > now for claim, expiry in claims.items() if claim != besides)

    def confirmed(self, where: Where, key: int) -> None:
        """The index holds `key` now: the claims on it are done (so that an eviction the index
        reports later is not hidden by them)."""
        held = self._held.get(where)
        if held:
            held.pop(key, None)

    def count(self, where: Where, now: int, resident: Container[int] = ()) -> int:
        """The keys a claim stands on, but those the index holds already (`resident`)."""
        held = self._held.get(where)
        return sum(1 for key, claims in held.items() if key not in resident and max(claims.values()) > now) \
            if held else 0

    def prune(self, now: int) -> None:
        """Forget lapsed claims (at most once a second)."""
        if now < self._next_prune_us:
            return
        self._next_prune_us = now + PRUNE_EVERY_US
        for where in list(self._held):
            held = self._held[where]
            for key in [k for k, claims in held.items() if max(claims.values()) <= now]:
                del held[key]
            if not held:
                del self._held[where]


class AffinityIndex(Protocol):
    mode: str
    pending: PendingClaims

    def refresh(self, now: int) -> None: ...

    def residency(self, instance: InstanceSlot) -> Residency: ...

    def capacity_tokens(self, instance: InstanceSlot) -> int: ...

    def home_of(self, prompt_key: int) -> tuple[int, int] | None: ...

    def next_home(self) -> tuple[int, int] | None: ...

    def claim(self, instance: InstanceSlot, groups: Sequence[KeyGroup]) -> int: ...

    def drop(self, instance: InstanceSlot, claim: int, groups: Sequence[KeyGroup]) -> None: ...

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None: ...

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int,
                  prompt_blocks: int | None = None) -> None: ...

    def lead(self, lead: int) -> Lead | None: ...

    def share_lead(self, lead: int, blocks: int, keys: Sequence[int]) -> None: ...


class SharedAffinity:
    """The host-wide index: read from the segment, fed through the event channel; every
    worker's claims, from the claims ring."""

    mode = "shared"

    def __init__(self, seg: Segment, events: EventChannelWriter, pending_s: float) -> None:
        self._reader = AffinityReader(seg)
        self._events = events
        self.pending = PendingClaims(pending_s)
        self._claim_writer = ClaimWriter(seg)
        self._claim_reader = ClaimReader(seg)
        self._homes = HomeReader(seg)
        self._lead_parts = LeadParts()
        self._leads: OrderedDict[int, Lead] = OrderedDict()

    def refresh(self, now: int) -> None:
        """Take in the claims and leads every worker wrote since the last selection."""
        for record in self._claim_reader.poll(now):
            if record.op != CLAIM_OP_LEAD:
                self.pending.apply(record)
                continue
            lead = self._lead_parts.take(record)
            if lead is not None:
                self._leads[lead.lead] = lead
                self._leads.move_to_end(lead.lead)
                if len(self._leads) > LEADS_KEPT:
                    self._leads.popitem(last=False)
        self.pending.prune(now)

    def lead(self, lead: int) -> Lead | None:
        """The keys another worker shared for the leading messages hashed `lead` (as of the last
        refresh), if it did."""
        found = self._leads.get(lead)
        if found is not None:
            self._leads.move_to_end(lead)
        return found

    def share_lead(self, lead: int, blocks: int, keys: Sequence[int]) -> None:
        """Tell every worker the keys of the leading messages this one just tokenized."""
        self._claim_writer.lead(lead, blocks, keys)

    def residency(self, instance: InstanceSlot) -> Residency:
        row = self._reader.row(instance.slot, instance.generation)
        return Residency(row.knowledge, row.prefix, row.engine_fed)

    def capacity_tokens(self, instance: InstanceSlot) -> int:
        return self._reader.row(instance.slot, instance.generation).capacity_tokens

    def home_of(self, prompt_key: int) -> tuple[int, int] | None:
        """(slot, generation) of the prompt's home as the sidecar lists it; None if not listed."""
        return self._homes.home_of(prompt_key)

    def next_home(self) -> tuple[int, int] | None:
        """(slot, generation) of the instance the sidecar names for a prompt held nowhere."""
        return self._homes.next_home()

    def claim(self, instance: InstanceSlot, groups: Sequence[KeyGroup]) -> int:
        return self._claim_writer.claim(instance.slot, instance.generation, groups)

    def drop(self, instance: InstanceSlot, claim: int, groups: Sequence[KeyGroup]) -> None:
        self._claim_writer.drop(claim, instance.slot, instance.generation, groups)

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        self._events.residency(instance.slot, instance.generation, keys, tokens_each, prefix=False)

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int,
                  prompt_blocks: int | None = None) -> None:
        """The request's prompt-prefix blocks went to `instance`; `prompt_blocks`, the prompt's
        size in blocks where its keys fall short of it (the default: as many as its keys)."""
        size = len(keys) if prompt_blocks is None else prompt_blocks
        if self._reader.row(instance.slot, instance.generation).engine_fed:
            keys = keys[:1]  # the engine reports its blocks: the sidecar needs the prompt's name alone
        self._events.residency(instance.slot, instance.generation, keys, tokens_each, prefix=True,
                               prompt_blocks=size)


class PerWorkerAffinity(SharedAffinity):
    """Only what this worker sent and claimed: its own LRU per instance (bounded as the sidecar's
    model: by the capacity the sidecar publishes, and by AFFINITY_ENTRIES) and its own claims,
    which no other worker reads; every prompt at its rendezvous home."""

    mode = "per_worker"

    def __init__(self, seg: Segment, events: EventChannelWriter, pending_s: float) -> None:
        super().__init__(seg, events, pending_s)
        self._models: dict[tuple[int, int], OrderedDict[int, tuple[bool, int]]] = {}
        self._claim_ids = itertools.count()

    def refresh(self, now: int) -> None:
        self.pending.prune(now)

    def share_lead(self, lead: int, blocks: int, keys: Sequence[int]) -> None:
        pass  # nothing is shared: lead() finds nothing

    def home_of(self, prompt_key: int) -> tuple[int, int] | None:
        return None  # nothing host-wide: a prompt lives where this worker sent it, else by rendezvous

    def next_home(self) -> tuple[int, int] | None:
        return None

    def residency(self, instance: InstanceSlot) -> Residency:
        model = self._models.get((instance.slot, instance.generation))
        if not model:
            return _NOTHING
        return Residency(frozenset(k for k, (prefix, _) in model.items() if not prefix),
                         frozenset(k for k, (prefix, _) in model.items() if prefix))

    def claim(self, instance: InstanceSlot, groups: Sequence[KeyGroup]) -> int:
        claim, now = next(self._claim_ids), now_us()
        for group in groups:
            self.pending.add((instance.slot, instance.generation, group.kind), group.keys, claim, now)
        return claim

    def drop(self, instance: InstanceSlot, claim: int, groups: Sequence[KeyGroup]) -> None:
        for group in groups:
            self.pending.remove((instance.slot, instance.generation, group.kind), group.keys, claim)

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        super().acknowledged(instance, keys, tokens_each)
        self._remember(instance, keys, tokens_each, prefix=False)

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int,
                  prompt_blocks: int | None = None) -> None:
        super().forwarded(instance, keys, tokens_each, prompt_blocks)
        self._remember(instance, keys, tokens_each, prefix=True)

    def _remember(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int,
                  prefix: bool) -> None:
        where = (instance.slot, instance.generation)
        if len(self._models) > 4 * 1024:  # forget instances long gone
            self._models.clear()
        model = self._models.setdefault(where, OrderedDict())
        for key in keys:
            model.pop(key, None)
            model[key] = (prefix, tokens_each)
        capacity = self.capacity_tokens(instance)
        used = sum(tokens for _, tokens in model.values())
        while model and (len(model) > AFFINITY_ENTRIES or (capacity and used > capacity)):
            _, (_, tokens) = model.popitem(last=False)
            used -= tokens


def make_index(settings: Settings, seg: Segment, events: EventChannelWriter) -> AffinityIndex:
    view = PerWorkerAffinity if settings.affinity_view == "per_worker" else SharedAffinity
    return view(seg, events, settings.affinity_pending_s)


class Claim:
    """A request's routing decision, pending residency on its instance for every worker until the
    index confirms it. What the attempt does not make resident is withdrawn: knowledge whose
    inject was not acknowledged as the prepare stage ends, a prompt the instance did not take
    when its lease ends.

    A chat routed on its memoized leading blocks alone (ProxyRequest.prefix_exact) claims those
    at once and the rest when `amend` hears the exact keys, just after the send.

    What it made resident is left to the index `hand_over` (ACKNOWLEDGED_CLAIM_S) later: the
    instance may have evicted it before the index confirmed it, and a claim standing on would
    draw requests to KV that is not there."""

    __slots__ = ("_index", "_instance", "_knowledge", "_knowledge_claim", "_tokens_each",
                 "_block_tokens", "_prefix", "_knowledge_prepared", "_prefix_kept", "_settled", "_hand_over")

    def __init__(self, index: AffinityIndex, instance: InstanceSlot, knowledge: dict[str, int],
                 tokens_each: int, block_tokens: int, hand_over: HandOver) -> None:
        self._index = index
        self._hand_over = hand_over
        self._instance = instance
        self._knowledge = knowledge  # kid -> key
        self._tokens_each = tokens_each
        self._block_tokens = block_tokens
        self._knowledge_claim = -1
        self._prefix: dict[int, int] = {}  # prefix key -> the claim id that holds it
        self._knowledge_prepared = False
        self._prefix_kept = False
        self._settled = False
        if knowledge:
            self._knowledge_claim = index.claim(instance, [self._group(AFFINITY_KNOWLEDGE, knowledge.values())])

    @property
    def empty(self) -> bool:
        return not self._knowledge and not self._prefix

    @property
    def knowledge_claim(self) -> int:
        """The id of its claim on the request's knowledge (-1: none)."""
        return self._knowledge_claim

    def add_prefix(self, keys: Sequence[int]) -> None:
        """Claim these prefix blocks too (those not claimed already)."""
        new = tuple(key for key in keys if key not in self._prefix)
        if new and not self._settled:
            claim = self._index.claim(self._instance, [self._group(AFFINITY_PREFIX, new)])
            self._prefix.update(dict.fromkeys(new, claim))

    def amend(self, keys: Sequence[int]) -> None:
        """The exact prefix blocks the request brings, of those routed on its leading messages:
        the new ones are claimed, and any it does not bring after all (the chat template
        rendered the leading messages otherwise) withdrawn."""
        if self._settled:
            return
        exact = set(keys)
        self._drop_prefix([key for key in self._prefix if key not in exact])
        self.add_prefix(keys)

    def knowledge_prepared(self, acknowledged: Sequence[str]) -> None:
        """The prepare stage ended: the instance acknowledged these ids' inject. The rest are
        withdrawn now, not when the request ends, so no request is routed to or waits on a
        pull that is not coming (an inject refused, or the knowledge sent as text) for the
        length of this one's answer."""
        if self._settled:
            return
        self._knowledge_prepared = True
        self._drop_knowledge(keep=acknowledged)
        if self._knowledge:
            self._hand_over(self._drop_knowledge)

    def prompt_taken(self) -> None:
        """The instance accepted the request: its prefill will cache the prompt's blocks."""
        self._prefix_kept = True

    def settle(self) -> None:
        """At the end of the attempt: withdraw what it did not make resident (once)."""
        if self._settled:
            return
        self._settled = True
        if not self._knowledge_prepared:
            self._drop_knowledge()
        if not self._prefix_kept:
            self._drop_prefix()
        elif self._prefix:
            self._hand_over(self._drop_prefix)

    def _drop_knowledge(self, keep: Collection[str] = ()) -> None:
        """Withdraw the claimed knowledge but `keep` (a withdrawn id leaves the claim)."""
        dropped = [key for kid, key in self._knowledge.items() if kid not in keep]
        if dropped:
            self._index.drop(self._instance, self._knowledge_claim, [self._group(AFFINITY_KNOWLEDGE, dropped)])
            self._knowledge = {kid: key for kid, key in self._knowledge.items() if kid in keep}

    def _drop_prefix(self, keys: Sequence[int] | None = None) -> None:
        """Withdraw these prefix blocks (None: every one the claim holds)."""
        by_claim: dict[int, list[int]] = {}
        for key in list(self._prefix) if keys is None else keys:
            by_claim.setdefault(self._prefix.pop(key), []).append(key)
        for claim, dropped in by_claim.items():
            self._index.drop(self._instance, claim, [self._group(AFFINITY_PREFIX, dropped)])

    def _group(self, kind: int, keys: Any) -> KeyGroup:
        tokens = self._tokens_each if kind == AFFINITY_KNOWLEDGE else self._block_tokens
        return KeyGroup(kind, tokens, tuple(keys))
