"""vLLM's KV cache events in the affinity index: prompt keys computed
as the engine names its blocks, the events' wire format, what each event does to an instance's
prefix entries, and, end to end, a real sidecar subscribed to a ZMQ publisher standing in for an
engine while real workers look the same prompt up.

The engine-exact hashes are checked against a BlockStored a real vLLM 0.32 engine published
(tests/data/vllm_block_stored.json); `make test-vllm` checks tokens and events against running
engines (tests/real_engine/test_kv_events.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cacheroute_proxy import engine_prefix
from cacheroute_proxy.affinity_keys import engine_block_key, rendezvous_home
from cacheroute_proxy.config import ConfigError, Settings
from cacheroute_proxy.instance_wire import RegisterRequest
from cacheroute_sim.processes import free_port
from proxy_workers.request_model import Message
from proxy_workers.event_channel import EventChannelWriter
from shm_schema import DirectoryWriter, WorkerRow
from shm_schema.affinity import AffinityReader
from shm_schema.events import EventReader
from sidecar import kv_event_wire
from sidecar.affinity import AffinityModels
from sidecar.kv_events import RETRY_S, EngineFeed, KvEventFeeds
from sidecar.registry import InstanceRegistry
from tests.harness import get, http, wait_until
from tests.test_cli import run_cli
from tests.shm_helpers import fresh_segment

GOLDEN = Path(__file__).parent / "data" / "vllm_block_stored.json"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as a checkpoint ships one: a byte-level BPE tokenizer trained here on a
    small corpus (with a BOS added to plain prompts), and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    directory = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["the proxy routes each request to the engine that holds its prefix"] * 50
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tokenizer.token_to_id("<s>"))])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return directory


@pytest.fixture
def segment():
    with fresh_segment(instance_capacity=4, worker_capacity=2) as seg:
        yield seg


# --- keys as the engine names its blocks ----------------------------------------------------------
def test_block_keys_are_the_hashes_a_real_vllm_engine_published():
    event = json.loads(GOLDEN.read_text())["event"]
    digests = engine_prefix.block_digests(event["token_ids"], event["block_size"], 32)
    assert [engine_prefix.published_hash(d) for d in digests] == event["block_hashes"]
    # Chained: the second block's hash depends on the first block's tokens.
    changed = [event["token_ids"][0] + 1] + event["token_ids"][1:]
    assert engine_prefix.published_hash(
        engine_prefix.block_digests(changed, event["block_size"], 32)[1]) != event["block_hashes"][1]
    # Another seed (an engine run with PYTHONHASHSEED) names every block differently.
    assert engine_prefix.block_digests(event["token_ids"], 128, 32, seed="1")[0] != digests[0]


def test_chat_messages_are_rendered_with_the_models_template_then_tokenized(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prefix = engine_prefix.load(str(model_dir), BLOCK, 32)
    messages = [Message("system", "the proxy routes " * 8), Message("user", "each request")]
    rendered = "system: " + "the proxy routes " * 8 + "\nuser: each request\nassistant:"
    # Chat: the template adds what it adds; the tokenizer's BOS is not added on top (vLLM's default).
    assert prefix.chat_tokens(messages) == tokenizer.encode(rendered, add_special_tokens=False).ids
    # Completions: the tokenizer's own special tokens (here a BOS) come first.
    completion = prefix.completion_tokens("the proxy")
    assert completion[0] == tokenizer.token_to_id("<s>") and completion[1:] == \
        tokenizer.encode("the proxy", add_special_tokens=False).ids
    # Text parts are joined by newlines; a message that is not text gives no tokens at all.
    parts = [Message("user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
    assert prefix.chat_tokens(parts) == tokenizer.encode("user: a\nb\nassistant:", add_special_tokens=False).ids
    assert prefix.chat_tokens([Message("user", [{"type": "image_url", "image_url": {"url": "x"}}])]) is None
    tokens = prefix.chat_tokens(messages)
    assert len(prefix.keys(tokens)) == len(tokens) // BLOCK
    assert prefix.keys(tokens)[0] == engine_block_key(engine_prefix.published_hash(
        engine_prefix.block_digests(tokens, BLOCK, 1)[0]))


def test_only_the_text_that_can_hold_max_blocks_is_tokenized_and_the_keys_are_the_same(model_dir):
    prefix = engine_prefix.load(str(model_dir), BLOCK, 2)
    calls: list[int] = []
    encode = prefix._encode
    prefix._encode = lambda text, special: calls.append(len(text)) or encode(text, special)
    long_text = "the proxy routes each request to the engine " * 100  # 4,400 characters
    whole = prefix.keys(prefix.completion_tokens(long_text))
    assert len(whole) == 2 and prefix.completion_keys(long_text) == whole
    assert calls == [len(long_text),
                     (2 * BLOCK + engine_prefix.CUT_MARGIN_TOKENS) * engine_prefix.CHARS_PER_TOKEN_BOUND]
    chat = [Message("system", long_text)]
    assert prefix.chat_keys(chat) == prefix.keys(prefix.chat_tokens(chat)) and len(prefix.chat_keys(chat)) == 2


def test_a_template_that_refuses_the_messages_gives_no_keys(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    prefix = engine_prefix.load(str(tmp_path), BLOCK, 32)
    assert prefix.chat_tokens([Message("user", "hi")]) is None and prefix.chat_keys([Message("user", "hi")]) == []


def test_a_directory_without_a_tokenizer_is_refused_naming_the_variable(tmp_path):
    with pytest.raises(engine_prefix.EnginePrefixError, match="PROXY_AFFINITY_TOKENIZER=.*no tokenizer.json"):
        engine_prefix.load(str(tmp_path), BLOCK, 32)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(engine_prefix.EnginePrefixError, match="PROXY_AFFINITY_TOKENIZER="):
        engine_prefix.load(str(tmp_path), BLOCK, 32)
    with pytest.raises(ConfigError, match="PROXY_AFFINITY_TOKENIZER"):
        Settings.from_env({"PROXY_AFFINITY_TOKENIZER": str(tmp_path / "missing")})


@pytest.mark.parametrize("value, why", [
    ("a=http://127.0.0.1:1", "is not instance_id=tcp://host:port"), ("=tcp://127.0.0.1:1", "is not"),
    ("a", "is not"), ("a=tcp://*:5557", "not the \\* it binds"),
    ("a=tcp://127.0.0.1:1,a=tcp://127.0.0.1:2", "is given twice")])
def test_a_bad_kv_events_setting_fails_at_start_naming_its_variable(value, why, model_dir):
    with pytest.raises(ConfigError, match=f"PROXY_KV_EVENTS: .*{why}"):
        Settings.from_env({"PROXY_KV_EVENTS": value, "PROXY_AFFINITY_TOKENIZER": str(model_dir)})
    assert Settings.from_env({"PROXY_KV_EVENTS": "a=tcp://127.0.0.1:1",
                              "PROXY_AFFINITY_TOKENIZER": str(model_dir)}).kv_event_endpoints == \
        {"a": "tcp://127.0.0.1:1"}
    # Without the engine's tokenizer no event could name a block the workers look up.
    with pytest.raises(ConfigError, match="PROXY_KV_EVENTS: needs PROXY_AFFINITY_TOKENIZER"):
        Settings.from_env({"PROXY_KV_EVENTS": "a=tcp://127.0.0.1:1"})


@pytest.mark.parametrize("sources, endpoint", [
    ({"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}},
     "tcp://127.0.0.1:5557"),
    ({"0": {"enable_kv_cache_events": True}}, "tcp://127.0.0.1:5557"),  # vLLM's defaults
    ({"1": {"enable_kv_cache_events": True, "endpoint": "tcp://*:6001"},
      "0": {"enable_kv_cache_events": True, "endpoint": "ipc:///run/kv0"}}, "ipc:///run/kv0"),
    ({"0": {"enable_kv_cache_events": False, "publisher": "zmq"}}, None),
    ({"0": {"enable_kv_cache_events": True, "publisher": "null"}}, None),
    # It connects out to a subscriber of its own: nothing to subscribe to here.
    ({"0": {"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.5:5557"}}, None),
    ({}, None), (None, None)])
def test_an_engines_publisher_is_found_in_its_kv_event_sources(sources, endpoint):
    from cacheroute_proxy.engine_probe import _KvEventsConfig, kv_events_endpoint

    decoded = None if sources is None else msgspec.convert(sources, dict[str, _KvEventsConfig])
    assert kv_events_endpoint(decoded, "http://127.0.0.1:8000") == endpoint
    if endpoint and endpoint.startswith("tcp"):
        assert kv_events_endpoint(decoded, "http://[::1]:8000") == endpoint.replace("127.0.0.1", "[::1]")


# --- the wire -------------------------------------------------------------------------------------
def batch(seq: int, *events: dict[str, Any]) -> list[bytes]:
    """One message as vLLM's ZMQ publisher sends it."""
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1796158406.8, list(events), 0])]


