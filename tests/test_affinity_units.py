"""kv_aware's parts without processes: the keys, the sidecar's LRU models and what they publish,
the per-worker view, the assessment's arithmetic, and the settings' validation."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import pytest

from cacheroute_proxy import engine_prefix
from cacheroute_proxy.affinity_keys import knowledge_key, prefix_keys
from cacheroute_proxy.clock import now_us
from cacheroute_proxy.engine_prefix import EnginePrefix
from cacheroute_proxy.config import ConfigError, Settings
from proxy_workers.affinity import AffinityScorer, rendered_prompt
from proxy_workers.affinity_index import HandOver, PerWorkerAffinity, SharedAffinity
from proxy_workers.kdn_links import LinkTable
from proxy_workers.knowledge import KnowledgePreparer
from proxy_workers.predictors import get_predictors
from proxy_workers.request_model import Endpoint, ProxyRequest, recover
from proxy_workers.event_channel import EventChannelWriter
from shm_schema import DirectoryWriter, InstanceSlot, WorkerRow, read_all
from shm_schema.affinity import AffinityReader, AffinityWriter
from shm_schema.events import EventReader, residency
from shm_schema.homes import HomeWriter
from shm_schema.records import AFFINITY_PREFIX
from sidecar.affinity import AffinityModels
from tests.harness import wait_until
from tests.real_engine.build_tiny_model import WORDS, write_tokenizer_files
from tests.shm_helpers import fresh_segment


@pytest.fixture
def segment():
    with fresh_segment(instance_capacity=4, worker_capacity=2) as seg:
        yield seg


# --- keys ------------------------------------------------------------------------------------
def test_knowledge_keys_ignore_case_and_are_never_zero():
    assert knowledge_key("K0001") == knowledge_key("k0001") != knowledge_key("k0002")
    assert all(knowledge_key(f"k{i}") for i in range(1000))


def test_prompts_that_share_a_prefix_share_exactly_its_leading_block_keys():
    shared = "S" * 512  # two blocks of 64 tokens x 4 characters
    one = prefix_keys(shared + "a" * 256 + "tail", 64, 32)
    two = prefix_keys(shared + "b" * 256, 64, 32)
    assert len(one) == len(two) == 3  # full blocks only
    assert one[:2] == two[:2] and one[2] != two[2]
    # Chained: the same block after a different prefix is another key.
    assert prefix_keys("x" * 256 + "S" * 256, 64, 32)[1] != prefix_keys("S" * 512, 64, 32)[1]
    assert len(prefix_keys("S" * 256 * 10, 64, 4)) == 4


def test_a_chat_request_renders_roles_and_contents_in_order():
    request = recover(Endpoint.CHAT, b'{"messages":[{"role":"system","content":"be brief"},'
                                     b'{"role":"user","content":"hi"}]}')
    assert rendered_prompt(request) == "<|system|>be brief<|user|>hi"
    scheduler = recover(Endpoint.CHAT, b'{"Prompt":{"model":"m","user_prompt":"hi"}}')
    assert rendered_prompt(scheduler) is None  # it names its knowledge instead


# --- the sidecar's models ------------------------------------------------------------------------
def _event(slot: int, generation: int, kind: str, keys: tuple[int, ...], tokens: int, seg, row):
    events = EventChannelWriter(seg, row)
    events.residency(slot, generation, keys, tokens, prefix=(kind == "prefix"))
    return list(EventReader(seg).drain(row.row))


def test_the_sidecar_model_evicts_lru_past_the_capacity_and_publishes_the_row(segment):
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    row = WorkerRow.claim(segment, 0)
    models = AffinityModels(segment, lambda s, g: 2500 if (s, g) == (slot.slot, slot.generation) else -1)
    for keys in ((1,), (2,), (3,)):  # 1000 tokens each into 2500
        for event in _event(slot.slot, slot.generation, "knowledge", keys, 1000, segment, row):
            models.apply(event)
    for event in _event(slot.slot, slot.generation, "prefix", (7, 8, 9, 10), 64, segment, row):
        models.apply(event)  # two events: three keys, then one
    models.publish()
    published = AffinityReader(segment).row(slot.slot, slot.generation)
    # Key 1 went when key 3 came (3000 > 2500); the four blocks fit beside 2 and 3 (2256).
    assert (published.knowledge, published.prefix, published.tokens, published.capacity_tokens) == \
        ({2, 3}, {7, 8, 9, 10}, 2256, 2500)
    stale = _event(slot.slot, slot.generation + 1, "knowledge", (5,), 1, segment, row)
    models.apply(stale[0])  # an instance that is not (or no longer) there
    assert models.stats["stale_instance"] == 1


def test_blocks_sent_again_rewrite_no_row_until_what_it_holds_changes(segment):
    """Each request of a shared prompt names its blocks again; the row is rewritten (and every
    worker decodes it again) only when a key comes, goes or changes size."""
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    row = WorkerRow.claim(segment, 0)
    models = AffinityModels(segment, lambda s, g: 0)

    def send(keys: tuple[int, ...], tokens: int = 64) -> int:
        for event in _event(slot.slot, slot.generation, "prefix", keys, tokens, segment, row):
            models.apply(event)
        return models.publish()

    assert send((7, 8)) == 1
    assert (send((7, 8)), send((8,))) == (0, 0)  # the same blocks again: nothing readers see
    assert send((8, 9)) == 1  # a new block
    assert send((9,), tokens=128) == 1  # another size
    assert AffinityReader(segment).row(slot.slot, slot.generation).tokens == 64 + 64 + 128


def test_a_report_replaces_the_knowledge_and_keeps_the_prefix_blocks(segment):
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    row = WorkerRow.claim(segment, 0)
    models = AffinityModels(segment, lambda s, g: 0)
    for event in _event(slot.slot, slot.generation, "knowledge", (1, 2), 500, segment, row):
        models.apply(event)
    for event in _event(slot.slot, slot.generation, "prefix", (7,), 64, segment, row):
        models.apply(event)
    models.report(slot.slot, slot.generation, [2, 3])
    models.publish()
    published = AffinityReader(segment).row(slot.slot, slot.generation)
    assert (published.knowledge, published.prefix, published.tokens) == ({2, 3}, {7}, 500 + 0 + 64)


def test_a_restarted_sidecar_adopts_the_rows_of_live_instances_only(segment):
    directory = DirectoryWriter(segment)
    live = directory.allocate("a", "127.0.0.1", 9001)
    gone = directory.allocate("b", "127.0.0.1", 9002)
    models = AffinityModels(segment, lambda s, g: 0)
    models.report(live.slot, live.generation, [1, 2])
    models.report(gone.slot, gone.generation, [3])
    models.publish()
    directory.free(gone.slot)
    successor = AffinityModels(segment, lambda s, g: 0)
    assert successor.adopt() == 2
    described = successor.describe({(live.slot, live.generation): "a"})
    assert described["instances"]["a"]["knowledge"] == 2 and len(described["instances"]) == 1


def test_an_engine_fed_row_says_so_and_a_restarted_sidecar_still_ignores_the_guesses(segment):
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    row = WorkerRow.claim(segment, 0)
    models = AffinityModels(segment, lambda s, g: 0)
    models.engine_stored(slot.slot, slot.generation, [7, 8], 128)
    models.publish()
    published = AffinityReader(segment).row(slot.slot, slot.generation)
    assert (published.prefix, published.engine_fed) == ({7, 8}, True)
    successor = AffinityModels(segment, lambda s, g: 0)
    assert successor.adopt() == 2
    for event in _event(slot.slot, slot.generation, "prefix", (9,), 128, segment, row):
        successor.apply(event)  # a worker's guess: the engine's account stands
    successor.publish()
    assert successor.stats["prefix_guesses_ignored"] == 1
    assert AffinityReader(segment).row(slot.slot, slot.generation).prefix == {7, 8}


def test_forget_clears_the_row(segment):
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    models = AffinityModels(segment, lambda s, g: 0)
    models.report(slot.slot, slot.generation, [1])
    models.publish()
    models.forget(slot.slot)
    models.publish()
    assert AffinityReader(segment).row(slot.slot, slot.generation).knowledge == frozenset()


# --- the worker's views and the assessment -------------------------------------------------------------
def test_the_per_worker_view_keeps_its_own_lru_and_the_shared_view_reads_the_segment(segment):
    slot = DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    instance = read_all(segment)[0]
    row = WorkerRow.claim(segment, 0)
    events = EventChannelWriter(segment, row)
    mine = PerWorkerAffinity(segment, events, 30.0)
    shared = SharedAffinity(segment, events, 30.0)
    mine.acknowledged(instance, [knowledge_key("k1")], 100)
    mine.forwarded(instance, [11, 12], 64)
    assert mine.residency(instance).knowledge == {knowledge_key("k1")}
    assert mine.residency(instance).prefix == {11, 12}
    assert shared.residency(instance).knowledge == frozenset()  # nothing published yet
    kinds = [e.kind for e in EventReader(segment).drain(row.row)]
    assert len(kinds) == 2  # both went to the sidecar too
    assert slot.slot == instance.slot


def test_blocks_sent_to_an_engine_that_reports_its_own_name_only_the_prompt_to_the_sidecar(segment):
    """Where the engine publishes its KV events the sidecar takes only the prompt's name and
    size from a PREFIX event (its homes), so one event carries them, not one per three blocks."""
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    instance = read_all(segment)[0]
    row = WorkerRow.claim(segment, 0)
    shared = SharedAffinity(segment, EventChannelWriter(segment, row), 30.0)
    shared.forwarded(instance, list(range(11, 18)), 128, prompt_blocks=8)
    guesses = [residency(e) for e in EventReader(segment).drain(row.row)]
    assert [(g.key_0, g.key_1, g.key_2) for g in guesses] == [(11, 12, 13), (14, 15, 16), (17, 0, 0)]
    AffinityWriter(segment).publish(instance.slot, instance.generation, [], 0, engine_fed=True)
    shared.forwarded(instance, list(range(11, 18)), 128, prompt_blocks=8)
    [named] = EventReader(segment).drain(row.row)
    assert (residency(named).key_0, named.request_key) == (11, 8)


def _scorer(segment, view=SharedAffinity, pending_s: float = 30.0, row: WorkerRow | None = None,
            engine: EnginePrefix | None = None, hand_over: HandOver = lambda later: None) -> AffinityScorer:
    """`hand_over` gets what a claim would run ACKNOWLEDGED_CLAIM_S later (by default nothing runs)."""
    settings = Settings(instance_strategy="kv_aware", affinity_block_tokens=16 if engine else 64)
    events = EventChannelWriter(segment, row or WorkerRow.claim(segment, 0))
    predictors = get_predictors(settings.predictor_profile)
    preparer = KnowledgePreparer(settings, None, predictors)
    return AffinityScorer(settings, view(segment, events, pending_s), predictors, preparer, engine,
                          hand_over)


KNOWLEDGE = (b'{"Prompt":{"model":"m","user_prompt":"q"},"Service":{"Enable_know_injection":true,'
             b'"Injection_type":"kvcache","Knowledge_List":["k1","k2"],"Knowledge_length":2048},'
             b'"Task":{"KDN_server_addr":"kdn:1"}}')


def test_the_assessment_prices_what_is_not_held_resident_knowledge_skips_its_transfer(segment):
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    instance = read_all(segment)[0]
    settings = Settings(instance_strategy="kv_aware")
    predictors = get_predictors(settings.predictor_profile)
    models = AffinityModels(segment, lambda s, g: 0)
    models.report(instance.slot, instance.generation, [knowledge_key("k1")])
    models.publish()
    scorer = _scorer(segment)
    request = recover(Endpoint.CHAT, KNOWLEDGE)
    [assessment] = scorer.assess(request, [instance])
    link = LinkTable.from_settings(settings).link_for(instance.instance_id, "kdn:1")
    assert (assessment.resident_kids, assessment.pending_kids) == (("k1",), ())
    assert assessment.transfer_ms == pytest.approx(link.transfer_ms(predictors, 1024))  # k2's half
    assert assessment.saved_ms == pytest.approx(link.transfer_ms(predictors, 2048) - assessment.transfer_ms)
    assert assessment.prefill_ms == pytest.approx(predictors.kvcache_service(request.prompt_tokens, 2048).total_ms)
    plain = recover(Endpoint.COMPLETIONS, b'{"prompt":"' + b"p" * 1024 + b'"}')
    [cold] = scorer.assess(plain, [instance])
    assert (cold.prefix_blocks, cold.saved_ms, cold.transfer_ms) == (0, 0.0, 0.0)
    assert cold.prefill_ms == pytest.approx(predictors.text_service_ms(plain.prompt_tokens, 0))


OTHER_KNOWLEDGE = KNOWLEDGE.replace(b'"k1","k2"', b'"k3","k4"')


@pytest.mark.parametrize("view", [SharedAffinity, PerWorkerAffinity])
def test_pulls_another_worker_sent_to_an_instance_are_a_wait_on_its_link(segment, view):
    """The KDN's link to an instance carries one pull at a time: a new pull there waits for
    the ones every worker's requests already routed there (their knowledge claimed, not
    resident yet), each priced as one of the new request's ids -- at the new ids' home too,
    whose credit spares the pull's time, not its place in the queue. Only the shared view sees
    another worker's pulls; a pull the index confirms has ended."""
    directory = DirectoryWriter(segment)
    directory.allocate("a", "127.0.0.1", 9001)
    directory.allocate("b", "127.0.0.1", 9002)
    a, b = read_all(segment)
    other = _scorer(segment, view, row=WorkerRow.claim(segment, 1))
    pulling = recover(Endpoint.CHAT, KNOWLEDGE)
    assert other.claim(pulling, a, other.assess(pulling, [a, b])[0]) is not None  # k1 and k2 on their way to a
    scorer = _scorer(segment, view)
    request = recover(Endpoint.CHAT, OTHER_KNOWLEDGE)
    link = LinkTable.from_settings(Settings()).link_for(a.instance_id, "kdn:1")
    predictors = get_predictors(Settings().predictor_profile)

    def priced(instance: InstanceSlot, ids_ahead: int) -> float:
        """The new request's transfer there: its queue, then k3 and k4 unless it is their home."""
        assessment = scorer.assess(request, [a, b])[[a, b].index(instance)]
        queue = link.transfer_ms(predictors, 1024 * ids_ahead) if ids_ahead and view is SharedAffinity else 0.0
        return assessment.transfer_ms - queue - (0.0 if assessment.home_kids else link.transfer_ms(predictors, 2048))

    assert priced(a, 2) == pytest.approx(0.0, abs=1e-6)
    assert priced(b, 0) == pytest.approx(0.0, abs=1e-6)
    assert sum(x.home_kids for x in scorer.assess(request, [a, b])) == 2  # one of them is their home
    # A request naming k1 twice (and as K1) rides k1's pull where it sees it: nothing of it queues.
    riding = recover(Endpoint.CHAT, KNOWLEDGE.replace(b'"k1","k2"', b'"k1","k1","K1"'))
    on_a = scorer.assess(riding, [a, b])[0]
    if view is SharedAffinity:
        assert (on_a.pending_kids, on_a.transfer_ms) == (("k1", "k1", "K1"), 0.0)
    models = AffinityModels(segment, lambda s, g: 0)
    models.report(a.slot, a.generation, [knowledge_key("k1")])  # k1's pull ended
    models.publish()
    assert priced(a, 1) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("view", [SharedAffinity, PerWorkerAffinity])
