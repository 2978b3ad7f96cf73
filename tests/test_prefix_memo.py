"""The workers' memo of leading chat messages' tokens (cacheroute_proxy/engine_prefix.py): a
repeated system prompt or conversation history is tokenized and hashed once per worker, the rest
of a prompt from a token boundary before the splice, and the keys are always exactly those of
tokenizing the whole rendered prompt. Tokenized with the real tiny model's tokenizer and chat
template (tests/real_engine/build_tiny_model.py builds the same tokenizer.json with `tokenizers`
alone)."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from cacheroute_proxy import engine_prefix
from cacheroute_proxy.engine_prefix import EnginePrefix
from proxy_workers.request_model import Message
from tests.real_engine.build_tiny_model import CHAT_TEMPLATE, WORDS, write_tokenizer_files

# One parallel test worker runs them all: they share the module's tokenizer, trained once.
pytestmark = pytest.mark.xdist_group(__name__)

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"cacheroute-hypothesis-{os.getuid()}")

# (block tokens, max blocks, memo entries): the engine's usual 16, blocks of 4 with so few of
# them that a long system prompt holds every block (and exceeds the text that is tokenized),
# blocks of 64 beyond a ~1,000-token prompt, and a memo of 3 entries that keeps evicting.
CONFIGS = ((16, 64, 256), (4, 8, 256), (64, 32, 256), (16, 64, 3))
TEMPLATE_LAST = ("{% for m in messages %}{% if loop.last %}(last) {% endif %}"
                 "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def salad(rng: random.Random, words: int, extra: tuple[str, ...] = ()) -> str:
    return " ".join(rng.choice([*WORDS, *extra]) for _ in range(words))


def _system_pool() -> list[Any]:
    rng = random.Random(3)
    return [
        salad(rng, 600),                                                   # ~900 tokens
        salad(rng, 600) + "   \n\n",                                       # whitespace at the splice
        salad(rng, 300, ("héllo", "wörld", "🙂", "中文字符串", "<s>", "</s>", "\t")),
        "\n".join(salad(rng, 8) for _ in range(60)),                       # many lines
        salad(rng, 3000),                                                  # beyond what is tokenized
        " ".join(["knowledge"] * 1500),                                    # ~10 characters a token
        "be brief.",                                                       # shorter than the margin
        "",
        None,                                                              # no content at all
        [{"type": "text", "text": salad(rng, 200)}, {"type": "text", "text": salad(rng, 200)}],
        "".join(rng.choice("中文字符串日本語") for _ in range(400)),        # one long word
    ]


SYSTEMS = _system_pool()
_HISTORY_RNG = random.Random(5)
HISTORY = [(salad(_HISTORY_RNG, n), salad(_HISTORY_RNG, n // 2)) for n in (1, 20, 80, 160)] + \
    [("", ""), ("  ", "\n"), ("<s>", "🙂")]
user_turns = st.one_of(
    st.text(max_size=300),
    st.sampled_from(["", " ", "\n", "\n\n  ", "  hello world", "<s>", "</s>", "🙂🙂", "中文"]),
    st.builds(lambda seed, n: salad(random.Random(seed), n), st.integers(0, 10**6), st.integers(1, 120)),
)
chats = st.builds(
    lambda system, history, user: ([] if system is False else [Message("system", system)])
    + [Message(role, text) for pair in history for role, text in zip(("user", "assistant"), pair)]
    + [Message("user", user)],
    st.sampled_from([False, *range(len(SYSTEMS))]).map(lambda i: i if i is False else SYSTEMS[i]),
    st.lists(st.sampled_from(HISTORY), max_size=3),
    user_turns,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prefixes(tiny_model: Path) -> dict[tuple[int, int, int], tuple[EnginePrefix, EnginePrefix]]:
    """Per config: one memoizing EnginePrefix kept across examples (as a worker keeps it) and
    one that tokenizes every whole prompt."""
    return {config: (engine_prefix.load(str(tiny_model), config[0], config[1], memo_entries=config[2]),
                     engine_prefix.load(str(tiny_model), config[0], config[1], memo_entries=0))
            for config in CONFIGS}


def spy(prefix: EnginePrefix) -> list[int]:
    """The length of every text `prefix` hands its tokenizer from now on."""
    lengths: list[int] = []
    encode, spans = prefix._encode, prefix._encode_spans
    prefix._encode = lambda text, special: lengths.append(len(text)) or encode(text, special)
    prefix._encode_spans = lambda text: lengths.append(len(text)) or spans(text)
    return lengths


def full_keys(model: Path, messages: list[Message], block: int = 16, blocks: int = 64) -> list[int]:
    whole = engine_prefix.load(str(model), block, blocks, memo_entries=0)
    tokens = whole.chat_tokens(messages)
    assert tokens is not None
    return whole.keys(tokens)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 500)), deadline=None, derandomize=True,
          database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=st.sampled_from(CONFIGS), batch=st.lists(chats, min_size=1, max_size=4))
def test_memoized_keys_are_exactly_the_whole_prompts_keys(prefixes, config, batch) -> None:
    memo, whole = prefixes[config]
    for messages in batch:
        note(repr(messages))
        lead = memo.lead_keys(messages)  # what a worker routes on before the send
        keys = memo.chat_keys(messages)
        assert keys == whole.chat_keys(messages)
        assert lead is None or (lead.keys and keys[:len(lead.keys)] == lead.keys), lead
        # The size it names is all the leading messages fill: their keys' blocks and any the
        # cut left out, never more than the whole prompt has.
        assert lead is None or len(lead.keys) <= lead.prompt_blocks <= len(keys), (lead, len(keys))


def test_every_path_of_the_memo_on_the_pools(tiny_model) -> None:
    """The property's pools in order, each chat after the others that share its leading
    messages: hits, partial hits, misses and fallbacks all happen, the memo stays in its bound, and every key
    is the whole prompt's."""
    rng = random.Random(13)
    for block, blocks, entries in CONFIGS:
        memo = engine_prefix.load(str(tiny_model), block, blocks, memo_entries=entries)
        whole = engine_prefix.load(str(tiny_model), block, blocks, memo_entries=0)
        for system in SYSTEMS:
            for history in ([], HISTORY[1:3], HISTORY[3:]):
                for user in ("", " who", salad(rng, 40), "\n\n🙂"):
                    chat = [Message("system", system)] + [
                        Message(role, text) for pair in history
                        for role, text in zip(("user", "assistant"), pair)] + [Message("user", user)]
                    assert memo.chat_keys(chat) == whole.chat_keys(chat), (block, blocks, chat)
                    assert memo.memo_stats().entries <= entries
        stats = memo.memo_stats()
        assert min(stats.hits, stats.partial, stats.misses, stats.fallbacks) > 0, (block, blocks, stats)