def stored(*hashes: int | bytes, medium: str | None = None, block_size: int = BLOCK) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
             "token_ids": [1] * (BLOCK * len(hashes)), "block_size": block_size, "lora_id": None,
             "extra_keys": [None] * len(hashes), "group_idx": 0}
    return event if medium is None else {**event, "medium": medium}


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def test_a_batch_decodes_as_vllm_sends_it_and_unknown_kinds_are_skipped():
    digest = bytes(range(32))
    seq, events, skipped = kv_event_wire.decode(batch(
        7, stored(5, 6), removed(5), {"type": "AllBlocksCleared"}, {"type": "SomethingNew", "x": 1},
        stored(digest)))
    assert seq == 7 and skipped == 1
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared",
                                                  "BlockStored"]
    assert events[0].block_hashes == [5, 6] and events[0].block_size == BLOCK
    # The raw digest form names a block as the int form does: its low 64 bits.
    assert kv_event_wire.block_number(events[3].block_hashes[0]) == int.from_bytes(digest, "big") % 2 ** 64
    # A negative hash is no block name: that event is skipped, the others kept.
    _, events, skipped = kv_event_wire.decode(batch(8, stored(-5), stored(5)))
    assert [e.block_hashes for e in events] == [[5]] and skipped == 1
    for frames in ([b"kv", b"\0" * 8], [b"kv", b"\0" * 4, b"x"], [b"kv", b"\0" * 8, b"\x93not"]):
        with pytest.raises(kv_event_wire.FrameError):
            kv_event_wire.decode(frames)