def test_a_claim_is_held_at_once_confirmed_by_the_index_and_what_was_not_made_resident_is_dropped(segment, view):
    directory = DirectoryWriter(segment)
    directory.allocate("a", "127.0.0.1", 9001)
    directory.allocate("b", "127.0.0.1", 9002)
    a, b = read_all(segment)
    handed: list[Callable[[], None]] = []
    scorer = _scorer(segment, view, hand_over=handed.append)
    request = recover(Endpoint.CHAT, KNOWLEDGE)
    before = scorer.assess(request, [a, b])
    claim = scorer.claim(request, a, before[0])
    assert claim is not None
    held, elsewhere = scorer.assess(request, [a, b])
    assert (held.pending_kids, elsewhere.pending_kids) == (("k1", "k2"), ())
    assert held.transfer_ms == 0.0 and held.saved_ms == pytest.approx(before[0].transfer_ms)
    assert scorer.assess(request, [a], claims=False)[0].pending_kids == ()  # what the prepare stage sees
    # The inject of k1 was acknowledged, k2's was not: k2 is withdrawn as the prepare stage ends.
    claim.knowledge_prepared(["k1"])
    assert scorer.assess(request, [a])[0].pending_kids == ("k1",)
    claim.settle()
    claim.settle()  # once only
    assert scorer.assess(request, [a])[0].pending_kids == ("k1",)
    # The index confirms k1: the claim on it is done...
    models = AffinityModels(segment, lambda s, g: 0)
    if view is SharedAffinity:
        models.report(a.slot, a.generation, [knowledge_key("k1")])
        models.publish()
    else:  # this worker's own index
        scorer.index.acknowledged(a, [knowledge_key("k1")], 1024)
    assert scorer.assess(request, [a])[0][:2] == (("k1",), ())
    if view is SharedAffinity:  # ...so that an eviction the index reports after that is seen
        models.report(a.slot, a.generation, [])
        models.publish()
        assert scorer.assess(request, [a])[0][:2] == ((), ())
    # Acknowledged on b but never confirmed (evicted before the index published it): left to
    # the index ACKNOWLEDGED_CLAIM_S after the ack, even once the attempt has ended.
    on_b = scorer.claim(request, b, scorer.assess(request, [b])[0])
    assert on_b is not None
    on_b.knowledge_prepared(["k1", "k2"])
    on_b.settle()
    assert scorer.assess(request, [b])[0].pending_kids == ("k1", "k2")
    assert len(handed) == 2  # one hand-over a claim that kept knowledge
    handed[-1]()
    assert scorer.assess(request, [b])[0][:2] == ((), ())


