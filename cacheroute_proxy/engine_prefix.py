"""A plain request's prompt-prefix keys as a vLLM engine names its KV blocks, so the affinity
index can hold what the engine itself reports in its KV cache events.

vLLM's automatic prefix cache (0.32, `--prefix-caching-hash-algo sha256`, the default) names each
full block of `block_size` prompt tokens sha256(pickle((parent digest, token ids, extra keys))),
chained from NONE_HASH = sha256(pickle(seed)), where the seed is the engine's PYTHONHASHSEED or
"vllm-none-hash"; its KV events publish the low 64 bits of each digest. To name the same blocks,
the proxy renders chat messages with the model's own chat template and tokenizes with the
model's own tokenizer, as vLLM's OpenAI server does (chat: the template adds the special
tokens; completions: the tokenizer does).

A worker renders and tokenizes each chat prompt, so it memoizes the leading messages (all but
the last: a system prompt, a conversation's history) by a hash of their text, in a bounded LRU:
their tokens and block chain are computed once, and only the rest of a prompt is tokenized, from
a word boundary a margin before the splice, after a check that tokenizing from there gives the
memo's own tokens (otherwise the whole prompt is tokenized). The keys are always those of the
whole prompt. A worker routes on the memo's keys alone (`lead_keys`: no rendering, no
tokenizing) and makes them exact just after the request is sent. Workers share what they
memoize: `lead_hash` names leading messages the same in every process (and for one tokenizer
and block size only), by which a worker publishes their keys for the others (a LEAD of the
claims ring, shm_schema/claims.py), so a system prompt is tokenized once on the host.

Loaded from a model directory (PROXY_AFFINITY_TOKENIZER: `tokenizer.json`, and the chat
template in `chat_template.jinja` or `tokenizer_config.json`), with the optional `engine-kv`
extra (tokenizers, jinja2).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import pickle
from collections import OrderedDict
from operator import itemgetter, ne
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from .affinity_keys import engine_block_key

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of NONE_HASH when the engine has no PYTHONHASHSEED
# pickle's protocol 5, which is HIGHEST_PROTOCOL on every Python vLLM runs on; the digests
# depend on the exact bytes.
_PICKLE_PROTOCOL = 5
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Tokenizing is the cost here (~0.36 µs a token with tokenizers 0.23 and the tiny test model's
# tokenizer on this project's 2-core test machine: bench/bench_prefix_keys.py), so for keys
# only the text that can hold max_blocks full blocks and a margin is tokenized: at up to
# CHARS_PER_TOKEN_BOUND characters a token, more than tokenizers average.
# The last tokens before a cut may differ from the whole text's, so no block within
# CUT_MARGIN_TOKENS of it counts.
CHARS_PER_TOKEN_BOUND = 8
CUT_MARGIN_TOKENS = 32
# Leading messages memoized per worker: a few dozen system prompts and the histories of the
# conversations in progress. An entry holds at most the text that is tokenized, a block and
# OVERLAP_TOKENS of token ids, and max_blocks keys.
LEAD_MEMO_ENTRIES = 256
# Tokens before the splice that are tokenized again and must come out as the memo has them.
OVERLAP_TOKENS = 8


class EnginePrefixError(Exception):
    """The model directory cannot give engine-exact prefix keys (the message says why)."""


def _digest(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def chain_digests(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The digests of the full blocks of `token_ids`, chained on from `parent`."""
    digests: list[bytes] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = _digest((parent, tuple(token_ids[start:start + block_size]), None))
        digests.append(parent)
    return digests


def block_digests(token_ids: Sequence[int], block_size: int, max_blocks: int,
                  seed: str = DEFAULT_SEED) -> list[bytes]:
    """The full 32-byte digests of the full blocks of `token_ids`, at most `max_blocks`."""
    return chain_digests(_digest(seed), token_ids[:max_blocks * block_size], block_size)


def published_hash(digest: bytes) -> int:
    """What vLLM's KV events call a block: the low 64 bits of its digest read big-endian,
    which are its last 8 bytes."""
    return int.from_bytes(digest[-8:], "big")


class Spans(NamedTuple):
    """A text's tokens from token number `first` on: their ids, the character each starts at,
    and whether each starts a word (a pre-token: no token spans two words)."""
    first: int
    ids: list[int]
    starts: list[int]
    words: list[bool]

    @property
    def end(self) -> int:
        return self.first + len(self.ids)


