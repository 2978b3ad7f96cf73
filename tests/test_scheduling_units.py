"""Units of the scheduling brain: release policies, IWS decisions, three-layer least_load."""

from __future__ import annotations

import asyncio

import pytest

from cacheroute_proxy.config import Settings
from proxy_workers.predictors import get_predictors
from cacheroute_proxy.routing.strategies import LeastLoadStrategy, RoundRobinStrategy
from proxy_workers.iws import decide
from proxy_workers.kdn_links import KdnLink
from proxy_workers.pipeline import InstanceStages, Pipeline, _Ticket
from proxy_workers.request_model import Endpoint, recover

import json


# --- release policies ---------------------------------------------------------------------------

def _pipeline(policy: str) -> Pipeline:
    return Pipeline(Settings(ready_release_policy=policy), tracker=None, preparer=None,  # type: ignore[arg-type]
                    predictors=None, pressure_of=lambda _: None)


def _scenario(policy: str) -> list[int]:
    """Seq 1 (kvcache) is still preparing; 2 (text) and 3 (kvcache) are ready to go."""
    async def run() -> list[int]:
        pipeline = _pipeline(policy)
        stages = InstanceStages(asyncio.Semaphore(8))
        loop = asyncio.get_running_loop()
        tickets = {seq: _Ticket(seq, kind, loop.create_future())
                   for seq, kind in ((1, "kvcache"), (2, "text"), (3, "kvcache"))}
        stages.next_seq = 4
        released: list[int] = []
        for seq in (2, 3):
            stages.waiting[seq] = tickets[seq]
            pipeline._flush(stages)
        released += [s for s, t in tickets.items() if t.released.done() and s not in released]
        stages.waiting[1] = tickets[1]  # the slow head finishes preparing
        pipeline._flush(stages)
        released += [s for s, t in tickets.items() if t.released.done() and s not in released]
        assert stages.next_release == 4 and not stages.waiting and not stages.done
        return released
    return asyncio.run(run())


def test_ordered_release_waits_for_the_head():
    assert _scenario("ordered") == [1, 2, 3]


def test_text_bypass_lets_a_text_request_pass_a_blocked_head():
    assert _scenario("text_bypass") == [2, 1, 3]


def test_abandoned_ticket_does_not_wedge_the_ones_behind():
    async def run() -> bool:
        pipeline = _pipeline("ordered")
        stages = InstanceStages(asyncio.Semaphore(8))
        loop = asyncio.get_running_loop()
        first, second = (_Ticket(s, "kvcache", loop.create_future()) for s in (1, 2))
        stages.next_seq = 3
        stages.waiting[2] = second
        pipeline._flush(stages)
        assert not second.released.done()
        pipeline._abandon(stages, first)  # the client of request 1 went away while it prepared
        return second.released.done() and stages.next_release == 3
    assert asyncio.run(run())


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


# --- least_load, three layers ---------------------------------------------------------------------

def _comps(**columns):
    return {name: list(values) for name, values in columns.items()}


def test_lower_inflight_wins_when_the_rest_is_equal():
    s = LeastLoadStrategy()
    comps = _comps(inflight=[2, 1], active_ready=[1, 1], pending_prefill_count=[1, 1],
                   predicted_total_backlog_ms=[300.0, 300.0])
    assert s.select(["a", "b"], comps) == "b"


def test_higher_pending_prefill_loses_at_equal_inflight():
    s = LeastLoadStrategy()
    comps = _comps(inflight=[1, 1], pending_prefill_count=[2, 0], active_decode_count=[0, 1])
    assert s.select(["a", "b"], comps) == "b"


def test_larger_predicted_backlog_loses_when_queues_read_zero():
    s = LeastLoadStrategy()
    comps = _comps(inflight=[1, 1], active_ready=[0, 0], ready_queue_depth=[0, 0],
                   prepare_queue_depth=[0, 0], predicted_total_backlog_ms=[2500.0, 100.0])
    assert s.select(["a", "b"], comps) == "b"


def test_fallback_order():
    s = LeastLoadStrategy()
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
    rr = RoundRobinStrategy()
    hints = _comps(inflight=[0, 100], pending_prefill_count=[0, 9])
    assert [rr.select(["a", "b"], hints) for _ in range(4)] == ["a", "b", "a", "b"]