def test_a_prompt_claim_stands_until_left_to_the_index_or_its_ttl_and_only_for_the_instance_it_chose(segment):
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    [a] = read_all(segment)
    handed: list[Callable[[], None]] = []
    scorer = _scorer(segment, pending_s=0.2, hand_over=handed.append)
    plain = recover(Endpoint.COMPLETIONS, b'{"prompt":"' + b"p" * 1024 + b'"}')
    claim = scorer.claim(plain, a, scorer.assess(plain, [a])[0])
    assert claim is not None
    claim.prompt_taken()
    assert handed == []  # not while the request lasts
    claim.settle()
    held = scorer.assess(plain, [a])[0]
    assert (held.prefix_blocks, held.pending_blocks) == (4, 4) and held.saved_ms > 0
    gone = a._replace(generation=a.generation + 1)  # the slot's next instance holds nothing
    assert scorer.assess(plain, [gone])[0].prefix_blocks == 0
    # ACKNOWLEDGED_CLAIM_S after its answer ended, the index says: it holds none of it (evicted).
    [to_index] = handed
    to_index()
    after = scorer.assess(plain, [a])[0]
    assert (after.prefix_blocks, after.pending_blocks) == (0, 0)
    # A claim never left to the index (its request still running, or its worker gone) lapses.
    scorer.claim(plain, a, scorer.assess(plain, [a])[0])
    assert scorer.assess(plain, [a])[0].pending_blocks == 4
    wait_until(lambda: scorer.assess(plain, [a])[0].prefix_blocks == 0, 5, message="the claim lapses")