class _Stream(NamedTuple):
    """A prompt's tokens as far as they are tokenized: the keys of its first full blocks, the
    digest they end on, and its tokens from spans.first (at most the first one not hashed) on."""
    keys: tuple[int, ...]
    parent: bytes
    spans: Spans


class _Lead(NamedTuple):
    """Memoized leading messages. `text`: what the template renders of them (cut just past the
    text that is tokenized). `keys`, `parent`: the full blocks before `cut`, the character (a
    word start) where a prompt's own tokens take over. `spans`: the tokens up to `cut` from the
    overlap window's first (`overlap` in spans) or the first one not hashed, whichever is first.
    `final`: every prompt that starts with `text` has exactly `keys`. `blocks`: the full blocks
    the tokens of `text` fill, `keys`' and those the cut leaves out."""
    text: str
    keys: tuple[int, ...]
    parent: bytes
    spans: Spans
    overlap: int
    cut: int
    final: bool
    blocks: int


class LeadKeys(NamedTuple):
    """What a worker routes a chat on before it is sent: the keys of its memoized leading
    messages' blocks, and how many full blocks those messages fill -- what every request
    starting with them shares in an engine's cache (keys stop a margin before the end of the
    text, so a block may be left out of them)."""
    keys: list[int]
    prompt_blocks: int


class MemoStats(NamedTuple):
    """The leading-messages memo of one EnginePrefix: entries held now, and chat requests (of
    two messages or more) by where their keys came from: the entry of all their leading messages
    (hits); the entry of fewer of them, a conversation's earlier turns (partial); none, the whole
    prompt tokenized (misses; both then memoize their leading messages); or the whole prompt
    although an entry was there (fallbacks: it cannot serve, or its splice check failed)."""
    entries: int
    hits: int
    partial: int
    misses: int
    fallbacks: int


