"""A plain request's prompt-prefix keys as a vLLM engine names its KV blocks (docs/architecture.md
§4.4), so the affinity index can hold what the engine itself reports in its KV cache events.

vLLM's automatic prefix cache (0.32, `--prefix-caching-hash-algo sha256`, the default) names each
full block of `block_size` prompt tokens sha256(pickle((parent digest, token ids, extra keys))),
chained from NONE_HASH = sha256(pickle(seed)), where the seed is the engine's PYTHONHASHSEED or
"vllm-none-hash"; its KV events publish the low 64 bits of each digest. To name the same blocks,
the proxy renders chat messages with the model's own chat template and tokenizes with the
model's own tokenizer, as vLLM's OpenAI server does (chat: the template adds the special
tokens; completions: the tokenizer does).

Loaded from a model directory (PROXY_AFFINITY_TOKENIZER: `tokenizer.json`, and the chat
template in `chat_template.jinja` or `tokenizer_config.json`), with the optional `engine-kv`
extra (tokenizers, jinja2).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any, Callable, Sequence

from .affinity_keys import engine_block_key

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of NONE_HASH when the engine has no PYTHONHASHSEED
# pickle's protocol 5, which is HIGHEST_PROTOCOL on every Python vLLM runs on; the digests
# depend on the exact bytes.
_PICKLE_PROTOCOL = 5
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Tokenizing is the cost here (0.6 ms a kilobyte with tokenizers 0.23 on this project's 2-core
# test machine), so for keys only the text that can hold max_blocks full blocks and a margin
# is tokenized: at up to CHARS_PER_TOKEN_BOUND characters a token, more than tokenizers average.
# The last tokens before a cut may differ from the whole text's, so no block within
# CUT_MARGIN_TOKENS of it counts.
CHARS_PER_TOKEN_BOUND = 8
CUT_MARGIN_TOKENS = 32


class EnginePrefixError(Exception):
    """The model directory cannot give engine-exact prefix keys (the message says why)."""


def _digest(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def block_digests(token_ids: Sequence[int], block_size: int, max_blocks: int,
                  seed: str = DEFAULT_SEED) -> list[bytes]:
    """The full 32-byte digests of the full blocks of `token_ids`, at most `max_blocks`."""
    parent = _digest(seed)
    digests: list[bytes] = []
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = _digest((parent, tuple(token_ids[start:start + block_size]), None))
        digests.append(parent)
    return digests


def published_hash(digest: bytes) -> int:
    """What vLLM's KV events call a block: the low 64 bits of its digest read big-endian,
    which are its last 8 bytes."""
    return int.from_bytes(digest[-8:], "big")


class EnginePrefix:
    """Token ids and block keys of plain requests, as the engine serving `model_dir` sees them."""

    def __init__(self, encode: Callable[[str, bool], list[int]], template: Any | None,
                 special_tokens: dict[str, str], block_size: int, max_blocks: int,
                 seed: str = DEFAULT_SEED) -> None:
        self._encode = encode
        self._template = template
        self._special_tokens = special_tokens
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.seed = seed

    def chat_keys(self, messages: Sequence[Any]) -> list[int]:
        """The keys of chat `messages`' leading blocks; none when they cannot be rendered."""
        prompt = self._render(messages)
        return [] if prompt is None else self._text_keys(prompt, False)

    def completion_keys(self, prompt: str) -> list[int]:
        return self._text_keys(prompt, True)

    def chat_tokens(self, messages: Sequence[Any]) -> list[int] | None:
        """The prompt tokens of chat `messages` (objects with .role and .content): the template
        adds the special tokens, the tokenizer none (vLLM's default for chat)."""
        prompt = self._render(messages)
        return None if prompt is None else self._encode(prompt, False)

    def completion_tokens(self, prompt: str) -> list[int]:
        return self._encode(prompt, True)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """The index keys of the prompt's full blocks: what the engine's events will name them."""
        return [engine_block_key(published_hash(d))
                for d in block_digests(token_ids, self.block_size, self.max_blocks, self.seed)]

    def _text_keys(self, text: str, add_special_tokens: bool) -> list[int]:
        limit = (self.max_blocks * self.block_size + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_BOUND
        if len(text) <= limit:
            return self.keys(self._encode(text, add_special_tokens))
        tokens = self._encode(text[:limit], add_special_tokens)
        return self.keys(tokens[:max(0, len(tokens) - CUT_MARGIN_TOKENS)])

    def _render(self, messages: Sequence[Any]) -> str | None:
        """The chat template's prompt for `messages`; None when the model has no template, a
        message is not text (an image part), or the template refuses them."""
        if self._template is None:
            return None
        rendered = []
        for message in messages:
            content = _text_of(message.content)
            if content is None:
                return None
            rendered.append({"role": message.role, "content": content})
        try:
            return self._template.render(messages=rendered, add_generation_prompt=True,
                                         **self._special_tokens)
        except Exception:  # the template refuses these messages (raise_exception): so would vLLM
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


def load(model_dir: str, block_size: int, max_blocks: int, seed: str = DEFAULT_SEED) -> EnginePrefix:
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

    return EnginePrefix(encode, template, {k: v for k, v in special.items() if v is not None},
                        block_size, max_blocks, seed)


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
