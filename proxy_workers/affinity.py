"""kv_aware's pricing (docs/architecture.md, "kv_aware and the host-wide affinity index"): what a
request would cost on each candidate, given what each holds of it (`affinity_index`).

Keys (cacheroute_proxy/affinity_keys.py) are 64-bit hashes: of a knowledge id, or of a block
of a plain OpenAI request's rendered prompt (fixed-size blocks, each hash chained on the one
before, so two prompts that share a prefix share their leading hashes, as vLLM's automatic
prefix cache shares their leading KV blocks).

`AffinityScorer.assess` prices what a request would cost on each candidate: the prefill of the
prompt tokens not held and the KV transfer of the knowledge not held; kv_aware adds each
instance's queue wait and pace (cacheroute_proxy/routing/kv_aware.py, which the router hands
`assess` as its pricing). The pricing stays here, with the affinity index it reads: the
routing package imports nothing of a worker.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from cacheroute_proxy.affinity_keys import knowledge_key, prefix_keys, rendezvous_home
from cacheroute_proxy.clock import now_us
from cacheroute_proxy.config import Settings
from cacheroute_proxy.engine_prefix import EnginePrefix, LeadKeys
from cacheroute_proxy.routing.kv_aware import KvAwarePolicy, Prediction, engines_full, predictions
from cacheroute_proxy.routing.load_view import LoadView
from shm_schema import InstanceSlot, layout
from shm_schema.records import AFFINITY_KNOWLEDGE, AFFINITY_PREFIX

from . import metrics
from .affinity_index import AffinityIndex, Claim, HandOver, hand_over_later
from .request_model import Endpoint, ProxyRequest

PROMPT_LENGTHS_KEPT = 4096  # prompt lengths whose prefill a worker keeps at hand
# A request whose knowledge another request is pulling into its instance waits for that pull
# (AffinityScorer.pulled_meanwhile): the index is looked at this often, for at least this long.
CLAIM_POLL_S = 0.002
CLAIM_WAIT_MIN_S = 0.02


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


class _Holding(NamedTuple):
    """What the index and the claims say one candidate holds of one request."""
    resident: tuple[str, ...]
    claimed: tuple[str, ...]
    cached: int
    pending_blocks: int
    # KV pulls other requests wait on there (its knowledge claimed by any worker and not resident
    # yet): the KDN's link to the instance carries one at a time, so a new pull queues behind them.
    pulls_ahead: int


def _homes(candidates: Sequence[InstanceSlot], holdings: Sequence[_Holding],
           kid_keys: list[tuple[str, int]]) -> dict[int, int]:
    """Per candidate index: how many of the request's knowledge ids it holds as their home.
    An id no candidate holds, confirmed or claimed (never sent, or evicted everywhere), counts
    as held by its home, so it goes back where it went before unless that queue costs more
    than a hit saves."""
    names = [c.instance_id for c in candidates]
    homes: dict[int, int] = {}
    for kid, key in kid_keys:
        if not any(kid in h.resident or kid in h.claimed for h in holdings):
            home = rendezvous_home(key, names)
            homes[home] = homes.get(home, 0) + 1
    return homes


class Assessment(NamedTuple):
    """What one candidate holds of one request, and what the request would cost there."""
    resident_kids: tuple[str, ...]  # knowledge ids whose KV the index confirms the instance holds
    pending_kids: tuple[str, ...]   # ids a standing claim routed there, not confirmed yet
    prefix_blocks: int   # leading prompt blocks it holds, confirmed, claimed or as their home
    pending_blocks: int  # of those, claimed and not confirmed yet
    home_kids: int       # ids it counts as holding only as their home: no candidate holds them
    home_blocks: int     # the prompt's home: the blocks it is credited with and does not hold
    prefill_ms: float    # the prefill of what it does not hold, at the profile's pace
    transfer_ms: float   # the KDN -> instance transfer of the knowledge KV it does not hold
    saved_ms: float      # what holding what it holds saves, at the profile's pace
    # Away from the prompt's home: what its blocks would save there, at the profile's pace --
    # the cost of keeping them here, where they take the place of this instance's own prompts.
    displace_ms: float
    held_tokens: int     # prompt tokens it holds, confirmed or claimed: what its prefill skips


class LinkEstimates(Protocol):
    """What KV transfers from the KDN to an instance take now (KnowledgePreparer: each link's
    queue and its learned pace), in ms."""

    def transfer_ms(self, instance_id: str, kdn_addr: str, tokens: int) -> float: ...

    def link_wait_ms(self, instance_id: str, kdn_addr: str, queued_tokens: int = 0) -> float: ...

    def pull_ms(self, instance_id: str, kdn_addr: str, tokens: int) -> float: ...


def _index_of(candidates: Sequence[InstanceSlot], where: tuple[int, int] | None) -> int | None:
    """The index of the candidate at `where` (slot, generation); None if none is."""
    if where is not None:
        for index, instance in enumerate(candidates):
            if (instance.slot, instance.generation) == where:
                return index
    return None


class AffinityScorer:
    def __init__(self, settings: Settings, index: AffinityIndex, predictors: Any,
                 links: LinkEstimates, engine_prefix: EnginePrefix | None = None,
                 hand_over: HandOver = hand_over_later) -> None:
        self._settings = settings
        self._hand_over = hand_over  # when a claim leaves what it made resident to the index
        self.index = index
        self._predictors = predictors
        self._links = links
        # A plain prompt's prefill by its length (the profile's curve; each candidate asks for
        # one or two of a handful of lengths per request, and requests repeat them).
        self._prompt_ms: Callable[[int], float] = functools.lru_cache(maxsize=PROMPT_LENGTHS_KEPT)(
            lambda tokens: predictors.text_service_ms(tokens, 0))
        # The model's tokenizer (PROXY_AFFINITY_TOKENIZER): prefix keys as the engine names its
        # blocks, so its own KV events say where they are; else the proxy's character blocks.
        self._engine_prefix = engine_prefix

    def prefix_of(self, request: ProxyRequest) -> list[int]:
        """The request's prefix keys, hashed once (a retry reuses them). For a chat whose leading
        messages this worker memoized, only theirs at first: tokenizing the rest waits until
        the request is sent (`forwarding`)."""
        if request.prefix_keys is None:
            request.prefix_keys = self._own_keys(request) if self._engine_prefix is None \
                else self._engine_keys(request, lead=True)
        return request.prefix_keys

    def forwarding(self, instance: InstanceSlot, request: ProxyRequest, claim: Claim | None) -> None:
        """The request is being sent to `instance`, which will hold its prompt's blocks (the
        PREFIX event). Keys that are only the leading messages' are made exact first, in a
        callback that runs once the request is out and its answer awaited: the tokenizing then
        delays no request's send. Not for an instance whose engine reports its blocks itself
        (KV events): the index takes no worker's account of them, and the leading blocks name
        the prompt and its size as the sidecar weighs its home."""
        if request.prefix_exact or self.index.residency(instance).engine_fed:
            self.index.forwarded(instance, request.prefix_keys or (), self._settings.affinity_block_tokens,
                                 request.prompt_blocks)
        else:
            asyncio.get_running_loop().call_soon(self._forwarded_exact, instance, request, claim)

    async def pulled_meanwhile(self, instance: InstanceSlot, request: ProxyRequest, claim: Claim | None,
                               kids: Sequence[str]) -> tuple[str, ...]:
        """Of `kids` (knowledge that other requests had claimed on `instance`, not confirmed, when
        it was chosen), those whose KV the index confirms there once their pulls end: waited for
        while another claim on them stands, at most twice the transfer predicted for them (and
        CLAIM_WAIT_MIN_S), so the instance does not pull the same KV twice at once."""
        spec = request.knowledge
        if not kids or spec is None:
            return ()
        keys = {kid: knowledge_key(kid) for kid in kids}
        where = (instance.slot, instance.generation, AFFINITY_KNOWLEDGE)
        own = -1 if claim is None else claim.knowledge_claim
        tokens = spec.tokens_of(len(kids))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLAIM_WAIT_MIN_S + 2 * self._links.transfer_ms(instance.instance_id, spec.kdn_addr, tokens) / 1000
        while True:
            now = now_us()
            self.index.refresh(now)
            held = self.index.residency(instance).knowledge
            if all(key in held or not self.index.pending.holds(where, key, now, besides=own)
                   for key in keys.values()) or loop.time() >= deadline:
                return tuple(kid for kid, key in keys.items() if key in held)
            await asyncio.sleep(CLAIM_POLL_S)

    def prepared(self, instance: InstanceSlot, request: ProxyRequest, claim: Claim | None,
                 acknowledged: Sequence[str]) -> None:
        """The prepare stage ended; the instance acknowledged (or already held) the KV of
        `acknowledged`, so it is resident there: also knowledge shorter than one KV chunk, which
        saves no prefill (no aligned tokens) but whose KV the instance pulled all the same. The
        request's claim on the rest goes now; on these, once the index has had time to
        publish them (Claim.knowledge_prepared)."""
        spec = request.knowledge
        if acknowledged and spec is not None:
            self.index.acknowledged(instance, [knowledge_key(k) for k in acknowledged], spec.tokens_of(1))
        if claim is not None:
            claim.knowledge_prepared(acknowledged)

    def _forwarded_exact(self, instance: InstanceSlot, request: ProxyRequest, claim: Claim | None) -> None:
        request.prefix_keys, request.prefix_exact = self._engine_keys(request), True
        if claim is not None:
            held = self.index.residency(instance).prefix
            claim.amend([key for key in request.prefix_keys if key not in held])
        self.forwarding(instance, request, claim)

    def _own_keys(self, request: ProxyRequest) -> list[int]:
        text = rendered_prompt(request)
        return [] if text is None else prefix_keys(
            text, self._settings.affinity_block_tokens, self._settings.affinity_max_blocks)

    def _engine_keys(self, request: ProxyRequest, lead: bool = False) -> list[int]:
        """The keys as the engine names the prompt's blocks. With `lead`, a chat whose leading
        messages this worker memoized gets only theirs, and request.prefix_exact says so."""
        engine, raw = self._engine_prefix, request.parsed_prompt
        assert engine is not None
        if request.source != "openai" or raw is None:
            return []
        if request.endpoint is Endpoint.CHAT:
            if not lead:
                return engine.chat_keys(raw)
            leading = self._memoized(engine, raw)
            if leading is None:
                return self._tokenized(engine, raw)
            request.prefix_exact, request.prompt_blocks = False, leading.prompt_blocks
            return leading.keys
        # A list prompt (token ids, several prompts) is not one text: no keys.
        return engine.completion_keys(raw) if isinstance(raw, str) else []

    def _memoized(self, engine: EnginePrefix, raw: Any) -> LeadKeys | None:
        """The keys of a chat's leading messages as this worker memoized them, else as another
        worker shared them (adopted into this worker's memo for the next such chat); None if
        neither did."""
        leading = engine.lead_keys(raw)
        if leading is not None:
            metrics.prompt_keys("memo")
            return leading
        name = engine.lead_hash(raw)
        shared = None if name is None else self.index.lead(name)
        if shared is None:
            return None
        metrics.prompt_keys("shared")
        leading = LeadKeys(list(shared.keys), shared.blocks)
        engine.adopt(raw, leading)
        return leading

    def _tokenized(self, engine: EnginePrefix, raw: Any) -> list[int]:
        """A chat's keys, its prompt tokenized now, and its leading messages' keys (memoized on
        the way) shared with the other workers."""
        metrics.prompt_keys("tokenized")
        keys = engine.chat_keys(raw)
        leading, name = engine.lead_keys(raw), engine.lead_hash(raw)
        if leading is not None and name is not None:
            self.index.share_lead(name, leading.prompt_blocks, leading.keys)
        return keys

    def assess(self, request: ProxyRequest, candidates: Sequence[InstanceSlot],
               claims: bool = True) -> list[Assessment]:
        """Each candidate's holding and the request's cost there. With `claims` (kv_aware's
        choice), standing claims count as held, and what no candidate holds has a home that
        counts as holding it; without (what the prepare stage may skip), only what the index
        confirms."""
        spec = request.knowledge
        kids = spec.knowledge_ids if spec is not None and spec.wanted else []
        kid_keys = [(kid, knowledge_key(kid)) for kid in kids]
        now = now_us()
        if claims:
            self.index.refresh(now)  # first: what other workers shared spares tokenizing
        blocks = self.prefix_of(request) if not kids else []
        holdings = [self._holding(instance, kid_keys, blocks, now if claims else 0) for instance in candidates]
        homes = _homes(candidates, holdings, kid_keys) if claims and len(candidates) > 1 else {}
        prompt_home = self._home(blocks[0], candidates, holdings) if claims and blocks and len(candidates) > 1 \
            else None
        displace = self._prompt_saving(request, len(blocks)) if prompt_home is not None else 0.0
        return [self._assessment(request, instance, holding, homes.get(index, 0),
                                 len(blocks) - holding.cached if index == prompt_home else 0,
                                 0.0 if index == prompt_home else displace, len(kid_keys))
                for index, (instance, holding) in enumerate(zip(candidates, holdings))]

    def _home(self, prompt_key: int, candidates: Sequence[InstanceSlot], holdings: Sequence[_Holding]) -> int:
        """The index of the prompt's home among `candidates`: where the sidecar lists it; else
        the candidate holding most of its leading blocks (confirmed or claimed: its first
        requests went there); held nowhere, the sidecar's next home; else its rendezvous home."""
        listed = _index_of(candidates, self.index.home_of(prompt_key))
        if listed is not None:
            return listed
        holder = max(range(len(candidates)), key=lambda index: holdings[index].cached)
        if holdings[holder].cached:
            return holder
        named = _index_of(candidates, self.index.next_home())
        return named if named is not None else rendezvous_home(prompt_key, [c.instance_id for c in candidates])

    def _holding(self, instance: InstanceSlot, kid_keys: list[tuple[str, int]], blocks: list[int],
                 now: int) -> _Holding:
        held = self.index.residency(instance)
        pending = self.index.pending
        resident: list[str] = []
        claimed: list[str] = []
        pulls_ahead = 0
        if kid_keys:
            where = (instance.slot, instance.generation, AFFINITY_KNOWLEDGE)
            riding: set[int] = set()  # the pulls of the request's own ids: it rides them, not queues behind
            for kid, key in kid_keys:
                if key in held.knowledge:
                    resident.append(kid)
                    pending.confirmed(where, key)
                elif now and pending.holds(where, key, now):
                    claimed.append(kid)
                    riding.add(key)
            if now:
                pulls_ahead = pending.count(where, now, held.knowledge) - len(riding)
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
        return _Holding(tuple(resident), tuple(claimed), cached, pending_blocks, pulls_ahead)

    def _assessment(self, request: ProxyRequest, instance: InstanceSlot, holding: _Holding,
                    home_kids: int, home_blocks: int, displace_ms: float, wanted: int) -> Assessment:
        cached = holding.cached + home_blocks
        prefill, transfer, saved = self._costs(request, instance, holding, home_kids, wanted, cached)
        held_tokens = min(request.prompt_tokens, holding.cached * self._settings.affinity_block_tokens)
        return Assessment(holding.resident, holding.claimed, cached, holding.pending_blocks, home_kids,
                          home_blocks, prefill, transfer, saved, displace_ms, held_tokens)

    def _costs(self, request: ProxyRequest, instance: InstanceSlot, holding: _Holding, home_kids: int,
               wanted: int, cached_blocks: int) -> tuple[float, float, float]:
        """(prefill of what is not held, transfer of the knowledge not held, what the held part
        saves), in ms at the profile's pace. Of the `wanted` ids, the instance would pull those
        neither resident nor claimed there, its `home_kids` too: their credit spares a pull's
        time, not its place in the link's queue, behind the pulls already headed there (each
        taken to be one of these ids)."""
        predictors = self._predictors
        spec = request.knowledge
        prompt = request.prompt_tokens
        if spec is not None and wanted:
            knowledge = spec.knowledge_tokens
            if spec.injection_type != "kvcache" or instance.kv_inject == layout.KV_INJECT_NO:
                return predictors.text_service_ms(prompt, knowledge), 0.0, 0.0
            prefill = predictors.kvcache_service(prompt, knowledge).total_ms
            links, iid, kdn = self._links, instance.instance_id, spec.kdn_addr
            pulls = wanted - len(holding.resident) - len(holding.claimed)
            wait = links.link_wait_ms(iid, kdn, spec.tokens_of(holding.pulls_ahead))
            missing = (wait if pulls else 0.0) + links.pull_ms(iid, kdn, spec.tokens_of(pulls - home_kids))
            everything = wait + links.pull_ms(iid, kdn, knowledge)
            return prefill, missing, everything - missing
        saved = self._prompt_saving(request, cached_blocks)
        return self._prompt_ms(prompt) - saved, 0.0, saved

    def _prompt_saving(self, request: ProxyRequest, blocks: int) -> float:
        """The prefill that holding the prompt's first `blocks` blocks saves, at the profile's pace."""
        prompt = request.prompt_tokens
        cached = min(prompt, blocks * self._settings.affinity_block_tokens)
        if not cached:
            return 0.0
        return self._prompt_ms(prompt) - self._prompt_ms(prompt - cached)

    def claim(self, request: ProxyRequest, instance: InstanceSlot,
              assessment: Assessment) -> Claim | None:
        """Record choosing `instance` as pending residency of what the request will make
        resident there and the index does not confirm yet; None if that is nothing (and no
        exact prefix keys are still to come)."""
        spec = request.knowledge
        knowledge: dict[str, int] = {}
        if spec is not None and spec.wanted and spec.injection_type == "kvcache" \
                and instance.kv_inject != layout.KV_INJECT_NO:
            knowledge = {kid: knowledge_key(kid) for kid in spec.knowledge_ids
                         if kid not in assessment.resident_kids}
        tokens_each = spec.tokens_of(1) if knowledge else 0  # type: ignore[union-attr]
        claim = Claim(self.index, instance, knowledge, tokens_each, self._settings.affinity_block_tokens,
                      self._hand_over)
        if not knowledge:
            held = self.index.residency(instance).prefix
            claim.add_prefix([k for k in self.prefix_of(request) if k not in held])
        return None if claim.empty and request.prefix_exact else claim

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
                    "knowledge": pending.count((instance.slot, instance.generation, AFFINITY_KNOWLEDGE), now,
                                               held.knowledge),
                    "prefix_blocks": pending.count((instance.slot, instance.generation, AFFINITY_PREFIX), now,
                                                   held.prefix)},
                "capacity_tokens": self.index.capacity_tokens(instance) or None,
                "saved_ms": round(assessment.saved_ms, 1),
                "displace_ms": round(assessment.displace_ms, 1),
                "predicted_ttft_ms": _rounded({"queue": prediction.queue_ms, "prefill": prediction.prefill_ms,
                                               "transfer": prediction.transfer_ms,
                                               "total": prediction.total_ms})}


