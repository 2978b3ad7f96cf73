"""Knowledge preparation (docs/protocol.md, "Knowledge injection into the body" and "Knowledge"):
fetch from the KDN, classify, inject into the body, and on the kvcache path have the instance pull
prebuilt KV blocks first. The KDN (Knowledge Delivery Network) is the server that holds each
knowledge id's text and prebuilt KV.

Differences from the original, on purpose: the instance's control-plane port comes from its
registration (`meta.cp_port`) or `PROXY_INSTANCE_CP_PORT_OFFSET`, not a hard-coded 9002; every
call has a timeout; a failure never loses the request (it goes on without that knowledge and
the reason is in `cacheroute_meta.error`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.config import Settings
from cacheroute_proxy.kdn_wire import KnowledgeItem, decode_inject_ack, decode_search_reply
from cacheroute_proxy.pace import Pace
from shm_schema import InstanceSlot, layout

from .headers import Header
from .kdn_links import LinkTable
from .request_model import Endpoint, ProxyRequest
from .trace import Knowledge, Trace
from .traceparent import passed_on
from .upstream import base_url

NEED_FIELDS = ["content", "length", "rel_path", "kv_ready", "kv_rel_dir", "kv_dumped_keys", "kv_updated_at"]
# What a KV inject writes into the trace: cleared before the retry's inject on another instance.
_KV_TRACE_FIELDS = ("kdn_link_source", "kdn_link_wait_ms", "kv_ack_start_ms",
                    "kvcache_actual_path", "kv_ack_end_ms")
TEXT_PREAMBLE = ("You are a helpful assistant. Use the retrieved context below to answer the "
                 "user's question. If the context is irrelevant to the question, ignore it.")


class LinkTimeline:
    """KV transfers over one (instance, KDN) link: they run one at a
    time (the lock: serialized by real completion, not by a prediction that may be far off),
    and `free_at` predicts when the link frees, for IWS and the trace. Per worker: a host-wide
    link schedule would need the sidecar.

    `on_wire_until` predicts the end of the transfer on the wire now (0: none), from when it
    really started: behind a transfer that ran long it ends after `free_at` said, and a text
    fetch, which queues behind no KV transfer, still shares the link with it. `pace`: how much
    longer (or shorter) the link's transfers really take than the link's bandwidth predicts,
    learned from each acknowledged inject; kv_aware prices a transfer with it."""

    @staticmethod
    def clock() -> float:
        """The link's times never leave the worker: monotonic, so a wall clock set back (an NTP
        step) does not make the link look busy for as long."""
        return time.monotonic()

    def __init__(self, pace_step: float = 0.0) -> None:
        self.free_at = 0.0
        self.on_wire_until = 0.0
        self.lock = asyncio.Lock()
        self.pace = Pace(pace_step)

    def wait_s(self, now: float) -> float:
        return max(0.0, self.free_at - now)

    def net_wait_s(self, now: float) -> float:
        """Until the transfer on the wire now is predicted to end (what a text fetch meets)."""
        return max(0.0, self.on_wire_until - now)

    def reserve(self, now: float, transfer_s: float) -> float:
        """Predict this transfer behind the ones already queued; returns its predicted end."""
        self.free_at = max(now, self.free_at) + transfer_s
        return self.free_at

    def done(self, predicted_end: float, at: float) -> None:
        """A transfer finished at `at`: if nothing was queued after it, the link is free now
        (however long it was predicted to take)."""
        if self.free_at == predicted_end:
            self.free_at = at


class KnowledgePreparer:
    def __init__(self, settings: Settings, upstream: Any, predictors: Any,
                 links: LinkTable | None = None) -> None:
        self._settings = settings
        self._upstream = upstream  # its pooled session exists once the worker has started
        self._predictors = predictors
        self._timelines: dict[tuple[str, str], LinkTimeline] = {}
        # Bandwidth and RTT per (instance, KDN): what transfers are estimated over.
        self.kdn_links = links if links is not None else LinkTable.from_settings(settings)

    @property
    def _session(self) -> aiohttp.ClientSession:
        return self._upstream.session

    def link(self, instance_id: str, kdn_addr: str) -> LinkTimeline:
        key = (instance_id, kdn_addr or "unknown")
        timeline = self._timelines.get(key)
        if timeline is None:
            timeline = self._timelines[key] = LinkTimeline(self._settings.pace_step)
        return timeline

    def transfer_ms(self, instance_id: str, kdn_addr: str, tokens: int) -> float:
        """What a transfer of the KV of `tokens` knowledge tokens to the instance would take if
        asked now: the wait for this worker's transfers queued on the link, then the transfer at
        the pace the link has shown; 0 for nothing to transfer."""
        return self.link_wait_ms(instance_id, kdn_addr) + self.pull_ms(instance_id, kdn_addr, tokens) \
            if tokens else 0.0

    def link_wait_ms(self, instance_id: str, kdn_addr: str, queued_tokens: int = 0) -> float:
        """How long a transfer asked now would wait for the link: the longer of this worker's
        own queue, as its timeline predicts it, and the host's, `queued_tokens` of KV the
        requests of every worker routed there are still pulling (kv_aware's claims)."""
        link = self.link(instance_id, kdn_addr)
        own = link.wait_s(link.clock()) * 1000
        return max(own, self.pull_ms(instance_id, kdn_addr, queued_tokens))

    def pull_ms(self, instance_id: str, kdn_addr: str, tokens: int) -> float:
        """The transfer of the KV of `tokens` knowledge tokens over the link, once on the wire,
        at the pace the link has shown; 0 for nothing to transfer."""
        if not tokens:
            return 0.0
        estimate = self.kdn_links.link_for(instance_id, kdn_addr).transfer_ms(self._predictors, tokens)
        return self.link(instance_id, kdn_addr).pace.factor * estimate

    async def prepare(self, request: ProxyRequest, instance: InstanceSlot, trace: Trace,
                      spans: Any = None, client_headers: Sequence[Header] = (),
                      resident: tuple[str, ...] = ()) -> Knowledge:
        """The KDN and the instance's control plane get a traceparent: with spans on
        (`spans`, a RequestSpans) their own span's, else the client's as it came.
        `resident`: knowledge ids the affinity index says the instance already holds KV for:
        their text is still fetched (the prompt carries it), their KV is not pulled again."""
        spec = request.knowledge
        result = Knowledge()
        if spec is None or not spec.wanted or request.body is None:
            return result
        try:
            trace.kdn_fetch_start_ms = now_ms()
            items, result.miss_kids = await self._fetch(
                spec.kdn_addr, spec.knowledge_ids,
                spans.kdn_headers() if spans is not None else passed_on(client_headers))
            trace.kdn_fetch_end_ms = now_ms()
            context = self._classify(spec.knowledge_ids, items, result)
            if context:
                _inject(request, context, spec.injection_type)
            if spec.injection_type == "kvcache":
                held = {kid.lower() for kid in resident}
                result.resident_kids = [kid for kid in result.kv_ready_kids if kid.lower() in held]
                await self._kv_inject(request, instance, result, trace,
                                      spans.kv_inject_headers if spans is not None
                                      else lambda: passed_on(client_headers))
        except Exception as exc:  # knowledge is best effort: the request goes on without it
            result.error = f"prepare_failed: {type(exc).__name__}: {exc}"
        return result

    async def _fetch(self, kdn_addr: str, kids: list[str],
                     headers: dict[str, str] | None = None) -> tuple[dict[str, KnowledgeItem], list[str]]:
        if not kdn_addr:
            return {}, list(kids)
        url = f"http://{kdn_addr}/knowledge/search/text"
        async with self._session.post(url, json={"knowledge_ids": [str(k) for k in kids],
                                                 "need_fields": NEED_FIELDS}, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=self._settings.kdn_timeout_s)) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"KDN search answered {resp.status}")
            reply = decode_search_reply(await resp.read())
        items = {item.key.lower(): item for item in reply.found if item.key is not None}
        return items, list(reply.missing)

    @staticmethod
    def _classify(kids: list[str], items: dict[str, KnowledgeItem], result: Knowledge) -> str:
        """Request order: missing, kv-ready, text-only; context = kv-ready then text-only."""
        missing = {m.lower() for m in result.miss_kids}
        kv_texts, text_texts = [], []
        for kid in kids:
            item = items.get(str(kid).lower())
            if item is None or str(kid).lower() in missing:
                if kid not in result.miss_kids:
                    result.miss_kids.append(kid)
                continue
            content = (item.content or "").strip()
            if item.kv_ready:
                result.kv_ready_kids.append(kid)
                kv_texts.append(content)
            else:
                result.text_only_kids.append(kid)
                text_texts.append(content)
        return "\n".join(t for t in kv_texts + text_texts if t)

    async def _kv_inject(self, request: ProxyRequest, instance: InstanceSlot, result: Knowledge,
                         trace: Trace,
                         trace_headers: Callable[[], dict[str, str] | None] = lambda: None) -> None:
        spec = request.knowledge
        assert spec is not None
        if not result.kv_ready_kids:
            result.kv_ack = _ack(True, "no kv_ready_kids", result)
            return
        predictors = self._predictors
        effective = predictors.effective_knowledge_tokens(spec.knowledge_tokens)
        if len(result.resident_kids) == len(result.kv_ready_kids):
            # Every kv-ready id is resident on the instance: nothing to pull, no KDN transfer.
            result.kv_ack = {**_ack(True, "resident on the instance", result),
                             "injected_kids": [], "resident_kids": list(result.resident_kids)}
            result.prefix_tokens = effective
            trace.kvcache_actual_path = "kv_resident"
            return
        pulled = len(result.kv_ready_kids) - len(result.resident_kids)
        # The instance pulls the knowledge's whole KV (and holds it all, as the affinity index
        # counts it); only its aligned part (`effective`) spares prefill.
        transfer_tokens = spec.tokens_of(pulled)
        kdn_link = self.kdn_links.link_for(instance.instance_id, spec.kdn_addr)
        trace.kdn_link_source = kdn_link.source
        transfer_s = kdn_link.transfer_ms(predictors, transfer_tokens) / 1000  # the same estimate as IWS's
        link = self.link(instance.instance_id, spec.kdn_addr)
        queued_at = link.clock()
        predicted_end = link.reserve(queued_at, transfer_s)
        async with link.lock:
            started = link.clock()
            trace.kdn_link_wait_ms = int((started - queued_at) * 1000)
            link.on_wire_until = started + transfer_s
            try:
                await self._inject(request, instance, result, trace, effective, trace_headers)
            finally:
                link.on_wire_until = 0.0
                ended = link.clock()
                link.done(predicted_end, ended)
            if trace.kvcache_actual_path == "kv_injected":
                link.pace.observe(transfer_s, ended - started)

    async def reinject(self, request: ProxyRequest, instance: InstanceSlot, result: Knowledge,
                       trace: Trace, spans: Any = None,
                       client_headers: Sequence[Header] = (), resident: tuple[str, ...] = ()) -> None:
        """A retry on another instance: the body already holds the context (no KDN fetch
        again), but the KV went to the instance that failed; have this one pull it (what it
        does not hold already: `resident`), so the ack, the prefix and the trace's KV fields
        describe the instance that serves."""
        result.prefix_tokens = 0
        result.kv_ack = {}
        held = {kid.lower() for kid in resident}
        result.resident_kids = [kid for kid in result.kv_ready_kids if kid.lower() in held]
        for name in _KV_TRACE_FIELDS:
            setattr(trace, name, None)
        if instance.kv_inject == layout.KV_INJECT_NO:
            result.kv_ack = _ack(False, "instance_cannot_pull_kv", result)
            trace.kvcache_actual_path = "recompute"
            return
        try:
            await self._kv_inject(request, instance, result, trace,
                                  spans.kv_inject_headers if spans is not None
                                  else lambda: passed_on(client_headers))
        except Exception as exc:  # as in prepare: the request goes on, the instance recomputes
            result.kv_ack = _ack(False, f"{type(exc).__name__}: {exc}", result)
            trace.kvcache_actual_path = "recompute"

    async def _inject(self, request: ProxyRequest, instance: InstanceSlot, result: Knowledge,
                      trace: Trace, effective: int,
                      trace_headers: Callable[[], dict[str, str] | None]) -> None:
        spec = request.knowledge
        assert spec is not None
        trace.kv_ack_start_ms = now_ms()
        headers = trace_headers()  # after the start is known: a span starts from it
        cp_port = instance.cp_port or instance.port + self._settings.instance_cp_port_offset
        url = f"{base_url(instance.host, cp_port)}/v1/kv/inject_ready"
        resident = set(result.resident_kids)
        body = {"request_id": request.request_id, "kdn_addr": spec.kdn_addr,
                "model": request.model,
                "knowledge_ids": [kid for kid in result.kv_ready_kids if kid not in resident]}
        try:
            async with self._session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(
                    total=self._settings.kv_inject_timeout_s)) as resp:
                ack, as_sent = decode_inject_ack(await resp.read())
                if resp.status >= 400 or not ack.ok:
                    raise RuntimeError(f"KV inject answered {resp.status}: {ack.detail}")
            result.kv_ack = as_sent
            result.prefix_tokens = effective
            trace.kvcache_actual_path = "kv_injected"
        except Exception as exc:
            result.kv_ack = _ack(False, f"{type(exc).__name__}: {exc}", result)
            trace.kvcache_actual_path = "recompute"  # the instance prefills the text instead
        finally:
            trace.kv_ack_end_ms = now_ms()


def _inject(request: ProxyRequest, context: str, mode: str) -> None:
    """Put the context where the instance (and, for kvcache, the KDN's prebuilt KV) expects it."""
    body = request.body
    assert body is not None
    if request.endpoint is Endpoint.CHAT:
        if mode == "kvcache":
            system = context  # byte for byte what the KDN prebuilt, for a prefix hit
        else:
            system = f"{TEXT_PREAMBLE}\n\n### Retrieved Context\n{context}"
        body["messages"] = [{"role": "system", "content": system}, *body["messages"]]
    elif mode == "kvcache":
        body["prompt"] = f"{context}\n{body['prompt']}"
    else:
        body["prompt"] = f"{TEXT_PREAMBLE}\n\n{context}\n\n### User Prompt\n{body['prompt']}"


def _ack(ok: bool, detail: str, result: Knowledge) -> dict[str, Any]:
    return {"ok": ok, "injected_kids": [],
            "text_only_kids": ([] if ok else result.kv_ready_kids) + result.text_only_kids,
            "miss_kids": result.miss_kids, "keys_injected": 0, "detail": detail}

