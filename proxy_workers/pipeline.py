"""The prepare/ready pipeline of one worker, without the original's stalls.

    prepare (PREPARE_CONCURRENCY per instance in this worker: KDN fetch, injection, KV inject)
    -> release in prepare order (`ordered`) or let text requests pass a blocked head
       (`text_bypass`)  -> reservation event to the sidecar
    -> ready admission: a host-wide counter in the slot, so N workers together never forward
       more than READY_CONCURRENCY requests to one instance
    -> forward (the caller), first-token and completion events.

Every wait has a deadline (PROXY_QUEUE_TIMEOUT_S, 503 + Retry-After), every per-instance queue
a bound (PROXY_MAX_QUEUE_PER_INSTANCE, 429 + Retry-After), and every counter entered is left
in a `finally` (the Lease leaves whatever is still held). There is no dispatch spacing and no
one-at-a-time gate: admission is the only limit.

The release order is release_order.py, the wait for admission within the worker admission.py;
this module runs the stages of one request through them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import msgspec

from cacheroute_proxy import clock
from cacheroute_proxy.clock import now_ms
from cacheroute_proxy.config import Settings
from shm_schema import Admission, InstanceSlot, layout

from . import metrics
from .admission import POLL_S, POLL_S_WITH_BELLS, AdmissionQueue
from .admission_bell import AdmissionBells
from .affinity import AffinityScorer
from .event_channel import EventChannelWriter
from .iws import NO_KNOWLEDGE, decide, lacks_knowledge
from .knowledge import KnowledgePreparer
from .refusals import instance_left, queue_full, queue_timeout
from .release_order import ReleaseOrder, Ticket
from .request_model import ProxyRequest
from .router import Lease
from .trace import EMPTY_KNOWLEDGE, Knowledge, Trace, tenths

T = TypeVar("T")


@dataclass
class InstanceStages:
    """This worker's per-instance state: prepare limit, release order, admission wake-ups."""

    prepare_slots: asyncio.Semaphore
    order: ReleaseOrder
    queued: int = 0
    admission: AdmissionQueue = field(default_factory=AdmissionQueue)
    ready_places: set[int] = field(default_factory=set)  # ready_worker_idx values held now


class Job(msgspec.Struct):
    """One request's state across its attempts: what the pipeline and the exchange share.
    The trace and the knowledge are reported in cacheroute_meta. A Struct: one per request,
    built without a Python-level __init__."""

    request: ProxyRequest
    trace: Trace
    key: int = 0  # the event channel's key of the current attempt
    knowledge: Knowledge = msgspec.field(default_factory=Knowledge)
    prepared: bool = False  # a retry on another instance does not fetch and inject again...
    # ...but the KV went to the instance of this key (slot, generation): a retry elsewhere has
    # the instance that serves pull it (KnowledgePreparer.reinject).
    kv_instance: tuple[int, int] | None = None
    predicted_first_token_ms: float | None = None  # wall ms, when a fresh snapshot allowed it
    # The lean path books the request with the sidecar once it has left for the instance
    # (`Pipeline.book_sent`, which the exchange hands to Upstream.send): its predictions are
    # off the way to the instance. True until then: an attempt that never left has no booking.
    book_when_sent: bool = False
    stages: Any = None  # the InstanceStages of the current attempt's instance (Pipeline.forwarded)
    spans: Any = None  # the request's RequestSpans (proxy_workers/spans.py) when spans are on
    client_headers: Any = ()  # the client's, as ASGI gave them: the KDN's traceparent without spans