def test_a_repeated_system_prompt_is_tokenized_once_per_worker(tiny_model) -> None:
    prefix = engine_prefix.load(str(tiny_model), 16, 64)
    system = Message("system", SYSTEMS[0])
    first = [system, Message("user", "who wrote the answer")]
    assert prefix.chat_keys(first) == full_keys(tiny_model, first)
    lengths = spy(prefix)
    for question in ("what is the cache", "  hello\n", "🙂 routes", ""):
        lengths.clear()
        chat = [system, Message("user", question)]
        assert prefix.chat_keys(chat) == full_keys(tiny_model, chat)
        # Only from a token boundary a margin before the splice: never the system prompt again.
        assert sum(lengths) < 400 < len(SYSTEMS[0]), lengths
    assert prefix.memo_stats().hits == 4 and prefix.memo_stats().misses == 1


def test_a_growing_conversation_tokenizes_only_what_its_last_turns_added(tiny_model) -> None:
    prefix = engine_prefix.load(str(tiny_model), 16, 64)
    chat = [Message("system", SYSTEMS[1])]
    lengths = spy(prefix)
    rng = random.Random(9)
    for turn in range(6):
        question, answer = salad(rng, 30), salad(rng, 30)
        chat.append(Message("user", question))
        lengths.clear()
        assert prefix.chat_keys(chat) == full_keys(tiny_model, chat)
        if turn > 0:  # the previous request's history is memoized: its own tokens are reused
            assert sum(lengths) < 3 * (len(question) + len(answer)) + 600, (turn, lengths)
        chat.append(Message("assistant", answer))
    assert prefix.memo_stats().misses == 1 and prefix.memo_stats().partial == 5


