"""Affinity for kv_aware (docs/architecture.md §4.4): which keys each instance holds KV for, or
is about to, and what the request would cost on each.

Keys (cacheroute_proxy/affinity_keys.py) are 64-bit hashes: of a knowledge id, or of a block
of a plain OpenAI request's rendered prompt (fixed-size blocks, each hash chained on the one
before, so two prompts that share a prefix share their leading hashes, as vLLM's automatic
prefix cache shares their leading KV blocks).

A key is held by an instance when the affinity index confirms it (the sidecar heard the inject
acknowledged, the prompt sent, or the engine's own KV event) or when a routing decision claims
it (`Claim`): the deciding worker appends the claim to the shared claims ring the moment it
chooses, so a second request for the same knowledge or prompt, on any worker, goes the same
way before anything is confirmed. A claim ends when the index confirms its keys, when its
request withdraws what it did not make resident (a failed attempt, a refused inject) or after
PROXY_AFFINITY_PENDING_S.

Two views, by PROXY_AFFINITY_VIEW:
- `SharedAffinity` (the default) reads the host-wide index the sidecar publishes in the shared
  segment (shm_schema.affinity) and every worker's claims (shm_schema.claims);
- `PerWorkerAffinity`, the ablation, knows only what this worker itself sent and claimed, with
  the same LRU bound (the capacity the sidecar publishes for the instance), like N proxies that
  each keep their own index.
Both report what this worker sends (acknowledged knowledge, forwarded prefix blocks) to the
sidecar as RESIDENT / PREFIX events, so the shared index hears from every worker.

`AffinityScorer.assess` prices what a request would cost on each candidate given what it holds:
the prefill of the prompt tokens not held and the KV transfer of the knowledge not held; the
router adds each instance's queue wait and pace (KvAwareStrategy).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from cacheroute_proxy.affinity_keys import knowledge_key, prefix_keys, rendezvous_home
from cacheroute_proxy.clock import now_us
from cacheroute_proxy.config import Settings
from cacheroute_proxy.engine_prefix import EnginePrefix
from cacheroute_proxy.routing.strategies import Prediction
from shm_schema import InstanceSlot, Segment, layout
from shm_schema.affinity import AFFINITY_ENTRIES, AffinityReader
from shm_schema.claims import ClaimReader, Claimed, ClaimWriter, KeyGroup
from shm_schema.records import AFFINITY_KNOWLEDGE, AFFINITY_PREFIX, CLAIM_OP_CLAIM

from .request_model import Endpoint, ProxyRequest
from .tracker import RequestTracker

Where = tuple[int, int, int]  # (slot, generation, kind)
PRUNE_EVERY_US = 1_000_000


def rendered_prompt(request: ProxyRequest) -> str | None:
    """The text a plain OpenAI request puts before generation, in order (roles and contents of
    chat messages; a completion's prompt); None for a CacheRoute request (it has knowledge ids)."""
    if request.source != "openai":
        return None
    raw: Any = request.parsed_prompt
    if raw is None:
        return None
    if request.endpoint is Endpoint.CHAT:
        return "".join(f"<|{m.role}|>{m.content if isinstance(m.content, str) else m.content!s}"
                       for m in raw)
    return raw if isinstance(raw, str) else str(raw)


class Residency(NamedTuple):
    """What the index confirms an instance holds."""
    knowledge: frozenset[int]
    prefix: frozenset[int]


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

    def holds(self, where: Where, key: int, now: int) -> bool:
        held = self._held.get(where)
        claims = held.get(key) if held else None
        if not claims:
            return False
        if max(claims.values()) > now:
            return True
        del held[key]  # type: ignore[union-attr]  # every claim on it lapsed
        return False

    def confirmed(self, where: Where, key: int) -> None:
        """The index holds `key` now: the claims on it are done (so that an eviction the index
        reports later is not hidden by them)."""
        held = self._held.get(where)
        if held:
            held.pop(key, None)

    def count(self, where: Where, now: int) -> int:
        held = self._held.get(where)
        return sum(1 for claims in held.values() if max(claims.values()) > now) if held else 0

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

    def claim(self, instance: InstanceSlot, groups: Sequence[KeyGroup]) -> int: ...

    def drop(self, instance: InstanceSlot, claim: int, groups: Sequence[KeyGroup]) -> None: ...

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None: ...

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None: ...


class SharedAffinity:
    """The host-wide index: read from the segment, fed through the event channel; every
    worker's claims, from the claims ring."""

    mode = "shared"

    def __init__(self, seg: Segment, tracker: RequestTracker, pending_s: float) -> None:
        self._reader = AffinityReader(seg)
        self._tracker = tracker
        self.pending = PendingClaims(pending_s)
        self._claim_writer = ClaimWriter(seg)
        self._claim_reader = ClaimReader(seg)

    def refresh(self, now: int) -> None:
        """Take in the claims every worker made since the last selection."""
        for record in self._claim_reader.poll(now):
            self.pending.apply(record)
        self.pending.prune(now)

    def residency(self, instance: InstanceSlot) -> Residency:
        row = self._reader.row(instance.slot, instance.generation)
        return Residency(row.knowledge, row.prefix)

    def capacity_tokens(self, instance: InstanceSlot) -> int:
        return self._reader.row(instance.slot, instance.generation).capacity_tokens

    def claim(self, instance: InstanceSlot, groups: Sequence[KeyGroup]) -> int:
        return self._claim_writer.claim(instance.slot, instance.generation, groups)

    def drop(self, instance: InstanceSlot, claim: int, groups: Sequence[KeyGroup]) -> None:
        self._claim_writer.drop(claim, instance.slot, instance.generation, groups)

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        self._tracker.residency(instance.slot, instance.generation, keys, tokens_each, prefix=False)

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        self._tracker.residency(instance.slot, instance.generation, keys, tokens_each, prefix=True)


class PerWorkerAffinity(SharedAffinity):
    """Only what this worker sent and claimed: its own LRU per instance (bounded as the sidecar's
    model: by the capacity the sidecar publishes, and by AFFINITY_ENTRIES) and its own claims,
    which no other worker reads."""

    mode = "per_worker"

    def __init__(self, seg: Segment, tracker: RequestTracker, pending_s: float) -> None:
        super().__init__(seg, tracker, pending_s)
        self._models: dict[tuple[int, int], OrderedDict[int, tuple[bool, int]]] = {}
        self._claim_ids = itertools.count()

    def refresh(self, now: int) -> None:
        self.pending.prune(now)

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

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        super().forwarded(instance, keys, tokens_each)
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


def make_index(settings: Settings, seg: Segment, tracker: RequestTracker) -> AffinityIndex:
    view = PerWorkerAffinity if settings.affinity_view == "per_worker" else SharedAffinity
    return view(seg, tracker, settings.affinity_pending_s)


class _Holding(NamedTuple):
    """What the index and the claims say one candidate holds of one request."""
    resident: tuple[str, ...]
    claimed: tuple[str, ...]
    cached: int
    pending_blocks: int


def _homes(candidates: Sequence[InstanceSlot], holdings: Sequence[_Holding],
           kid_keys: list[tuple[str, int]], blocks: list[int]) -> dict[int, tuple[int, int]]:
    """Per candidate index: how many of the request's knowledge ids, and of its prompt's blocks,
    it holds as their home. What no candidate holds, confirmed or claimed, has a home among the
    candidates (a rendezvous hash of its key), which counts as holding it: so a prompt or an id
    held nowhere -- never seen, or evicted everywhere -- goes back where it went before unless
    that instance's queue costs more than a hit would save, and the instances' caches keep
    apart what they hold instead of each coming to hold everything."""
    names = [c.instance_id for c in candidates]
    homes: dict[int, list[int]] = {}
    for kid, key in kid_keys:
        if not any(kid in h.resident or kid in h.claimed for h in holdings):
            homes.setdefault(rendezvous_home(key, names), [0, 0])[0] += 1
    if blocks and not any(h.cached for h in holdings):
        homes.setdefault(rendezvous_home(blocks[0], names), [0, 0])[1] += len(blocks)
    return {index: (kids, prompt) for index, (kids, prompt) in homes.items()}


class Assessment(NamedTuple):
    """What one candidate holds of one request, and what the request would cost there."""
    resident_kids: tuple[str, ...]  # knowledge ids whose KV the index confirms the instance holds
    pending_kids: tuple[str, ...]   # ids a standing claim routed there, not confirmed yet
    prefix_blocks: int   # leading prompt blocks it holds, confirmed, claimed or as their home
    pending_blocks: int  # of those, claimed and not confirmed yet
    home_kids: int       # ids it counts as holding only as their home: no candidate holds them
    home_blocks: int     # blocks likewise (the prompt's first block is held nowhere)
    prefill_ms: float    # the prefill of what it does not hold, at the profile's pace
    transfer_ms: float   # the KDN -> instance transfer of the knowledge KV it does not hold
    saved_ms: float      # what holding what it holds saves, at the profile's pace


# (instance id, KDN address, effective knowledge tokens) -> ms a KV transfer would take now
# (KnowledgePreparer.transfer_ms: the link's queue and its learned pace).
TransferEstimate = Callable[[str, str, int], float]


class AffinityScorer:
    def __init__(self, settings: Settings, index: AffinityIndex, predictors: Any,
                 transfer_ms: TransferEstimate, engine_prefix: EnginePrefix | None = None) -> None:
        self._settings = settings
        self.index = index
        self._predictors = predictors
        self._transfer_ms = transfer_ms
        # The model's tokenizer (PROXY_AFFINITY_TOKENIZER): prefix keys as the engine names its
        # blocks, so its own KV events say where they are; else the proxy's character blocks.
        self._engine_prefix = engine_prefix

    def prefix_of(self, request: ProxyRequest) -> list[int]:
        """The request's prefix keys, hashed once (a retry reuses them)."""
        if request.prefix_keys is None:
            request.prefix_keys = self._engine_keys(request) if self._engine_prefix is not None \
                else self._own_keys(request)
        return request.prefix_keys

    def _own_keys(self, request: ProxyRequest) -> list[int]:
        text = rendered_prompt(request)
        return [] if text is None else prefix_keys(
            text, self._settings.affinity_block_tokens, self._settings.affinity_max_blocks)

    def _engine_keys(self, request: ProxyRequest) -> list[int]:
        engine, raw = self._engine_prefix, request.parsed_prompt
        assert engine is not None
        if request.source != "openai" or raw is None:
            return []
        if request.endpoint is Endpoint.CHAT:
            return engine.chat_keys(raw)
        # A list prompt (token ids, several prompts) is not one text: no keys.
        return engine.completion_keys(raw) if isinstance(raw, str) else []

    def assess(self, request: ProxyRequest, candidates: Sequence[InstanceSlot],
               claims: bool = True) -> list[Assessment]:
        """Each candidate's holding and the request's cost there. With `claims` (kv_aware's
        choice), standing claims count as held, and what no candidate holds has a home that
        counts as holding it; without (what the prepare stage may skip), only what the index
        confirms."""
        spec = request.knowledge
        kids = spec.knowledge_ids if spec is not None and spec.wanted else []
        kid_keys = [(kid, knowledge_key(kid)) for kid in kids]
        blocks = self.prefix_of(request) if not kids else []
        now = now_us()
        if claims:
            self.index.refresh(now)
        holdings = [self._holding(instance, kid_keys, blocks, now if claims else 0) for instance in candidates]
        homes = _homes(candidates, holdings, kid_keys, blocks) if claims and len(candidates) > 1 else {}
        return [self._assessment(request, instance, holding, homes.get(index, (0, 0)), len(kid_keys))
                for index, (instance, holding) in enumerate(zip(candidates, holdings))]

    def _holding(self, instance: InstanceSlot, kid_keys: list[tuple[str, int]], blocks: list[int],
                 now: int) -> _Holding:
        held = self.index.residency(instance)
        pending = self.index.pending
        resident: list[str] = []
        claimed: list[str] = []
        if kid_keys:
            where = (instance.slot, instance.generation, AFFINITY_KNOWLEDGE)
            for kid, key in kid_keys:
                if key in held.knowledge:
                    resident.append(kid)
                    pending.confirmed(where, key)
                elif now and pending.holds(where, key, now):
                    claimed.append(kid)
        cached = pending_blocks = 0
        if blocks:
            where = (instance.slot, instance.generation, AFFINITY_PREFIX)
            for key in blocks:
                if key in held.prefix:
                    pending.confirmed(where, key)
                elif now and pending.holds(where, key, now):
                    pending_blocks += 1
                else:
                    break
                cached += 1
        return _Holding(tuple(resident), tuple(claimed), cached, pending_blocks)

    def _assessment(self, request: ProxyRequest, instance: InstanceSlot, holding: _Holding,
                    home: tuple[int, int], wanted: int) -> Assessment:
        home_kids, home_blocks = home
        held_kids, cached = len(holding.resident) + len(holding.claimed) + home_kids, holding.cached + home_blocks
        prefill, transfer, saved = self._costs(request, instance, held_kids, wanted, cached)
        return Assessment(holding.resident, holding.claimed, cached, holding.pending_blocks, home_kids,
                          home_blocks, prefill, transfer, saved)

    def _costs(self, request: ProxyRequest, instance: InstanceSlot, held_kids: int, wanted: int,
               cached_blocks: int) -> tuple[float, float, float]:
        """(prefill of what is not held, transfer of the knowledge not held, what the held part
        saves), in ms at the profile's pace."""
        predictors = self._predictors
        spec = request.knowledge
        prompt = request.prompt_tokens
        if spec is not None and wanted:
            knowledge = spec.knowledge_tokens
            if spec.injection_type != "kvcache" or instance.kv_inject == layout.KV_INJECT_NO:
                return predictors.text_service_ms(prompt, knowledge), 0.0, 0.0
            prefill = predictors.kvcache_service(prompt, knowledge).total_ms
            effective = predictors.effective_knowledge_tokens
            missing = self._transfer_ms(instance.instance_id, spec.kdn_addr,
                                        effective(knowledge * (wanted - held_kids) // wanted))
            everything = self._transfer_ms(instance.instance_id, spec.kdn_addr, effective(knowledge))
            return prefill, missing, everything - missing
        cached = min(prompt, cached_blocks * self._settings.affinity_block_tokens)
        prefill = predictors.text_service_ms(prompt - cached, 0)
        saved = predictors.text_service_ms(prompt, 0) - prefill if cached else 0.0
        return prefill, 0.0, saved

    def claim(self, request: ProxyRequest, instance: InstanceSlot,
              assessment: Assessment) -> Claim | None:
        """Record choosing `instance` as pending residency of what the request will make
        resident there and the index does not confirm yet; None if that is nothing."""
        spec = request.knowledge
        knowledge: dict[str, int] = {}
        if spec is not None and spec.wanted and spec.injection_type == "kvcache" \
                and instance.kv_inject != layout.KV_INJECT_NO:
            knowledge = {kid: knowledge_key(kid) for kid in spec.knowledge_ids
                         if kid not in assessment.resident_kids}
        held = self.index.residency(instance).prefix
        prefix = () if knowledge else tuple(k for k in self.prefix_of(request) if k not in held)
        if not knowledge and not prefix:
            return None
        tokens_each = spec.knowledge_tokens // max(1, len(spec.knowledge_ids)) if knowledge else 0  # type: ignore[union-attr]
        claim = Claim(self.index, instance, knowledge, tokens_each, prefix,
                      self._settings.affinity_block_tokens)
        claim.id = self.index.claim(instance, claim.groups(knowledge.values(), prefix))
        return claim

    def report(self, request: ProxyRequest, instance: InstanceSlot, assessment: Assessment,
               prediction: Prediction) -> dict[str, Any]:
        """One instance's part of /debug/instance_loads."""
        held = self.index.residency(instance)
        pending, now = self.index.pending, now_us()
        return {"resident_knowledge": list(assessment.resident_kids),
                "pending_knowledge": list(assessment.pending_kids),
                "resident_prefix_blocks": assessment.prefix_blocks - assessment.pending_blocks - assessment.home_blocks,
                "pending_prefix_blocks": assessment.pending_blocks,
                "home": {"knowledge": assessment.home_kids, "prefix_blocks": assessment.home_blocks},
                "resident_counts": {"knowledge": len(held.knowledge), "prefix_blocks": len(held.prefix)},
                "pending_counts": {
                    "knowledge": pending.count((instance.slot, instance.generation, AFFINITY_KNOWLEDGE), now),
                    "prefix_blocks": pending.count((instance.slot, instance.generation, AFFINITY_PREFIX), now)},
                "capacity_tokens": self.index.capacity_tokens(instance) or None,
                "saved_ms": round(assessment.saved_ms, 1),
                "predicted_ttft_ms": _rounded({"queue": prediction.queue_ms, "prefill": prediction.prefill_ms,
                                               "transfer": prediction.transfer_ms,
                                               "total": prediction.total_ms})}


def _rounded(values: dict[str, float | None]) -> dict[str, float | None]:
    return {name: None if value is None else round(value, 1) for name, value in values.items()}


class Claim:
    """A request's routing decision, pending residency on its instance for every worker until the
    index confirms it. What the attempt does not make resident -- knowledge whose inject was not
    acknowledged, a prompt the instance did not take -- is withdrawn when its lease ends."""

    __slots__ = ("id", "_index", "_instance", "_knowledge", "_tokens_each", "_prefix",
                 "_block_tokens", "_kept_kids", "_prefix_kept", "_settled")

    def __init__(self, index: AffinityIndex, instance: InstanceSlot, knowledge: dict[str, int],
                 tokens_each: int, prefix: tuple[int, ...], block_tokens: int) -> None:
        self.id = -1
        self._index = index
        self._instance = instance
        self._knowledge = knowledge  # kid -> key
        self._tokens_each = tokens_each
        self._prefix = prefix
        self._block_tokens = block_tokens
        self._kept_kids: set[str] = set()
        self._prefix_kept = False
        self._settled = False

    def groups(self, knowledge_keys: Any, prefix: Sequence[int]) -> list[KeyGroup]:
        groups = []
        if knowledge_keys:
            groups.append(KeyGroup(AFFINITY_KNOWLEDGE, self._tokens_each, tuple(knowledge_keys)))
        if prefix:
            groups.append(KeyGroup(AFFINITY_PREFIX, self._block_tokens, tuple(prefix)))
        return groups

    def knowledge_acknowledged(self, kids: Sequence[str]) -> None:
        """The instance acknowledged these ids' inject: the index will confirm them."""
        self._kept_kids.update(kids)

    def prompt_taken(self) -> None:
        """The instance accepted the request: its prefill will cache the prompt's blocks."""
        self._prefix_kept = True

    def settle(self) -> None:
        """At the end of the attempt: withdraw what it did not make resident (once)."""
        if self._settled:
            return
        self._settled = True
        dropped = [key for kid, key in self._knowledge.items() if kid not in self._kept_kids]
        groups = self.groups(dropped, () if self._prefix_kept else self._prefix)
        if groups:
            self._index.drop(self._instance, self.id, groups)


def debug_request(query: Any) -> ProxyRequest | None:
    """The request `/debug/instance_loads?knowledge=k1,k2` (kvcache injection,
    `knowledge_tokens` in all, 1000 an id by default) or `?prompt=TEXT` (a plain completion)
    stands for; None without either."""
    from .request_model import KnowledgeSpec  # the debug route only

    kids = [k for k in (query.get("knowledge") or "").split(",") if k.strip()]
    prompt = query.get("prompt")
    if kids:
        tokens = int(query.get("knowledge_tokens") or 1000 * len(kids))
        spec = KnowledgeSpec(enabled=True, injection_type="kvcache", knowledge_ids=kids,
                             knowledge_tokens=tokens, kdn_addr=query.get("kdn") or "")
        return ProxyRequest(endpoint=Endpoint.CHAT, upstream_body=b"", stream=False, model=None,
                            request_id=0, token_length=None, source="cacheroute", body={},
                            knowledge=spec)
    if prompt is not None:
        return ProxyRequest(endpoint=Endpoint.COMPLETIONS, upstream_body=b"", stream=False,
                            model=None, request_id=0, token_length=None, source="openai",
                            prompt_tokens=max(1, -(-len(prompt) // 4)), parsed_prompt=prompt)
    return None


def report_residency(index: AffinityIndex, instance: InstanceSlot, request: ProxyRequest,
                     acknowledged_kids: Sequence[str], prefix: Sequence[int],
                     block_tokens: int) -> None:
    """After a request: the knowledge the instance acknowledged (or already held) and the
    prefix blocks it was sent are now resident there, most recently used."""
    spec = request.knowledge
    if acknowledged_kids and spec is not None:
        wanted = max(1, len(spec.knowledge_ids))
        index.acknowledged(instance, [knowledge_key(k) for k in acknowledged_kids],
                           spec.knowledge_tokens // wanted)
    if prefix:
        index.forwarded(instance, prefix, block_tokens)


__all__ = ["AffinityIndex", "AffinityScorer", "Assessment", "Claim", "PendingClaims",
           "PerWorkerAffinity", "Residency", "SharedAffinity", "knowledge_key", "make_index",
           "prefix_keys", "rendered_prompt", "report_residency"]
