"""IWS, the Injection Willingness Strategy (the original Proxy's name, PROXY_INJECTION_STRATEGY=
iws): choose text or kvcache injection per request by predicted cost (docs/architecture.md,
"Text or kvcache: IWS").

Pure arithmetic over the predictors, the chosen instance's predicted ready wait (from the
sidecar's snapshot), this worker's KV link timeline and the link itself (measured, static or
default: proxy_workers/kdn_links.py); no side effects, unlike the original (whose estimate
created reservation state).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cacheroute_proxy.config import Settings

from .kdn_links import KdnLink
from .request_model import KnowledgeSpec, ProxyRequest

KDN_FETCH_FIXED_MS = 3.0  # the original's fixed know-prepare cost on top of the RTT
NO_KNOWLEDGE = "no_rag_or_empty_knowledge"


class Decision(NamedTuple):
    mode: str  # "text" or "kvcache"
    reason: str
    text_total_ms: float
    kvcache_total_ms: float


def lacks_knowledge(spec: KnowledgeSpec | None) -> bool:
    """Nothing to inject: injection off, an empty list or no knowledge tokens. IWS then
    forces text (NO_KNOWLEDGE), whatever the Scheduler asked for."""
    return spec is None or not spec.wanted or spec.knowledge_tokens <= 0


def decide(request: ProxyRequest, ready_wait_ms: float, link_wait_ms: float, link: KdnLink,
           predictors: Any, settings: Settings, text_net_wait_ms: float = 0.0,
           resident_tokens: int = 0) -> Decision:
    """`link_wait_ms`: until the (instance, KDN) link is predicted free of every KV transfer
    reserved on it; `text_net_wait_ms`: until the KV transfer on the wire now is predicted to
    end (a text fetch shares the link with that one only, it queues behind none);
    `link`: the link's bandwidth and RTT; `resident_tokens`: knowledge the instance already
    holds KV for (the affinity index), which costs no transfer."""
    spec = request.knowledge
    prompt, knowledge = request.prompt_tokens, spec.knowledge_tokens if spec else 0
    text_service = predictors.text_service_ms(prompt, max(0, knowledge))
    if spec is None or lacks_knowledge(spec):
        return Decision("text", NO_KNOWLEDGE, text_service, float("nan"))
    kv = predictors.kvcache_service(prompt, knowledge)
    pulled = max(0, knowledge - resident_tokens)  # the KV moved: all of it, aligned or not
    kv_transfer = 0.0 if resident_tokens and not pulled else link.transfer_ms(predictors, pulled)
    rtt = link.latency_ms or 0.0  # the text path fetches from the KDN too: one round trip
    text_prepare_wait = (text_net_wait_ms + rtt + KDN_FETCH_FIXED_MS) if spec.kdn_addr else 0.0
    kvcache_prepare = link_wait_ms + kv_transfer
    text_total = max(text_prepare_wait, ready_wait_ms) + text_service
    kvcache_total = max(ready_wait_ms, kvcache_prepare) + kv.total_ms
    kvcache_score = kvcache_total + settings.iws_kdn_queue_penalty_alpha * link_wait_ms
    if kvcache_score + settings.iws_decision_margin_ms < text_total:
        reason = ("kvcache_hidden_and_score_better" if kvcache_prepare <= ready_wait_ms
                  else "kvcache_score_better")
        return Decision("kvcache", reason, text_total, kvcache_total)
    if link_wait_ms > 0:
        reason = "text_due_to_kdn_congestion"
    elif text_net_wait_ms > 0 and spec.kdn_addr:
        # No KV transfer is predicted to be queued, but one is still on the wire (it started
        # later or runs longer than predicted): text was chosen although its fetch waits too.
        reason = "text_despite_active_kv_wait"
    else:
        reason = "text_score_better"
    return Decision("text", reason, text_total, kvcache_total)