def test_each_worker_sees_another_workers_claim_only_in_the_shared_view(segment):
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    [a] = read_all(segment)
    request = recover(Endpoint.CHAT, KNOWLEDGE)
    rows = [WorkerRow.claim(segment, i, identity=1000 + i) for i in range(2)]
    for view, seen in ((SharedAffinity, ("k1", "k2")), (PerWorkerAffinity, ())):
        deciding, other = (_scorer(segment, view, row=row) for row in rows)
        other.assess(request, [a])  # the other worker has read the ring up to here
        deciding.claim(request, a, deciding.assess(request, [a])[0])
        assert other.assess(request, [a])[0].pending_kids == seen, view


def test_a_request_waits_for_another_claims_pull_until_the_index_confirms_it_or_the_claim_goes(segment):
    """What the prepare stage does with knowledge other requests were pulling into its instance
    (AffinityScorer.pulled_meanwhile): resident once the index confirms it; pulled itself once
    that claim is withdrawn, or at once where only its own claim stands."""
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    [a] = read_all(segment)
    request = recover(Endpoint.CHAT, KNOWLEDGE)
    rows = [WorkerRow.claim(segment, i, identity=2000 + i) for i in range(2)]
    pulling, waiting = (_scorer(segment, row=row) for row in rows)
    models = AffinityModels(segment, lambda s, g: 0)

    async def scenario() -> tuple[tuple[str, ...], ...]:
        first = pulling.claim(request, a, pulling.assess(request, [a])[0])
        seen = waiting.assess(request, [a])[0]
        assert seen.pending_kids == ("k1", "k2")
        mine = waiting.claim(request, a, seen)
        loop = asyncio.get_running_loop()
        # The first pull ends: k1 acknowledged (confirmed by the index), k2 failed (withdrawn).
        loop.call_later(0.05, lambda: (models.report(a.slot, a.generation, [knowledge_key("k1")]),
                                       models.publish()))
        loop.call_later(0.1, first.knowledge_prepared, ["k1"])
        started = loop.time()
        confirmed = await waiting.pulled_meanwhile(a, request, mine, seen.pending_kids)
        assert 0.05 <= loop.time() - started < 1.0  # until k2's claim went, not the bound (~2 s)
        # Only this request's own claim on k2 stands now: nothing to wait for.
        started = loop.time()
        alone = await waiting.pulled_meanwhile(a, request, mine, ("k2",))
        assert loop.time() - started < 0.05
        return confirmed, alone
    assert asyncio.run(scenario()) == (("k1",), ())


