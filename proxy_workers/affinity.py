"""Affinity for kv_aware (docs/architecture.md §4.4): which keys each instance holds KV for, and
what that saves a request.

Keys (cacheroute_proxy/affinity_keys.py) are 64-bit hashes: of a knowledge id, or of a block
of a plain OpenAI request's rendered prompt (fixed-size blocks, each hash chained on the one
before, so two prompts that share a prefix share their leading hashes, as vLLM's automatic
prefix cache shares their leading KV blocks).

Two views of residency, by PROXY_AFFINITY_VIEW:
- `SharedAffinity` (the default) reads the host-wide index the sidecar publishes in the shared
  segment (shm_schema.affinity): what any worker sent, or what the instance itself reported;
- `PerWorkerAffinity`, the ablation, remembers only what this worker itself sent, with the same
  LRU bound (the capacity the sidecar publishes for the instance), like N proxies that each
  keep their own index.
Both report what this worker sends (acknowledged knowledge, forwarded prefix blocks) to the
sidecar as RESIDENT / PREFIX events, so the shared index hears from every worker.

`AffinityScorer.assess` turns residency into time: knowledge already resident saves its KV
transfer (the prepare stage skips the KDN for it), cached prefix blocks save their prefill;
the predictors price both, and KvAwareStrategy turns the time into a bounded credit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple, Protocol, Sequence

from cacheroute_proxy.affinity_keys import knowledge_key, prefix_keys
from cacheroute_proxy.config import Settings
from cacheroute_proxy.engine_prefix import EnginePrefix
from cacheroute_proxy.routing.strategies import KvAwareStrategy
from shm_schema import InstanceSlot, Segment, layout
from shm_schema.affinity import AFFINITY_ENTRIES, AffinityReader

from .kdn_links import LinkTable
from .request_model import Endpoint, ProxyRequest
from .tracker import RequestTracker

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
    knowledge: frozenset[int]
    prefix: frozenset[int]


_NOTHING = Residency(frozenset(), frozenset())


class AffinityIndex(Protocol):
    mode: str

    def residency(self, instance: InstanceSlot) -> Residency: ...

    def capacity_tokens(self, instance: InstanceSlot) -> int: ...

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None: ...

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None: ...


class SharedAffinity:
    """The host-wide index: read from the segment, fed through the event channel."""

    mode = "shared"

    def __init__(self, seg: Segment, tracker: RequestTracker) -> None:
        self._reader = AffinityReader(seg)
        self._tracker = tracker

    def residency(self, instance: InstanceSlot) -> Residency:
        row = self._reader.row(instance.slot, instance.generation)
        return Residency(row.knowledge, row.prefix)

    def capacity_tokens(self, instance: InstanceSlot) -> int:
        return self._reader.row(instance.slot, instance.generation).capacity_tokens

    def acknowledged(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        self._tracker.residency(instance.slot, instance.generation, keys, tokens_each, prefix=False)

    def forwarded(self, instance: InstanceSlot, keys: Sequence[int], tokens_each: int) -> None:
        self._tracker.residency(instance.slot, instance.generation, keys, tokens_each, prefix=True)


class PerWorkerAffinity(SharedAffinity):
    """Only what this worker sent, in its own LRU per instance (bounded as the sidecar's model:
    by the capacity the sidecar publishes, and by AFFINITY_ENTRIES)."""

    mode = "per_worker"

    def __init__(self, seg: Segment, tracker: RequestTracker) -> None:
        super().__init__(seg, tracker)
        self._models: dict[tuple[int, int], OrderedDict[int, tuple[bool, int]]] = {}

    def residency(self, instance: InstanceSlot) -> Residency:
        model = self._models.get((instance.slot, instance.generation))
        if not model:
            return _NOTHING
        return Residency(frozenset(k for k, (prefix, _) in model.items() if not prefix),
                         frozenset(k for k, (prefix, _) in model.items() if prefix))

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
    return (PerWorkerAffinity if settings.affinity_view == "per_worker" else SharedAffinity)(seg, tracker)


class Assessment(NamedTuple):
    """What one candidate holds of one request, and what that is predicted to save."""
    resident_kids: tuple[str, ...]  # knowledge ids whose KV the instance holds
    prefix_blocks: int  # leading prompt blocks it holds
    saved_ms: float
    credit: float  # score units (KvAwareStrategy.credit)


NO_AFFINITY = Assessment((), 0, 0.0, 0.0)


class AffinityScorer:
    def __init__(self, settings: Settings, index: AffinityIndex, predictors: Any,
                 links: LinkTable, strategy: KvAwareStrategy,
                 engine_prefix: EnginePrefix | None = None) -> None:
        self._settings = settings
        self.index = index
        self._predictors = predictors
        self._links = links
        self._strategy = strategy
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

    def assess(self, request: ProxyRequest, candidates: Sequence[InstanceSlot]) -> list[Assessment]:
        spec = request.knowledge
        kids = spec.knowledge_ids if spec is not None and spec.wanted else []
        kid_keys = [(kid, knowledge_key(kid)) for kid in kids]
        blocks = self.prefix_of(request) if not kids else []
        if not kid_keys and not blocks:
            return [NO_AFFINITY] * len(candidates)
        return [self._assess_one(request, instance, kid_keys, blocks) for instance in candidates]

    def _assess_one(self, request: ProxyRequest, instance: InstanceSlot,
                    kid_keys: list[tuple[str, int]], blocks: list[int]) -> Assessment:
        held = self.index.residency(instance)
        resident = tuple(kid for kid, key in kid_keys if key in held.knowledge)
        cached = 0
        for key in blocks:
            if key not in held.prefix:
                break
            cached += 1
        saved = self._saved_ms(request, instance, len(resident), len(kid_keys), cached)
        return Assessment(resident, cached, saved, self._strategy.credit(saved))

    def _saved_ms(self, request: ProxyRequest, instance: InstanceSlot, resident: int, wanted: int,
                  cached_blocks: int) -> float:
        predictors = self._predictors
        saved = 0.0
        spec = request.knowledge
        if resident and spec is not None and spec.injection_type == "kvcache" \
                and instance.kv_inject != layout.KV_INJECT_NO:
            # The KDN -> instance transfer of the resident ids' share, which the prepare stage skips.
            tokens = spec.knowledge_tokens * resident // wanted
            effective = predictors.effective_knowledge_tokens(tokens)
            if effective:
                link = self._links.link_for(instance.instance_id, spec.kdn_addr)
                saved += link.transfer_ms(predictors, effective)
        if cached_blocks:
            prompt = request.prompt_tokens
            cached = min(prompt, cached_blocks * self._settings.affinity_block_tokens)
            saved += predictors.text_service_ms(prompt, 0) - predictors.text_service_ms(prompt - cached, 0)
        return saved

    def report(self, request: ProxyRequest, instance: InstanceSlot, assessment: Assessment) -> dict[str, Any]:
        """One instance's part of /debug/instance_loads."""
        held = self.index.residency(instance)
        return {"resident_knowledge": list(assessment.resident_kids),
                "resident_prefix_blocks": assessment.prefix_blocks,
                "resident_counts": {"knowledge": len(held.knowledge), "prefix_blocks": len(held.prefix)},
                "capacity_tokens": self.index.capacity_tokens(instance) or None,
                "saved_ms": round(assessment.saved_ms, 1), "credit": round(assessment.credit, 4)}


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