# --- what the events do to an instance's entries --------------------------------------------------
class Fed:
    """One instance in a segment, its sidecar models, and a feed of its engine's events."""

    def __init__(self, segment) -> None:
        self.segment = segment
        self.slot = DirectoryWriter(segment).allocate("e", "127.0.0.1", 9001)
        self.models = AffinityModels(segment, lambda s, g: 0)
        record = type("Record", (), {"slot": self.slot.slot, "generation": self.slot.generation})
        self.feed = EngineFeed("e", "tcp://127.0.0.1:1", self.models, lambda _id: record, BLOCK)

    def prefix(self) -> frozenset[int]:
        self.models.publish()
        return AffinityReader(self.segment).row(self.slot.slot, self.slot.generation).prefix


def test_stored_and_removed_blocks_are_the_instances_prefix_entries(segment):
    fed = Fed(segment)
    fed.feed.receive(batch(0, stored(11, 12, 13)))
    assert fed.prefix() == {11, 12, 13}
    fed.feed.receive(batch(1, removed(13), stored(14)))
    assert fed.prefix() == {11, 12, 14}
    fed.feed.receive(batch(2, {"type": "AllBlocksCleared"}))
    assert fed.prefix() == frozenset()
    # Another tier's copies (an offloading connector's CPU medium) are not the engine's cache.
    fed.feed.receive(batch(3, stored(15, medium="CPU"), stored(16, medium="GPU")))
    assert fed.prefix() == {16} and fed.feed.stats.skipped_events == 1
    # A block hash of 0 is a key like any other (keys are never 0 in the row).
    fed.feed.receive(batch(4, stored(0)))
    assert engine_block_key(0) in fed.prefix()


def test_a_lost_batch_or_a_restarted_engine_empties_the_entries_then_they_refill(segment, caplog):
    fed = Fed(segment)
    fed.feed.receive(batch(0, stored(1, 2)))
    with caplog.at_level(logging.WARNING, "cacheroute.sidecar.kv_events"):
        fed.feed.receive(batch(3, stored(3)))  # batches 1 and 2 never came
    assert fed.prefix() == {3} and fed.feed.stats.gaps == 1
    assert "2 of its event batches were lost" in caplog.text
    fed.feed.receive(batch(0, stored(4)))  # the sequence starts again: a new engine
    assert fed.prefix() == {4} and fed.feed.stats.engine_restarts == 1


def test_once_the_engine_reports_the_workers_prefix_guesses_are_ignored(segment):
    fed = Fed(segment)
    row = WorkerRow.claim(segment, 0)
    events = EventChannelWriter(segment, row)

    def guess(*keys: int) -> None:
        events.residency(fed.slot.slot, fed.slot.generation, keys, BLOCK, prefix=True)
        for event in EventReader(segment).drain(row.row):
            fed.models.apply(event)

    guess(100, 101)
    assert fed.prefix() == {100, 101}  # the model's guess, until the engine speaks
    fed.feed.receive(batch(0, stored(1), removed(100)))
    assert fed.prefix() == {1, 101}  # what was there stays until the engine evicts it...
    guess(102)
    assert fed.prefix() == {1, 101} and fed.models.stats["prefix_guesses_ignored"] == 1  # ...no new guesses
    # Knowledge stays the workers' to report: the engine knows nothing of knowledge ids.
    events.residency(fed.slot.slot, fed.slot.generation, (555,), 1000, prefix=False)
    for event in EventReader(segment).drain(row.row):
        fed.models.apply(event)
    fed.models.publish()
    assert AffinityReader(segment).row(fed.slot.slot, fed.slot.generation).knowledge == {555}
    assert fed.models.describe({(fed.slot.slot, fed.slot.generation): "e"})["instances"]["e"][
        "prefix_from"] == "engine"