SYSTEM = " ".join(WORDS[i % len(WORDS)] for i in range(300))  # ~300 tokens: several blocks of 16


def system_chat(user: str) -> ProxyRequest:
    """A plain chat: SYSTEM, then `user`."""
    return recover(Endpoint.CHAT, json.dumps({"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}).encode())


class _MemoizedChat:
    """Two workers' scorers over instance `a`; `second` a chat whose system prompt the first
    worker memoized, routed on its leading blocks (`routed`), `exact` its keys made whole."""

    def __init__(self, segment, tmp_path) -> None:
        DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
        [self.a] = read_all(segment)
        model = write_tokenizer_files(tmp_path / "tiny-llama")
        rows = [WorkerRow.claim(segment, i, identity=1000 + i) for i in range(2)]
        self.scorer, self.other = (_scorer(segment, row=row, engine=engine_prefix.load(str(model), 16, 64))
                                   for row in rows)
        whole = engine_prefix.load(str(model), 16, 64, memo_entries=0)
        first = system_chat("what is the cache")
        self.scorer.prefix_of(first)
        assert first.prefix_exact  # a memo miss: tokenized whole, now memoized
        self.second = second = system_chat(" ".join(WORDS[::-1] * 3))
        self.exact = whole.chat_keys(second.parsed_prompt)
        self.routed = self.scorer.prefix_of(second)
        assert not second.prefix_exact and 0 < len(self.routed) < len(self.exact)
        assert self.exact[:len(self.routed)] == self.routed
        # The system prompt's size in an engine's cache: the full blocks two of its chats share.
        one, two = (whole.chat_tokens(system_chat(user).parsed_prompt) for user in ("a", "zebra"))
        assert one is not None and two is not None
        self.shared_blocks = next(n for n, (x, y) in enumerate(zip(one, two)) if x != y) // 16
        self.forwarded: list[list[int]] = []
        self.sizes: list[int | None] = []
        self.scorer.index.forwarded = (  # type: ignore[method-assign]
            lambda instance, keys, tokens, blocks=None: (self.forwarded.append(list(keys)),
                                                          self.sizes.append(blocks)))

    def pending(self) -> list[int]:
        """The blocks of `exact` the other worker reads as claimed on `a`."""
        index, a = self.other.index, self.a
        index.refresh(now_us())
        return [k for k in self.exact if index.pending.holds((a.slot, a.generation, AFFINITY_PREFIX), k, now_us())]

    def send(self) -> Any:
        """Claim `a` for `second` and send it there; what the send did before its callbacks ran
        (the keys, the PREFIX events, the blocks claimed), and the claim."""
        scorer, second, a = self.scorer, self.second, self.a
        claim = scorer.claim(second, a, scorer.assess(second, [a])[0])
        assert claim is not None

        async def send() -> tuple[list[int], list[list[int]], list[int]]:
            scorer.forwarding(a, second, claim)
            at_send = (list(second.prefix_keys or ()), list(self.forwarded), self.pending())
            await asyncio.sleep(0)
            return at_send

        return asyncio.run(send()), claim


def test_a_chat_routes_on_its_memoized_leading_blocks_and_claims_the_rest_once_it_is_sent(segment, tmp_path):
    """A worker that memoized a system prompt routes its next chats on the memo's blocks alone
    (no rendering, no tokenizing before the send); just after the send the exact keys replace
    them: the claim, which every worker reads, and the PREFIX event then cover every block."""
    chat = _MemoizedChat(segment, tmp_path)
    at_send, claim = chat.send()
    assert at_send == (chat.routed, [], chat.routed)  # not before the send
    assert chat.second.prefix_exact and chat.second.prefix_keys == chat.exact
    assert chat.forwarded == [chat.exact] and chat.pending() == chat.exact
    assert chat.sizes == [chat.shared_blocks]  # the prompt's size, not the request's
    claim.settle()  # the instance never took the prompt: every block is withdrawn, both claims'
    assert chat.pending() == []


def test_a_chat_sent_to_an_engine_that_reports_its_blocks_is_not_tokenized_again(segment, tmp_path):
    """Where the instance's engine publishes its KV events, the index takes no worker's account
    of its blocks: the memoized leading blocks name the prompt in the PREFIX event at once, and
    the rest of the chat is never tokenized."""
    chat = _MemoizedChat(segment, tmp_path)
    AffinityWriter(segment).publish(chat.a.slot, chat.a.generation, [], 0, engine_fed=True)
    at_send, claim = chat.send()
    assert at_send == (chat.routed, [chat.routed], chat.routed)
    assert not chat.second.prefix_exact and chat.forwarded == [chat.routed]
    # Its size as the sidecar fits homes in caches: every block the system prompt fills, those
    # past the memo's cut too, not only the blocks it was routed on.
    assert chat.sizes == [chat.shared_blocks] and chat.shared_blocks > len(chat.routed)
    claim.settle()
    assert chat.pending() == []


def test_a_system_prompt_one_worker_tokenized_is_routed_by_the_others_without_tokenizing(segment, tmp_path):
    """The worker that tokenizes a chat's leading messages shares their keys (a LEAD of the
    claims ring): another worker routes its first chat with that system prompt on them, with
    nothing tokenized before the send, and no instance counts them as claimed. In the per-worker
    ablation each worker tokenizes it itself."""
    DirectoryWriter(segment).allocate("a", "127.0.0.1", 9001)
    [a] = read_all(segment)
    model = write_tokenizer_files(tmp_path / "tiny-llama")
    rows = [WorkerRow.claim(segment, i, identity=1000 + i) for i in range(2)]
    for view, shared in ((SharedAffinity, True), (PerWorkerAffinity, False)):
        first, second = (_scorer(segment, view, row=row, engine=engine_prefix.load(str(model), 16, 64))
                         for row in rows)
        first.assess(system_chat("what is the cache"), [a])
        lead = first._engine_prefix.lead_keys(system_chat("x").parsed_prompt)
        assert lead is not None and lead.keys
        tokenized: list[str] = []
        engine = second._engine_prefix
        engine._encode_spans = lambda text, spans=engine._encode_spans: tokenized.append(text) or spans(text)
        request = system_chat("who routes it")
        second.assess(request, [a])
        if shared:
            assert tokenized == [] and not request.prefix_exact
            assert (request.prefix_keys, request.prompt_blocks) == (lead.keys, lead.prompt_blocks)
        else:
            assert tokenized and request.prefix_exact
        assert second.index.pending.count((a.slot, a.generation, AFFINITY_PREFIX), now_us()) == 0
        # The next such chat finds them in the second worker's own memo (adopted or tokenized).
        engine.lead_hash = None  # type: ignore[method-assign]  # not asked again
        again = system_chat("and the next one")
        second.assess(again, [a])
        assert not again.prefix_exact and again.prefix_keys == lead.keys


# --- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("affinity_view", "everyone", "PROXY_AFFINITY_VIEW"),
    ("kv_aware_balance_abs", float("inf"), "PROXY_KV_AWARE_BALANCE_ABS"),
    ("affinity_pending_s", 0.0, "PROXY_AFFINITY_PENDING_S"),
    ("kv_aware_balance_rel", 0.5, "PROXY_KV_AWARE_BALANCE_REL"),
    ("affinity_block_tokens", 0, "PROXY_AFFINITY_BLOCK_TOKENS"),
    ("affinity_kv_mb_per_token", 0.0, "PROXY_AFFINITY_KV_MB_PER_TOKEN"),
])
def test_a_bad_kv_aware_setting_fails_at_start_naming_its_variable(field, value, message):
    with pytest.raises(ValueError, match=message):
        Settings(**{field: value})


@pytest.mark.parametrize("retired", ["PROXY_KV_AWARE_CREDIT_PER_MS", "PROXY_KV_AWARE_MAX_CREDIT"])
def test_a_retired_kv_aware_setting_is_refused_at_start_saying_what_replaced_it(retired):
    with pytest.raises(ConfigError, match=f"{retired} is no longer read: .*predicted time to first token"):
        Settings.from_env({retired: "0.2"})


def test_the_strategy_is_accepted_under_its_aliases():
    for name in ("kv_aware", "kv-aware", "kv"):
        assert Settings(instance_strategy=name).strategy_name == "kv_aware"



def test_a_prompt_has_one_home_every_worker_names_the_same_and_away_from_it_pays_the_displacement(segment):
    """Held nowhere and with no next home named (no sidecar here), a prompt's home is its
    rendezvous one; the sidecar's next home and, once it is held, its holder take that place,
    and the home the sidecar lists comes before all."""
    directory = DirectoryWriter(segment)
    for port in (9001, 9002, 9003):
        directory.allocate(f"i{port}", "127.0.0.1", port)
    instances = read_all(segment)
    rows = [WorkerRow.claim(segment, i, identity=2000 + i) for i in range(2)]
    one, other = (_scorer(segment, row=row) for row in rows)
    prompts = [recover(Endpoint.COMPLETIONS, b'{"prompt":"' + bytes([65 + n]) * 1024 + b'"}') for n in range(12)]
    homes = []
    for plain in prompts:
        mine, theirs = one.assess(plain, instances), other.assess(plain, instances)
        assert [a.home_blocks for a in mine] == [a.home_blocks for a in theirs]
        assert sorted(a.home_blocks for a in mine) == [0, 0, 4]
        home = next(i for i, a in enumerate(mine) if a.home_blocks)
        assert mine[home].prefill_ms < min(a.prefill_ms for a in mine if not a.home_blocks)
        # Away from home: what the prompt's blocks save at home, which they would displace.
        assert [a.displace_ms for a in mine] == [0.0 if i == home else mine[home].saved_ms for i in range(3)]
        assert mine[home].saved_ms > 0
        assert all(a.held_tokens == 0 for a in mine)  # a credit, not a holding
        unpriced = one.assess(plain, instances, claims=False)  # the prepare stage's view
        assert unpriced[home].home_blocks == 0 and not any(a.displace_ms for a in unpriced)
        homes.append(home)
    assert len(set(homes)) > 1  # prompts spread over the instances
    # The sidecar names a next home: a prompt held nowhere is homed there, for every worker.
    plain = prompts[0]
    elsewhere = (homes[0] + 1) % 3
    where = (instances[elsewhere].slot, instances[elsewhere].generation)
    HomeWriter(segment).set_next_home(where)
    for scorer in (one, other):
        assert [a.home_blocks for a in scorer.assess(plain, instances)] == [4 if i == elsewhere else 0 for i in range(3)]
    # Its first request went to another instance (here: a claim): that holder is its home for
    # every worker until the sidecar lists one, and it keeps that home once the next home moves.
    third = (homes[0] + 2) % 3
    one.claim(plain, instances[third], one.assess(plain, instances)[third])
    HomeWriter(segment).set_next_home(None)
    for scorer in (one, other):
        held = scorer.assess(plain, instances)
        assert held[third].pending_blocks == 4 and held[third].home_blocks == 0 and held[third].displace_ms == 0.0
        assert held[third].held_tokens == plain.prompt_tokens
        assert [a.displace_ms > 0 for a in held] == [i != third for i in range(3)]
    # The sidecar lists its home: that one, even where another holds the prompt, which pays
    # the displacement there and holds the blocks (its prefill skips them).
    HomeWriter(segment).publish({plain.prefix_keys[0]: (instances[homes[0]].slot, instances[homes[0]].generation)})
    held = one.assess(plain, instances)
    assert held[homes[0]].home_blocks == 4 and held[homes[0]].displace_ms == 0.0
    assert held[third].pending_blocks == 4 and held[third].home_blocks == 0
    assert held[third].held_tokens == plain.prompt_tokens and held[third].displace_ms > 0
    assert held[third].prefill_ms == held[homes[0]].prefill_ms
