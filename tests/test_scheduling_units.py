"""Units of the scheduling brain: release policies, IWS decisions, three-layer least_load."""

from __future__ import annotations

import asyncio
import time

import pytest

from cacheroute_proxy.config import Settings
from proxy_workers.predictors import get_predictors
from cacheroute_proxy.routing.least_load import LeastLoadPolicy
from cacheroute_proxy.routing.round_robin import RoundRobinPolicy
from proxy_workers.iws import decide
from proxy_workers.kdn_links import KdnLink
from proxy_workers.knowledge import KnowledgePreparer, LinkTimeline
from proxy_workers.pipeline import Job, Pipeline
from proxy_workers.release_order import ReleaseOrder, Ticket
from proxy_workers.request_model import Endpoint, recover
from proxy_workers.trace import Knowledge, Trace
from types import SimpleNamespace

import json


# --- release policies ---------------------------------------------------------------------------

def _scenario(policy: str, traces: dict[int, Trace] | None = None) -> list[int]:
    """Seq 1 (kvcache) is still preparing; 2 (text) and 3 (kvcache) are ready to go."""
    traces = traces if traces is not None else {}
    order = ReleaseOrder(policy, Settings().text_bypass_max_per_flush)
    tickets = {}
    for seq, kind in ((1, "kvcache"), (2, "text"), (3, "kvcache")):
        tickets[seq] = order.issue(traces.setdefault(seq, Trace()))
        tickets[seq].injection_type = kind
    released: list[int] = []
    for seq in (2, 3):
        order.offer(tickets[seq])
    released += [s for s, t in tickets.items() if t.released and s not in released]
    order.offer(tickets[1])  # the slow head finishes preparing
    released += [s for s, t in tickets.items() if t.released and s not in released]
    assert order.settled
    return released


def _released_as(traces: dict[int, Trace]) -> dict[int, tuple]:
    return {seq: (t.ready_release_seq, t.ready_release_policy, t.ready_bypass, t.ready_blocked_seq)
            for seq, t in traces.items()}


def test_ordered_release_waits_for_the_head():
    traces: dict[int, Trace] = {}
    assert _scenario("ordered", traces) == [1, 2, 3]
    assert _released_as(traces) == {1: (1, "ordered", False, None), 2: (2, "ordered", False, None),
                                    3: (3, "ordered", False, None)}


def test_text_bypass_lets_a_text_request_pass_a_blocked_head():
    traces: dict[int, Trace] = {}
    assert _scenario("text_bypass", traces) == [2, 1, 3]
    # 2 passed the blocked head (seq 1): released first, and says whom it passed.
    assert _released_as(traces) == {1: (2, "text_bypass", False, None),
                                    2: (1, "text_bypass", True, 1),
                                    3: (3, "text_bypass", False, None)}


def test_abandoned_ticket_does_not_wedge_the_ones_behind():
    order = ReleaseOrder("ordered", 1)
    first, second = order.issue(), order.issue()
    order.offer(second)
    assert not second.released
    order.abandon(first)  # the client of request 1 went away while it prepared
    assert second.released and order.settled


def test_a_waiter_wakes_when_released_and_a_cancelled_one_stays_unreleased():
    """A cancelled wait leaves its ticket unreleased, so the pipeline abandons it."""
    async def run() -> ReleaseOrder:
        order = ReleaseOrder("ordered", 1)
        head, behind, cancelled = order.issue(), order.issue(), order.issue()
        waiting = asyncio.create_task(order.wait(behind))
        gone = asyncio.create_task(order.wait(cancelled))
        await asyncio.sleep(0)
        assert not waiting.done() and not gone.done()
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert not cancelled.released
        order.abandon(cancelled)
        order.offer(head)
        await asyncio.wait_for(waiting, 1)
        assert head.released and behind.released
        return order
    assert asyncio.run(run()).settled


# --- IWS ------------------------------------------------------------------------------------------

def _scheduler_request(knowledge_tokens: int, kids: list[str], enabled: bool = True):
    body = {"Prompt": {"model": "m", "user_prompt": "q" * 200, "token_length": 50},
            "Service": {"Enable_know_injection": enabled, "Injection_type": "text",
                        "Knowledge_List": kids, "Knowledge_length": knowledge_tokens},
            "Task": {"KDN_server_addr": "127.0.0.1:9101"}}
    return recover(Endpoint.CHAT, json.dumps(body).encode())