def test_an_engine_with_other_block_sizes_is_named_in_the_log(segment, caplog):
    fed = Fed(segment)
    with caplog.at_level(logging.ERROR, "cacheroute.sidecar.kv_events"):
        fed.feed.receive(batch(0, stored(1, block_size=128)))
        fed.feed.receive(batch(1, stored(2, block_size=128)))
    assert caplog.text.count("the engine's blocks are 128 tokens, but PROXY_AFFINITY_BLOCK_TOKENS is 16") == 1


def test_bad_messages_are_counted_and_logged_once(segment, caplog):
    fed = Fed(segment)
    with caplog.at_level(logging.WARNING, "cacheroute.sidecar.kv_events"):
        for _ in range(3):
            fed.feed.receive([b"kv", b"x"])
    assert fed.feed.stats.bad_messages == 3 and caplog.text.count("KV events of e") == 1


def test_endpoints_come_from_the_setting_or_the_registration_of_alive_instances(segment):
    registry = InstanceRegistry(segment, ttl_s=30, purge_grace_s=0)
    registry.register(RegisterRequest(host="127.0.0.1", port=9001, instance_id="by-setting"))
    registry.register(RegisterRequest(host="127.0.0.1", port=9002, instance_id="by-meta",
                                      meta={"kv_events_endpoint": "ipc:///tmp/engine.sock"}))
    registry.register(RegisterRequest(host="127.0.0.1", port=9003, instance_id="silent"))
    registry.register(RegisterRequest(host="127.0.0.1", port=9004, instance_id="odd",
                                      meta={"kv_events_endpoint": "http://nope"}))
    feeds = KvEventFeeds(registry, AffinityModels(segment, lambda s, g: 0),
                         {"by-setting": "tcp://127.0.0.1:5557", "not-registered": "tcp://127.0.0.1:1"}, BLOCK)
    assert feeds.wanted() == {"by-setting": "tcp://127.0.0.1:5557", "by-meta": "ipc:///tmp/engine.sock"}
    feeds.enabled = False  # the workers do not hash prompts as the engines do
    assert feeds.wanted() == {}


def test_a_failed_subscription_is_logged_and_tried_again_only_after_a_while(segment, caplog):
    registry = InstanceRegistry(segment, ttl_s=30, purge_grace_s=0)
    registry.register(RegisterRequest(host="127.0.0.1", port=9001, instance_id="e"))
    feeds = KvEventFeeds(registry, AffinityModels(segment, lambda s, g: 0),
                         {"e": "ipc:///tmp/" + "x" * 200}, BLOCK)  # longer than a Unix socket path

    async def scenario() -> tuple[int, int]:
        feeds.reconcile()
        await asyncio.sleep(0.1)  # the subscription fails at connect
        feeds.reconcile()  # gone, not retried at once...
        feeds.reconcile()
        after_failure = len(feeds.describe())
        feeds._failed_at["e"] -= RETRY_S  # ...but once RETRY_S has passed
        feeds.reconcile()
        again = len(feeds.describe())
        for _, task in feeds._feeds.values():
            task.cancel()
        await asyncio.sleep(0)
        return after_failure, again

    with caplog.at_level(logging.ERROR, "cacheroute.sidecar.kv_events"):
        assert asyncio.run(scenario()) == (0, 1)
    assert "the subscription failed" in caplog.text and "File name too long" in caplog.text