def test_the_memo_is_bounded_and_rebuilds_what_it_evicted(tiny_model) -> None:
    prefix = engine_prefix.load(str(tiny_model), 16, 64, memo_entries=2)
    rng = random.Random(11)
    systems = [salad(rng, 300) for _ in range(3)]
    for system in systems + systems:
        chat = [Message("system", system), Message("user", salad(rng, 10))]
        assert prefix.chat_keys(chat) == full_keys(tiny_model, chat)
        assert prefix.memo_stats().entries <= 2
    assert prefix.memo_stats().misses == 6 and prefix.memo_stats().hits == 0
    chat = [Message("system", systems[2]), Message("user", "again")]
    assert prefix.chat_keys(chat) == full_keys(tiny_model, chat) and prefix.memo_stats().hits == 1


def _memo_stats_of_whole_prompts(model_dir: Path, block: int, max_blocks: int, system: str,
                                 questions: tuple[str, ...]) -> Any:
    """Chats of `system` and each question: the memoized keys equal the whole prompt's; the
    memo's counters after them."""
    prefix = engine_prefix.load(str(model_dir), block, max_blocks)
    whole = engine_prefix.load(str(model_dir), block, max_blocks, memo_entries=0)
    for question in questions:
        chat = [Message("system", system), Message("user", question)]
        assert prefix.chat_keys(chat) == whole.keys(whole.chat_tokens(chat))
    return prefix.memo_stats()


def test_leading_messages_the_template_renders_differently_are_not_memoized(tmp_path, tiny_model) -> None:
    """A template that renders the last message apart: what it renders of the leading messages
    alone is not the start of the prompt, so every such prompt is tokenized whole."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE_LAST)
    stats = _memo_stats_of_whole_prompts(tmp_path, 16, 64, SYSTEMS[0], ("one", "two", "three"))
    assert stats.hits == 0 and stats.misses == 1 and stats.fallbacks == 2


def test_a_tokenizer_that_cannot_restart_mid_text_falls_back_to_the_whole_prompt(tmp_path) -> None:
    """A tokenizer that adds a space before the text (ByteLevel add_prefix_space): a word
    without one tokenizes differently at the start of a text than inside it, so a splice there
    cannot be exact. The check before the splice sees it and the whole prompt is tokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lines = "\n".join(f"{WORDS[i % len(WORDS)]}" for i in range(400))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.train_from_iterator([lines] * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}))
    stats = _memo_stats_of_whole_prompts(tmp_path, 4, 256, lines, ("who", "what", "fox"))
    assert stats.hits == 0 and stats.fallbacks == 2, stats


def test_a_tokenizer_without_words_is_never_spliced(tmp_path) -> None:
    """A tokenizer with no pre-tokenizer (a normalizer that prepends "▁", as Llama 2's does):
    the whole text is one word, so no word starts where a splice could be, and every prompt is
    tokenized whole."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>"], show_progress=False))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    stats = _memo_stats_of_whole_prompts(tmp_path, 4, 256, SYSTEMS[0], ("who", "what", "fox"))
    assert stats.hits == 0 and stats.misses == 1 and stats.fallbacks == 2, stats