def debug_report(scorer: AffinityScorer, strategy: KvAwareStrategy, request: ProxyRequest,
                 kv_aware_active: bool) -> Any:
    """`/debug/instance_loads`'s kv_aware part for `request` (cacheroute_proxy.routing.report)."""
    def report(instances: Sequence[InstanceSlot], totals: Sequence[float | None]):
        assessments = scorer.assess(request, instances)
        alive = [(t if i.alive else None) for i, t in zip(instances, totals)]
        scores, guard = strategy.combine(list(alive), [a.credit for a in assessments])
        rows = [{**scorer.report(request, i, a), "score_after_credit": s}
                for i, a, s in zip(instances, assessments, scores)]
        return rows, {"active": kv_aware_active, "affinity_view": scorer.index.mode,
                      "request": {"knowledge": request.knowledge.knowledge_ids if request.knowledge else [],
                                  "prefix_blocks": len(scorer.prefix_of(request))},
                      "guard": {"fired": guard.fired, "reason": guard.reason, "spread": guard.spread,
                                "balance_abs": strategy.balance_abs, "balance_rel": strategy.balance_rel}}
    return report


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


__all__ = ["AffinityIndex", "AffinityScorer", "Assessment", "NO_AFFINITY", "PerWorkerAffinity",
           "Residency", "SharedAffinity", "knowledge_key", "make_index", "prefix_keys",
           "rendered_prompt", "report_residency"]