class EnginePrefix:
    """Token ids and block keys of plain requests, as the engine serving `model_dir` sees them."""

    def __init__(self, encode: Callable[[str, bool], list[int]], encode_spans: Callable[[str], Spans],
                 template: Any | None, special_tokens: dict[str, str], block_size: int,
                 max_blocks: int, seed: str = DEFAULT_SEED,
                 memo_entries: int = LEAD_MEMO_ENTRIES, identity: bytes = b"") -> None:
        self._encode = encode
        self._encode_spans = encode_spans  # a chat prompt's (no special tokens added)
        self._template = template
        self._special_tokens = special_tokens
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.seed = seed
        self._none_digest = _digest(seed)
        # The characters tokenized at most: max_blocks full blocks and the margin before the cut.
        self._limit = (max_blocks * block_size + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_BOUND
        self._memo: OrderedDict[int, _Lead | None] = OrderedDict()
        # Leading messages another worker tokenized (`adopt`), by the memo's hash: their keys
        # serve lead_keys until this worker memoizes them itself.
        self._adopted: OrderedDict[int, LeadKeys] = OrderedDict()
        self._memo_entries = memo_entries
        self._hits = self._partial = self._misses = self._fallbacks = 0
        # What lead_hash is salted with: the tokenizer (`identity`: its file) and the blocks.
        self._identity = b"%b\0%d\0%d\0%b" % (identity, block_size, max_blocks, seed.encode())

    def chat_keys(self, messages: Sequence[Any]) -> list[int]:
        """The keys of chat `messages`' leading blocks; none when they cannot be rendered."""
        rendered = _template_messages(messages)
        prompt = None if rendered is None else self._render(rendered, True)
        if prompt is None:
            return []
        if self._memo_entries <= 0 or len(rendered) < 2:
            return self._text_keys(prompt, False)
        return self._memo_keys(rendered, prompt)

    def lead_keys(self, messages: Sequence[Any]) -> LeadKeys | None:
        """The keys of the blocks this worker memoized (or adopted) for chat `messages`' leading
        messages, with no rendering and no tokenizing: the leading part of what `chat_keys`
        gives, to route on before the request is sent (`chat_keys` then makes them exact, and
        checks that the prompt starts as memoized). None when no memo serves (chat_keys is
        needed now)."""
        key = self._lead_key(messages)
        if key is None:
            return None
        lead = self._memo.get(key)
        if lead is not None and lead.keys:
            return LeadKeys(list(lead.keys), lead.blocks)
        adopted = self._adopted.get(key)
        return None if adopted is None else LeadKeys(list(adopted.keys), adopted.prompt_blocks)

    def adopt(self, messages: Sequence[Any], leading: LeadKeys) -> None:
        """From now on `lead_keys` gives `leading` (another worker's keys of chat `messages`'
        leading messages), unless this worker memoizes those messages itself."""
        key = self._lead_key(messages)
        if key is not None:
            _bounded_put(self._adopted, key, leading, self._memo_entries)

    def _lead_key(self, messages: Sequence[Any]) -> int | None:
        """The memo's key of chat `messages`' leading messages; None with no memo, no leading
        messages, or one that is not text."""
        if self._memo_entries <= 0 or len(messages) < 2:
            return None
        rendered = _template_messages(messages)
        return None if rendered is None else _leading_hashes(rendered)[-1]

    def lead_hash(self, messages: Sequence[Any]) -> int | None:
        """A hash of chat `messages`' leading messages (all but the last), of this tokenizer and
        of the block size, the same in every process (never 0); None when there are none or one
        is not text. Only a name: whoever holds keys by it vouches that they are that text's."""
        rendered = _template_messages(messages) if len(messages) >= 2 else None
        if rendered is None:
            return None
        digest = hashlib.blake2b(self._identity, digest_size=8)
        for message in rendered[:-1]:
            for text in (message["role"], message["content"]):
                data = text.encode("utf-8", "surrogatepass")
                digest.update(len(data).to_bytes(8, "little"))
                digest.update(data)
        return int.from_bytes(digest.digest(), "little") or 1

    def completion_keys(self, prompt: str) -> list[int]:
        return self._text_keys(prompt, True)

    def chat_tokens(self, messages: Sequence[Any]) -> list[int] | None:
        """The prompt tokens of chat `messages` (objects with .role and .content): the template
        adds the special tokens, the tokenizer none (vLLM's default for chat)."""
        rendered = _template_messages(messages)
        prompt = None if rendered is None else self._render(rendered, True)
        return None if prompt is None else self._encode(prompt, False)

    def completion_tokens(self, prompt: str) -> list[int]:
        return self._encode(prompt, True)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """The index keys of the prompt's full blocks: what the engine's events will name them."""
        return [engine_block_key(published_hash(d))
                for d in block_digests(token_ids, self.block_size, self.max_blocks, self.seed)]

    def memo_stats(self) -> MemoStats:
        return MemoStats(len(self._memo), self._hits, self._partial, self._misses, self._fallbacks)

    def _text_keys(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= self._limit:
            return self.keys(self._encode(text, add_special_tokens))
        tokens = self._encode(text[:self._limit], add_special_tokens)
        return self.keys(tokens[:max(0, len(tokens) - CUT_MARGIN_TOKENS)])

    # --- the memo of leading messages --------------------------------------------------------------
    def _memo_keys(self, rendered: list[dict[str, str]], prompt: str) -> list[int]:
        hashes = _leading_hashes(rendered)
        if hashes[-1] in self._memo:
            self._memo.move_to_end(hashes[-1])
            lead = self._memo[hashes[-1]]
            keys = self._lead_keys(lead, prompt) if lead is not None and prompt.startswith(lead.text) \
                else None
            if keys is not None:
                self._hits += 1
                return keys
            self._fallbacks += 1
            if lead is not None and prompt.startswith(lead.text):
                self._memo[hashes[-1]] = None  # its splice check failed: it would again
            return self._text_keys(prompt, False)
        # The leading messages are new, but fewer of them (a conversation's earlier history, its
        # system prompt) may be known: the prompt's tokens come from there or from its start.
        found = self._shorter_lead(hashes[:-1], prompt)
        shorter = None if found is None else found[1]
        if shorter is not None and shorter.final:
            self._partial += 1
            self._remember(hashes[-1], shorter)
            return list(shorter.keys)
        stream = None if shorter is None else self._splice(shorter, prompt)
        if stream is not None:
            self._partial += 1
        else:
            self._misses += 1
            if found is not None:
                self._memo[found[0]], shorter = None, None  # its splice check failed
            stream = _Stream((), self._none_digest, self._encode_spans(prompt[:self._limit]))
        keys, digests = self._finish(stream, len(prompt) > self._limit)
        leading = self._render(rendered[:-1], False)
        # The template may render the leading messages otherwise when they end the chat: then
        # they are not the prompt's start, and nothing is memoized for them.
        lead = self._lead(leading, stream, keys, digests) if leading and prompt.startswith(leading) \
            else None
        self._remember(hashes[-1], lead or shorter)
        return keys

    def _shorter_lead(self, hashes: list[int], prompt: str) -> tuple[int, _Lead] | None:
        """The memo of the most leading messages (fewer than all but the last) that serves."""
        for key in reversed(hashes):
            lead = self._memo.get(key)
            if lead is not None and prompt.startswith(lead.text):
                self._memo.move_to_end(key)
                return key, lead
        return None

    def _remember(self, key: int, lead: _Lead | None) -> None:
        _bounded_put(self._memo, key, lead, self._memo_entries)

    def _lead_keys(self, lead: _Lead, prompt: str) -> list[int] | None:
        """The keys of a prompt that starts with `lead.text`; None if the splice check fails."""
        if lead.final:
            return list(lead.keys)
        stream = self._splice(lead, prompt)
        return None if stream is None else self._finish(stream, len(prompt) > self._limit)[0]

    def _splice(self, lead: _Lead, text: str) -> _Stream | None:
        """`text`'s tokens (it starts with `lead.text`): the memo's up to lead.cut, then those of
        tokenizing it from the overlap window's first token on. None unless that tokenizing
        gives the window's tokens and word starts exactly, and a word starting at the cut: a
        tokenizer that treats a text's start apart (a prefix space, a normalizer's) shows here."""
        start = lead.spans.starts[lead.overlap]
        window = len(lead.spans.ids) - lead.overlap
        tail = self._encode_spans(text[start:self._limit])
        if len(tail.ids) <= window or tail.ids[:window] != lead.spans.ids[lead.overlap:] \
                or tail.words[:window] != lead.spans.words[lead.overlap:] \
                or not tail.words[window] or tail.starts[window] != lead.cut - start:
            return None
        spans = Spans(lead.spans.first, lead.spans.ids + tail.ids[window:],
                      lead.spans.starts + [at + start for at in tail.starts[window:]],
                      lead.spans.words + tail.words[window:])
        return _Stream(lead.keys, lead.parent, spans)

    def _finish(self, stream: _Stream, cut: bool) -> tuple[list[int], list[bytes]]:
        """The keys of a prompt's tokens, as _text_keys computes them (without the margin before
        the end of the text tokenized if it was `cut`), and the digests of the blocks beyond
        stream.keys."""
        keys, parent, spans = stream
        usable = spans.end - CUT_MARGIN_TOKENS if cut else spans.end
        blocks = min(max(0, usable) // self.block_size, self.max_blocks)
        if blocks <= len(keys):
            return list(keys[:blocks]), []
        start = len(keys) * self.block_size - spans.first
        digests = chain_digests(parent, spans.ids[start:start + (blocks - len(keys)) * self.block_size],
                                self.block_size)
        return [*keys, *(engine_block_key(published_hash(d)) for d in digests)], digests

    def _lead(self, text: str, stream: _Stream, keys: list[int], digests: list[bytes]) -> _Lead | None:
        """The memo of leading messages that render as `text`, from the stream of a prompt that
        starts with it, and the prompt's keys and digests (_finish); None if no word starts far
        enough before the text's end to splice at."""
        if len(text) > self._limit:  # every prompt's keys are those of the text tokenized
            return _Lead(text[:self._limit + 1], tuple(keys), b"", Spans(0, [], [], []), 0, 0, True,
                         len(keys))
        known, spans = len(stream.keys), stream.spans
        inside = spans.first + bisect.bisect_left(spans.starts, len(text))  # tokens starting in text
        cut = _word_start(spans, inside - CUT_MARGIN_TOKENS)
        overlap = None if cut is None else _word_start(spans, cut - OVERLAP_TOKENS)
        if overlap is None or cut < known * self.block_size:
            return None
        # Its blocks end before the cut, so before the prompt's usable end: the prompt's digests.
        blocks = min(cut // self.block_size, self.max_blocks)
        final = cut >= self.max_blocks * self.block_size + CUT_MARGIN_TOKENS
        first = overlap if final else min(blocks * self.block_size, overlap)
        kept = slice(first - spans.first, cut - spans.first)
        parent = digests[blocks - known - 1] if blocks > known else stream.parent
        lead = _Lead(text, tuple(keys[:blocks]), parent,
                     Spans(first, spans.ids[kept], spans.starts[kept], spans.words[kept]),
                     overlap - first, spans.starts[cut - spans.first], final,
                     min(inside // self.block_size, self.max_blocks))
        # A final lead is never spliced again, so its check is made now, on its own text.
        return None if final and self._splice(lead, text) is None else lead

    def _render(self, rendered: list[dict[str, str]], add_generation_prompt: bool) -> str | None:
        """The chat template's prompt; None when the model has no template or the template
        refuses the messages."""
        if self._template is None:
            return None
        try:
            return self._template.render(messages=rendered, add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens)
        except Exception:  # the template refuses these messages (raise_exception): so would vLLM
            return None


def _bounded_put(table: OrderedDict[int, Any], key: int, value: Any, bound: int) -> None:
    """Set `key`, then drop the oldest entries past `bound` (an LRU's insert)."""
    table[key] = value
    while len(table) > bound:
        table.popitem(last=False)


def _template_messages(messages: Sequence[Any]) -> list[dict[str, str]] | None:
    """Messages as the chat template gets them; None if one is not text (an image part)."""
    rendered = []
    for message in messages:
        content = _text_of(message.content)
        if content is None:
            return None
        rendered.append({"role": message.role, "content": content})
    return rendered


def _leading_hashes(rendered: list[dict[str, str]]) -> list[int]:
    """A hash of the text of each run of leading messages: the first, the first two, ..., all
    but the last. Only a lookup: an entry serves a prompt only if it starts with its text."""
    hashes, running = [], 0
    for message in rendered[:-1]:
        running = hash((running, message["role"], message["content"]))
        hashes.append(running)
    return hashes


def _word_start(spans: Spans, at_most: int) -> int | None:
    """The last token at or before number `at_most` that starts a word, if spans has one."""
    for index in range(min(at_most, spans.end - 1), spans.first - 1, -1):
        if spans.words[index - spans.first]:
            return index
    return None


def _text_of(content: Any) -> str | None:
    """A message's content as vLLM hands a string-content template: a string, or the text parts
    of a list joined by newlines."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content
                 if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    return None


def load(model_dir: str, block_size: int, max_blocks: int, seed: str = DEFAULT_SEED,
         memo_entries: int = LEAD_MEMO_ENTRIES) -> EnginePrefix:
    """The tokenizer and chat template of the model in `model_dir`; EnginePrefixError if either
    library is missing or the directory has no tokenizer.json."""
    try:
        import jinja2.sandbox
        from tokenizers import Tokenizer
    except ImportError as missing:
        raise EnginePrefixError(f"PROXY_AFFINITY_TOKENIZER needs the engine-kv extra "
                                f"(pip install 'cacheroute-proxy[engine-kv]'): {missing}") from None
    directory = Path(model_dir)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise EnginePrefixError(f"PROXY_AFFINITY_TOKENIZER={model_dir}: no tokenizer.json there")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _json(directory / "tokenizer_config.json")
        template = _template(directory, config, jinja2.sandbox)
    except Exception as error:  # OSError, bad JSON, a template that does not compile, tokenizers' own
        raise EnginePrefixError(f"PROXY_AFFINITY_TOKENIZER={model_dir}: {error}") from None
    special = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_spans(text: str) -> Spans:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        words = encoding.word_ids
        # A token starts a word where its word differs from the one before (two tokens of no
        # word, None, count as one word: a splice point fewer, never a wrong one).
        return Spans(0, encoding.ids, list(map(itemgetter(0), encoding.offsets)),
                     [True, *map(ne, words[1:], words[:-1])] if words else [])

    stat = tokenizer_file.stat()
    return EnginePrefix(encode, encode_spans, template,
                        {k: v for k, v in special.items() if v is not None},
                        block_size, max_blocks, seed, memo_entries,
                        identity=b"%b\0%d\0%d" % (str(tokenizer_file.resolve()).encode(), stat.st_size,
                                                   stat.st_mtime_ns))


def from_settings(settings: Any) -> EnginePrefix | None:
    """PROXY_AFFINITY_TOKENIZER's model, hashed in PROXY_AFFINITY_BLOCK_TOKENS blocks; None if
    it is not set."""
    if not settings.affinity_tokenizer:
        return None
    return load(settings.affinity_tokenizer, settings.affinity_block_tokens,
                settings.affinity_max_blocks, settings.affinity_engine_hash_seed or DEFAULT_SEED)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _template(directory: Path, config: dict[str, Any], sandbox: Any) -> Any | None:
    """The model's chat template, compiled as transformers compiles it (trim_blocks,
    lstrip_blocks, loop controls, raise_exception), or None if it has none."""
    path = directory / "chat_template.jinja"
    source = path.read_text() if path.is_file() else config.get("chat_template")
    if not isinstance(source, str):
        return None
    environment = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                          ensure_ascii=False)

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