# --- end to end: a real sidecar subscribed to a publisher, real workers looking prompts up ---------
def test_a_real_sidecar_follows_an_engines_events_and_every_worker_sees_them(make_cluster, model_dir):
    prompt = "the proxy routes each request to the engine that holds its prefix " * 4
    keys = engine_prefix.load(str(model_dir), BLOCK, 32).completion_keys(prompt)
    assert len(keys) >= 3
    # The engine whose events are followed is the prompt's home (kv_aware keeps a prompt at its
    # home over a holder elsewhere): ports are drawn until the rendezvous names it.
    while True:
        engine_port, other_port = free_port(), free_port()
        engine_id, other_id = f"sim-{engine_port}", f"sim-{other_port}"
        if engine_port != other_port and rendezvous_home(keys[0], [engine_id, other_id]) == 0:
            break
    publisher_port = free_port()
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://127.0.0.1:{publisher_port}")  # as vLLM binds its publisher
    try:
        cluster = make_cluster(workers=2, strategy="kv_aware", env={
            "PROXY_AFFINITY_TOKENIZER": str(model_dir), "PROXY_AFFINITY_BLOCK_TOKENS": str(BLOCK),
            "PROXY_KV_EVENTS": f"{engine_id}=tcp://127.0.0.1:{publisher_port}"})
        cluster.add_instance(port=engine_port)
        cluster.add_instance(port=other_port)
        def feed() -> dict[str, Any]:
            return (cluster.status()["kv_event_feeds"] or {}).get(engine_id, {})

        # ZMQ drops what is published before the subscriber joins: announce until it has.
        seq = iter(range(10 ** 6))
        wait_until(lambda: publisher.send_multipart(batch(next(seq))) or feed().get("batches"), 15,
                   message=f"the sidecar subscribed\n{cluster.launcher_log()[-3000:]}")

        def held(worker: int) -> dict[str, int]:
            loads = get(f"{cluster.worker_url(worker)}/debug/instance_loads?"
                        f"{urllib.parse.urlencode({'prompt': prompt})}")
            return {r["instance_id"]: r["affinity"]["resident_prefix_blocks"] for r in loads["instances"]}

        publisher.send_multipart(batch(next(seq), stored(*keys)))
        wait_until(lambda: all(held(w) == {engine_id: len(keys), other_id: 0} for w in range(2)), 10,
                   message="every worker sees the engine's blocks")
        # kv_aware sends the prompt where its blocks are (its home), whichever worker takes it
        # (once the last request has left every worker's load view: affinity yields to load).
        for _ in range(4):
            wait_until(lambda: all(r["least_load_score"]["total"] == 0 for w in range(2)
                                   for r in cluster.loads(w)["instances"]), 10, message="idle")
            status, _, headers = http("POST", f"{cluster.dp_url}/v1/completions",
                                      {"model": "sim", "prompt": prompt, "max_tokens": 2})
            assert status == 200 and headers["x-cacheroute-instance"] == engine_id
        publisher.send_multipart(batch(next(seq), removed(keys[1])))
        wait_until(lambda: all(held(w)[engine_id] == 1 for w in range(2)), 10,
                   message="a removed block ends the cached prefix there")
        next(seq)  # a batch the sidecar never gets
        publisher.send_multipart(batch(next(seq)))
        wait_until(lambda: all(held(w)[engine_id] == 0 for w in range(2)), 10,
                   message="a lost batch empties the engine's entries")
        assert feed()["gaps"] == 1
        status = run_cli("status", "--url", cluster.cp_url)
        assert status.returncode == 0, status.stderr
        assert f"kv events   {engine_id} tcp://127.0.0.1:{publisher_port}: " in status.stdout
        assert ", 1 gaps, 0 engine restarts" in status.stdout
        assert cluster.status()["event_channel"]["affinity"]["instances"][engine_id]["prefix_from"] == "engine"
    finally:
        publisher.close()
        context.term()


def test_a_system_prompt_one_worker_tokenized_is_routed_by_another_on_the_keys_it_shared(make_cluster, model_dir):
    """Real workers share what they tokenize: the chat that reaches worker 0 first is tokenized
    there, the next with the same system prompt is routed by worker 1 on the keys worker 0
    shared, and each worker's next on its own memo, worker 1's adopted from worker 0
    (cacheroute_prompt_keys_total by source, summed over the workers on any scrape)."""
    cluster = make_cluster(workers=2, strategy="kv_aware", env={
        "PROXY_AFFINITY_TOKENIZER": str(model_dir), "PROXY_AFFINITY_BLOCK_TOKENS": str(BLOCK)})
    cluster.add_instance()
    system = "the proxy routes each request to the engine that holds its prefix " * 8

    def chat(worker: int, user: str) -> None:
        status, text, _ = http("POST", f"{cluster.worker_url(worker)}/v1/chat/completions", {
            "model": "sim", "max_tokens": 2, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]})
        assert status == 200, text

    def sources() -> dict[str, float]:
        status, text, _ = http("GET", f"{cluster.dp_url}/metrics")
        assert status == 200, text
        return {s.labels["source"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "cacheroute_prompt_keys_total"}

    assert sources() == {"memo": 0, "shared": 0, "tokenized": 0}
    chat(0, "who holds it")
    chat(1, "where does it go")
    chat(0, "and then")
    chat(1, "and after")
    assert sources() == {"memo": 2, "shared": 1, "tokenized": 1}