PREDICTORS = get_predictors("llama3-70b-8x5090")
SETTINGS = Settings()
LINK = KdnLink(SETTINGS.kdn_default_bandwidth_mbps, 0.0, "default")


def test_iws_picks_kvcache_when_the_transfer_hides_a_long_prefill():
    decision = decide(_scheduler_request(4000, ["k1"]), 0.0, 0.0, LINK, PREDICTORS, SETTINGS)
    assert decision.mode == "kvcache" and decision.kvcache_total_ms + 100 < decision.text_total_ms


def test_iws_picks_text_when_the_kdn_link_is_congested():
    decision = decide(_scheduler_request(4000, ["k1"]), 0.0, 5000.0, LINK, PREDICTORS, SETTINGS)
    assert (decision.mode, decision.reason) == ("text", "text_due_to_kdn_congestion")


def test_iws_hides_the_transfer_behind_a_long_ready_wait():
    decision = decide(_scheduler_request(4000, ["k1"]), 10_000.0, 0.0, LINK, PREDICTORS, SETTINGS)
    assert (decision.mode, decision.reason) == ("kvcache", "kvcache_hidden_and_score_better")


@pytest.mark.parametrize("tokens, kids, enabled", [(0, ["k1"], True), (500, [], True), (500, ["k1"], False)])
def test_iws_without_rag_is_text(tokens, kids, enabled):
    decision = decide(_scheduler_request(tokens, kids, enabled), 0.0, 0.0, LINK, PREDICTORS, SETTINGS)
    assert (decision.mode, decision.reason) == ("text", "no_rag_or_empty_knowledge")


@pytest.mark.parametrize("tokens, kids, enabled", [(0, ["k1"], True), (500, [], True), (500, ["k1"], False)])
def test_iws_forces_text_over_the_schedulers_kvcache_without_knowledge(tokens, kids, enabled):
    """The pipeline asks IWS even when there is nothing to inject: the Scheduler's kvcache
    becomes text, with the reason in the trace (and a text request's release class)."""
    request = _scheduler_request(tokens, kids, enabled)
    request.knowledge.injection_type = "kvcache"
    pipeline = Pipeline(Settings(injection_strategy="iws"), events=None, preparer=None,  # type: ignore[arg-type]
                        predictors=PREDICTORS, pressure_of=lambda _: None)
    job = Job(request, Trace())
    ticket = Ticket(1, "kvcache")
    lease = SimpleNamespace(instance=SimpleNamespace(kv_inject=0, instance_id="i"))
    pipeline._decide_injection(lease, job, ticket)  # type: ignore[arg-type]
    assert (job.trace.injection_mode, job.trace.iws_reason, ticket.injection_type) == (
        "text", "no_rag_or_empty_knowledge", "text")


def test_iws_text_despite_a_kv_transfer_still_on_the_wire():
    """No KV transfer predicted queued (link wait 0), but one still on the wire: a text
    fetch would wait for it, and text is chosen anyway."""
    request = _scheduler_request(100, ["k1"])  # under one KV block: kvcache saves nothing
    assert decide(request, 0.0, 0.0, LINK, PREDICTORS, SETTINGS).reason == "text_score_better"
    decision = decide(request, 0.0, 0.0, LINK, PREDICTORS, SETTINGS, text_net_wait_ms=50.0)
    assert (decision.mode, decision.reason) == ("text", "text_despite_active_kv_wait")


def test_link_timeline_wire_wait_outlives_a_schedule_that_slipped():
    link = LinkTimeline()
    first_end = link.reserve(100.0, 1.0)  # predicted 100 -> 101
    second_end = link.reserve(100.0, 1.0)  # queued behind it: 101 -> 102
    assert (link.wait_s(100.0), link.net_wait_s(100.0)) == (2.0, 0.0)
    link.done(first_end, 101.5)  # the first ran 0.5 s long; the second starts at 101.5
    link.on_wire_until = 101.5 + 1.0
    assert second_end == 102.0
    assert (link.wait_s(102.2), round(link.net_wait_s(102.2), 6)) == (0.0, 0.3)


# --- least_load, three layers ---------------------------------------------------------------------