def _rounded(values: dict[str, float | None]) -> dict[str, float | None]:
    return {name: None if value is None else round(value, 1) for name, value in values.items()}


def affinity_report(scorer: AffinityScorer, view: LoadView, policy: KvAwarePolicy, active: bool,
                    query: Any) -> Any:
    """/debug/instance_loads's kv_aware part (routing.report.AffinityReport) for the request
    the query names, or None. `active`: kv_aware chooses (else the report shows what it would)."""
    request = debug_request(query)
    if request is None:
        return None

    def report(instances: Sequence[InstanceSlot], totals: list[float | None],
               inflight: list[int | None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assessments = scorer.assess(request, instances)
        span = 1 + max((i.slot for i in instances), default=-1)
        predicted = predictions(view, instances, span, inflight, assessments)
        bound = policy.spread_bound(assessments)
        guard = policy.guard([n for n, i in zip(inflight, instances) if i.alive], bound)
        rows = [scorer.report(request, i, a, p) for i, a, p in zip(instances, assessments, predicted)]
        return rows, {"active": active, "affinity_view": scorer.index.mode,
                      "request": {"knowledge": request.knowledge.knowledge_ids if request.knowledge else [],
                                  "prefix_blocks": len(scorer.prefix_of(request))},
                      "guard": {"fired": guard.fired, "reason": guard.reason, "spread": guard.spread,
                                "balance_abs": bound, "balance_rel": policy.balance_rel,
                                "slot_guard": policy.slot_guard,
                                "slots_taken": [i.instance_id for i, full in zip(instances, engines_full(
                                    instances, inflight)) if full and i.alive]}}
    return report


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