class Pipeline:
    def __init__(self, settings: Settings, events: EventChannelWriter, preparer: KnowledgePreparer,
                 predictors: Any, pressure_of: Any, affinity: AffinityScorer | None = None,
                 bells: AdmissionBells | None = None,
                 booking_of: Callable[[InstanceSlot, int], tuple[float | None, int]] | None = None) -> None:
        self._settings = settings
        self._affinity = affinity  # told what each instance now holds
        self._events = events
        self._preparer = preparer
        self._predictors = predictors
        self._pressure_of = pressure_of  # (InstanceSlot) -> predicted ready wait ms, or None
        # (InstanceSlot, now µs) -> (its pressure, the batch a request sent there decodes in):
        # one read for the booking (LoadView.booking); without one, the pressure and a batch of 1.
        self._booking_of = booking_of or (lambda instance, now_us: (pressure_of(instance), 1))
        self._stages: dict[tuple[int, int], InstanceStages] = {}
        self.plain_path = 0  # attempts admitted the lean way (admit_plain)
        # Other workers' releases wake this worker's waiters by its bell, or are polled for.
        self.bells = bells
        self._poll_s = POLL_S if bells is None else POLL_S_WITH_BELLS

    def listen(self) -> None:
        """On the running loop: another worker's ring about a slot wakes its waiters here."""
        if self.bells is not None:
            self.bells.listen(self._wake_waiters)

    def _wake_waiters(self, slot: int) -> None:
        for (waiting_slot, _), stages in self._stages.items():
            if waiting_slot == slot:
                stages.admission.wake()

    def describe_admission(self) -> dict[str, int]:
        """What waiting for ready admission has cost this worker: tries and rings."""
        tries = sum(stages.admission.tries for stages in self._stages.values())
        return {"tries": tries, **({} if self.bells is None else self.bells.describe())}

    def _stages_for(self, lease: Lease) -> InstanceStages:
        key = (lease.instance.slot, lease.instance.generation)
        stages = self._stages.get(key)
        if stages is None:
            if len(self._stages) > 4 * 1024:  # forget instances long gone
                self._stages = {k: v for k, v in self._stages.items() if v.queued}
            settings = self._settings
            stages = self._stages[key] = InstanceStages(
                asyncio.Semaphore(settings.prepare_concurrency),
                ReleaseOrder(settings.ready_release_policy, settings.text_bypass_max_per_flush),
                admission=AdmissionQueue(self._poll_s))
        return stages

    def admit_at_once(self, lease: Lease, job: Job) -> bool:
        """The lean path (`admit_plain`) for a request the exchange runs: True when a plain
        request was admitted at once; the caller then forwards it and calls `forwarded` after,
        with no frame of the pipeline's between the two. False, with nothing done:
        `run_admitted` takes the request."""
        job.book_when_sent = False
        if job.request.knowledge is not None:
            return False
        admitted = self.admit_plain(lease, job.trace)
        if admitted is None:
            return False
        job.stages, job.key = admitted
        job.prepared = job.book_when_sent = True
        self._forwarding(lease, job)
        return True

    async def run_admitted(self, lease: Lease, job: Job, forward: Callable[[], Awaitable[T]]) -> T:
        """The full pipeline: prepare, wait for the turn and for admission; then `forward()`;
        clean up on exit. (A coroutine taking the work, not an async context manager: one
        frame less per request.)"""
        settings = self._settings
        stages = job.stages = self._stages_for(lease)
        if stages.queued >= settings.max_queue_per_instance:
            metrics.admission_rejected(lease.instance.instance_id, "queue_full")
            raise queue_full(f"{stages.queued} requests already wait for {lease.instance.instance_id}")
        stages.queued += 1
        ticket = stages.order.issue(job.trace)
        job.trace.prepare_seq = ticket.seq
        job.trace.proxy_enqueue_ms = now_ms()
        job.key = self._events.new_key()
        reserved = False
        try:
            try:
                reserved, admitted = self._without_waiting(lease, stages, job, ticket)
                if not admitted:  # something waits: now the queue timeout is needed
                    async with asyncio.timeout(settings.queue_timeout_s):
                        if not job.prepared:
                            await self._prepare(lease, stages, job)
                            job.prepared = True
                        elif _kv_elsewhere(lease, job):
                            await self._prepare(lease, stages, job, reinject=True)
                        await stages.order.wait(ticket)
                        if not reserved:
                            self._reserve(lease, job)
                            reserved = True
                        await self._admit(lease, stages, job)
            except TimeoutError:
                metrics.admission_rejected(lease.instance.instance_id, "queue_timeout")
                raise queue_timeout(f"not admitted to {lease.instance.instance_id} within "
                                    f"{settings.queue_timeout_s:g}s") from None
            finally:
                stages.queued -= 1
                if not ticket.released:
                    stages.order.abandon(ticket)
            failed = True
            try:
                self._forwarding(lease, job)
                result = await forward()
                failed = False
                return result
            finally:
                self.forwarded(lease, job, failed)
        except BaseException:
            if reserved:
                self._events.complete(job.key, True)
            raise

    def admit_plain(self, lease: Lease, trace: Trace) -> tuple[InstanceStages, int] | None:
        """The lean path of a request with no knowledge: when nothing of this worker's waits for
        the instance (no turn to keep, nobody queued for admission) and the instance admits it
        at once, it is released, reserved and admitted here, with the trace of the full path's
        no-wait case but none of its machinery: the instance's stages and the request's event
        key. The caller books it once sent (`book`) and gives its place back after
        (`leave_ready`). None, with nothing done, otherwise: the full path runs."""
        stages = self._stages_for(lease)
        if stages.queued or stages.admission.busy or not stages.order.settled:
            return None
        if lease.try_admit(layout.LANE_READY_ACTIVE, self._settings.ready_concurrency) \
                is not Admission.ADMITTED:
            return None
        self.plain_path += 1
        # One instant: entered, prepared (nothing to do), released and admitted in one step.
        trace.proxy_enqueue_ms = trace.prepare_dequeue_ms = trace.prepare_start_ms = \
            trace.prepare_self_done_ms = trace.ready_enqueue_ms = trace.ready_dequeue_ms = now_ms()
        trace.prepare_seq = stages.order.pass_through(trace)
        _take_ready_place(stages, trace)
        return stages, self._events.new_key()

    def forwarded(self, lease: Lease, job: Job, failed: bool) -> None:
        """After the forward (`failed`: it raised) of a request admitted on `lease`'s instance:
        `leave_ready`. The caller's when `admit_at_once` admitted it."""
        self.leave_ready(lease, job.stages, job.trace.ready_worker_idx, job.key, failed,
                         booked=not job.book_when_sent)

    def leave_ready(self, lease: Lease, stages: InstanceStages, place: int | None, key: int,
                    failed: bool, booked: bool) -> None:
        """The ready place (`place`, the trace's ready_worker_idx) and the lane given back, the
        next waiter for admission woken, and the request's timeline entry (`key`) ended if it
        was `booked` (else it never left, and the sidecar never heard of it)."""
        stages.ready_places.discard(place)  # type: ignore[arg-type]
        lease.leave(layout.LANE_READY_ACTIVE)
        stages.admission.wake()
        bells = self.bells
        if bells is not None and bells.others_wait(lease.instance, len(stages.admission)):
            bells.ring_others(lease.instance.slot)
        if booked:
            self._events.complete(key, failed)

    def _forwarding(self, lease: Lease, job: Job) -> None:
        """The instance is about to hold the request's prompt prefix (vLLM's prefix cache keeps
        each full block once its prefill computed it, long before the answer ends). Reported as
        it is sent, as SGLang's and vllm-router's cache-aware routers insert at selection: were it
        reported after the answer, every request sharing the prefix that arrived meanwhile would
        get no credit and go by load alone, spreading a shared system prompt over every engine."""
        if self._affinity is not None and job.request.prefix_keys:
            self._affinity.forwarding(lease.instance, job.request, lease.claim)

    async def _resident(self, lease: Lease, job: Job) -> tuple[str, ...]:
        """The knowledge the instance holds as the prepare stage starts: what the index confirmed
        when it was chosen, and what other requests were pulling into it then, once their pulls
        have ended (so it is not pulled twice at once)."""
        spec, claimed = job.request.knowledge, lease.claimed_kids
        if self._affinity is None or not claimed or spec is None or spec.injection_type != "kvcache":
            return lease.resident_kids
        return lease.resident_kids + await self._affinity.pulled_meanwhile(
            lease.instance, job.request, lease.claim, claimed)

    def _prepared(self, lease: Lease, job: Job) -> None:
        knowledge = job.knowledge
        if self._affinity is not None:
            self._affinity.prepared(lease.instance, job.request, lease.claim,
                                    knowledge.kv_ready_kids if knowledge.kv_ack.get("ok") else ())

    def first_token(self, key: int) -> None:
        """The request of event key `key` saw its first token."""
        self._events.first_token(key)

    # --- stages ------------------------------------------------------------------------------
    def _without_waiting(self, lease: Lease, stages: InstanceStages, job: Job,
                         ticket: Ticket) -> tuple[bool, bool]:
        """The common case needs no await, so no timer for the queue timeout: nothing to
        prepare (and a free prepare slot), the turn at once, admission at once. Goes as far as
        it can without waiting; returns (reserved, admitted), and the waiting path goes on from
        there."""
        request, trace = job.request, job.trace
        if not job.prepared:
            self._decide_injection(lease, job, ticket)
            spec = request.knowledge
            if (spec is not None and spec.wanted and request.body is not None) \
                    or stages.prepare_slots.locked():
                return False, False
            # Nothing to prepare and a free slot: the prepare lanes would be entered and left
            # without a wait in between, invisible to every reader, so they are skipped.
            trace.prepare_dequeue_ms = trace.prepare_start_ms = trace.prepare_self_done_ms = now_ms()
            job.prepared = True
        elif _kv_elsewhere(lease, job):
            return False, False  # a retry: this instance must pull the KV first
        stages.order.offer(ticket)
        if not ticket.released:
            return False, False
        self._reserve(lease, job)
        if stages.admission.busy or lease.try_admit(layout.LANE_READY_ACTIVE,
                                                    self._settings.ready_concurrency) \
                is not Admission.ADMITTED:
            return True, False  # full (wait) or stale (_admit says so)
        trace.ready_dequeue_ms = now_ms()
        _take_ready_place(stages, trace)
        return True, True

    def _decide_injection(self, lease: Lease, job: Job, ticket: Ticket) -> None:
        """IWS picks text or kvcache by predicted cost; the choice sets the release class."""
        request, trace = job.request, job.trace
        spec = request.knowledge
        if spec is None:  # a plain OpenAI body: no knowledge, nothing to decide
            return
        iws = self._settings.injection_strategy == "iws"
        if iws and lacks_knowledge(spec):
            # Injection off, no ids or no knowledge tokens: text, whatever the Scheduler said.
            spec.injection_type = "text"
            trace.iws_reason = NO_KNOWLEDGE
        elif spec.wanted and lease.instance.kv_inject == layout.KV_INJECT_NO:
            # The instance says it cannot pull KV: an ack would never come, so text it is.
            spec.injection_type = "text"
            trace.iws_reason = "instance_cannot_pull_kv"
        elif iws:
            ready_wait = self._pressure_of(lease.instance) or 0.0
            instance_id = lease.instance.instance_id
            timeline = self._preparer.link(instance_id, spec.kdn_addr)
            kdn_link = self._preparer.kdn_links.link_for(instance_id, spec.kdn_addr)
            now = timeline.clock()
            resident = len(lease.resident_kids)
            decision = decide(request, ready_wait, timeline.wait_s(now) * 1000, kdn_link,
                              self._predictors, self._settings, timeline.net_wait_s(now) * 1000,
                              resident_tokens=spec.tokens_of(resident))
            spec.injection_type = decision.mode
            trace.iws_reason = decision.reason
            trace.kdn_link_source = kdn_link.source
        ticket.injection_type = spec.injection_type
        trace.injection_mode = spec.injection_type

    async def _prepare(self, lease: Lease, stages: InstanceStages, job: Job,
                       reinject: bool = False) -> None:
        """Fetch, inject into the body and (kvcache) have the instance pull the KV; with
        `reinject` (a retry on another instance), only the pull, by this instance."""
        request, trace = job.request, job.trace
        trace.prepare_dequeue_ms = now_ms()
        lease.enter(layout.LANE_PREPARE_WAITING)
        try:
            await stages.prepare_slots.acquire()
        finally:
            lease.leave(layout.LANE_PREPARE_WAITING)
        lease.enter(layout.LANE_PREPARE_ACTIVE)
        try:
            trace.prepare_start_ms = now_ms()
            if reinject:
                await self._preparer.reinject(request, lease.instance, job.knowledge, trace,
                                              job.spans, job.client_headers,
                                              resident=lease.resident_kids)
            else:
                job.knowledge = await self._preparer.prepare(request, lease.instance, trace,
                                                             job.spans, job.client_headers,
                                                             resident=await self._resident(lease, job))
            if job.knowledge.kv_ack and job.knowledge.kv_ready_kids:
                job.kv_instance = (lease.instance.slot, lease.instance.generation)
            trace.prepare_self_done_ms = now_ms()
            self._prepared(lease, job)
        finally:
            stages.prepare_slots.release()
            lease.leave(layout.LANE_PREPARE_ACTIVE)

    def _reserve(self, lease: Lease, job: Job) -> None:
        """The request is released to ready: stamped, and booked with the sidecar."""
        job.trace.ready_enqueue_ms = now_ms()
        self._book(lease, job)

    def book_sent(self, lease: Lease, job: Job) -> None:
        """The lean path's booking, once the request has left (Job.book_when_sent)."""
        job.book_when_sent = False
        self._book(lease, job)

    def _book(self, lease: Lease, job: Job) -> None:
        job.predicted_first_token_ms = self.book(lease, job.request, job.trace, job.key, job.knowledge)

    def book(self, lease: Lease, request: ProxyRequest, trace: Trace, key: int,
             knowledge: Knowledge = EMPTY_KNOWLEDGE) -> float | None:
        """Tell the sidecar the request of event key `key` is released to ready, with its
        predicted service (and the trace, what was predicted); when its first token is
        predicted (wall ms), if a fresh snapshot allowed it."""
        predictors = self._predictors
        knowledge_tokens = request.knowledge.knowledge_tokens if request.knowledge else 0
        if knowledge.prefix_tokens:  # the instance holds the knowledge's KV: pull + residual prefill
            service = predictors.kvcache_service(request.prompt_tokens, knowledge_tokens).total_ms
        elif knowledge.kv_ready_kids or knowledge.text_only_kids:  # knowledge text in the prompt
            service = predictors.text_service_ms(request.prompt_tokens, knowledge_tokens)
        else:  # less the prompt's leading blocks the instance holds (kv_aware knows them)
            held = 0 if lease.choice.affinity is None else lease.choice.affinity.held_tokens
            service = predictors.text_service_ms(request.prompt_tokens - held, 0)
        # In the batch it joins: decode slows with the batch (the profile's tpot by batch size),
        # and the slots a burst waits for are held that long.
        now_us = clock.now_us()  # one instant for the prediction and the reservation
        ready_wait, batch = self._booking_of(lease.instance, now_us)
        decode = predictors.decode_ms(request.prompt_tokens + knowledge_tokens, request.decode_tokens, batch)
        trace.predict_service_ms = tenths(service)
        trace.predict_decode_ms = tenths(decode)
        know_prepare = trace.ready_enqueue_ms - (trace.proxy_enqueue_ms or trace.ready_enqueue_ms)  # type: ignore[operator]
        trace.actual_know_prepare_ms = know_prepare
        predicted = None
        if ready_wait is not None:
            trace.predict_queue_wait_ms = tenths(ready_wait)
            trace.predict_total_ms = tenths(know_prepare + ready_wait + service)
            predicted = now_us / 1000 + ready_wait + service
            trace.pred_first_token_ts_ms = int(predicted)
        self._events.reserve(key, lease.instance.slot, lease.instance.generation, service,
                             decode, request.decode_tokens, request.prompt_tokens, now_us)
        return predicted

    async def _admit(self, lease: Lease, stages: InstanceStages, job: Job) -> None:
        limit = self._settings.ready_concurrency
        # Behind earlier waiters of this worker, never ahead of them (FIFO within the worker).
        result = Admission.FULL if stages.admission.busy else lease.try_admit(layout.LANE_READY_ACTIVE, limit)
        if result is Admission.FULL:
            # Counted as waiting only while it waits: entering and leaving the lane around an
            # admission that succeeds at once would be invisible to every reader anyway.
            lease.enter(layout.LANE_READY_WAITING)
            try:
                result = await stages.admission.wait(
                    lambda: lease.try_admit(layout.LANE_READY_ACTIVE, limit))
            finally:
                lease.leave(layout.LANE_READY_WAITING)
        if result is Admission.STALE:
            raise instance_left()
        job.trace.ready_dequeue_ms = now_ms()
        _take_ready_place(stages, job.trace)


def _take_ready_place(stages: InstanceStages, trace: Trace) -> None:
    """The lowest ready place of this worker's for the instance not held (ready_worker_idx)."""
    places = stages.ready_places
    index = 0
    while index in places:
        index += 1
    places.add(index)
    trace.ready_worker_idx = index


def _kv_elsewhere(lease: Lease, job: Job) -> bool:
    """A retry whose KV was pulled by another instance than this attempt's."""
    kv_instance = job.kv_instance
    return kv_instance is not None and kv_instance != (lease.instance.slot, lease.instance.generation)