def _comps(**columns):
    return {name: list(values) for name, values in columns.items()}


def test_lower_inflight_wins_when_the_rest_is_equal():
    s = LeastLoadPolicy()
    comps = _comps(inflight=[2, 1], active_ready=[1, 1], pending_prefill_count=[1, 1],
                   predicted_total_backlog_ms=[300.0, 300.0])
    assert s.select(["a", "b"], comps) == "b"


def test_higher_pending_prefill_loses_at_equal_inflight():
    s = LeastLoadPolicy()
    comps = _comps(inflight=[1, 1], pending_prefill_count=[2, 0], active_decode_count=[0, 1])
    assert s.select(["a", "b"], comps) == "b"


def test_larger_predicted_backlog_loses_when_queues_read_zero():
    s = LeastLoadPolicy()
    comps = _comps(inflight=[1, 1], active_ready=[0, 0], ready_queue_depth=[0, 0],
                   prepare_queue_depth=[0, 0], predicted_total_backlog_ms=[2500.0, 100.0])
    assert s.select(["a", "b"], comps) == "b"


def test_fallback_order():
    s = LeastLoadPolicy()
    # predicted missing -> the queue-aware score decides
    queue_aware = _comps(inflight=[1, 1], active_ready=[2, 0],
                         pending_prefill_count=[None, None], predicted_total_backlog_ms=[None, None])
    assert s.select(["a", "b"], queue_aware) == "b"
    assert s.explain(0, queue_aware, {}, "x")["components"] == {"inflight": 1, "active_ready": 2}
    # queue hints missing -> inflight only
    assert s.select(["a", "b"], _comps(inflight=[0, 3], active_ready=[None, None])) == "a"
    # all unknown -> round-robin over everyone
    unknown = _comps(inflight=[None, None, None])
    assert [s.select(["a", "b", "c"], unknown) for _ in range(3)] == ["a", "b", "c"]
    # ties -> round-robin among the tied
    tied = _comps(inflight=[1, 1, 5])
    assert {s.select(["a", "b", "c"], tied) for _ in range(4)} == {"a", "b"}


def test_round_robin_ignores_hints():
    rr = RoundRobinPolicy()
    hints = _comps(inflight=[0, 100], pending_prefill_count=[0, 9])
    assert [rr.select(["a", "b"], hints) for _ in range(4)] == ["a", "b", "a", "b"]


def test_a_kv_inject_is_on_the_wire_while_the_instance_pulls(monkeypatch):
    """The KV pull marks the link as carrying a transfer (what a text fetch would meet) from
    its real start to its end, and the link reads idle again after. The link's times are the
    worker's own: a wall clock set back an hour meanwhile does not add an hour to its wait."""
    class _Ack:
        def __init__(self, gate: asyncio.Event) -> None:
            self.status, self._gate = 200, gate

        async def __aenter__(self) -> "_Ack":
            await self._gate.wait()
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def read(self) -> bytes:
            return b'{"ok": true}'

    async def run() -> tuple[float, float, float, str, float, float]:
        gate = asyncio.Event()
        session = SimpleNamespace(post=lambda url, json, timeout, **kw: _Ack(gate))
        preparer = KnowledgePreparer(SETTINGS, SimpleNamespace(session=session), PREDICTORS)
        request = _scheduler_request(4000, ["k1"])
        instance = SimpleNamespace(instance_id="i", host="127.0.0.1", port=9001, cp_port=9002,
                                   kv_inject=0)
        knowledge, trace = Knowledge(kv_ready_kids=["k1"]), Trace()
        pull = asyncio.create_task(preparer._kv_inject(request, instance, knowledge, trace))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        link = preparer.link("i", "127.0.0.1:9101")
        during = link.net_wait_s(link.clock())
        before_step = preparer.link_wait_ms("i", "127.0.0.1:9101")
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() - 3600)  # an NTP step back
        after_step = preparer.link_wait_ms("i", "127.0.0.1:9101")
        gate.set()
        await pull
        return (during, link.net_wait_s(link.clock()), link.on_wire_until, trace.kvcache_actual_path,
                before_step, after_step)

    during, after, on_wire, path, before_step, after_step = asyncio.run(run())
    assert during > 0 and (after, on_wire, path) == (0.0, 0.0, "kv_injected")
    assert 0 < after_step <= before_step
