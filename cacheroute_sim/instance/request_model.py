"""Turns an OpenAI request body into the few numbers the simulation needs.

Only what shapes the simulated work is read (prompt size, max_tokens, stream flags, model);
everything else in the body is accepted and ignored, as a vLLM server would mostly do.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from cacheroute_sim.instance.config import MAX_TOKENS_LIMIT
from cacheroute_sim.instance.timing import prompt_tokens

Kind = Literal["chat", "text"]

KV_PREFIX_HEADER = "x-cacheroute-kv-prefix-tokens"
KV_KNOWLEDGE_IDS_HEADER = "x-cacheroute-kv-knowledge-ids"

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off", ""})


class InvalidJSON(Exception):
    """The body is not JSON at all (-> 400 invalid_json)."""


class InvalidRequest(Exception):
    """The body is JSON but not a usable request (-> 400 invalid_request + detail)."""


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    kind: Kind
    stream: bool
    # stream_options.include_usage: add a usage chunk before [DONE], as OpenAI does.
    include_usage: bool
    model: str
    prompt_tokens: int
    completion_tokens: int
    # "length" when the client capped the output (we always generate exactly that many).
    finish_reason: str
    # Simulation-only hint (header KV_PREFIX_HEADER): this many leading prompt tokens are
    # already in Redis; None when the header is absent.
    kv_prefix_tokens: int | None = None
    # Simulation-only hint (header KV_KNOWLEDGE_IDS_HEADER): the knowledge ids whose KV the
    # prompt's context starts with, in order; the prefill uses those resident (residency.py).
    knowledge_ids: tuple[str, ...] = ()
    # The prompt as rendered for the prefix cache (residency.block_hashes); "" when caching
    # is off (nothing is hashed then).
    prompt_text: str = ""


def parse_generation_request(body: bytes, kind: Kind, *, default_max_tokens: int,
                             default_model: str, kv_prefix_header: str | None = None,
                             knowledge_ids_header: str | None = None,
                             render_prompt: bool = False) -> GenerationRequest:
    payload = _decode_object(body)
    kv_prefix_tokens = parse_kv_prefix_header(kv_prefix_header)
    chars = _chat_chars(payload) if kind == "chat" else _prompt_chars(payload)
    max_tokens = _max_tokens(payload, kind)
    model = payload.get("model")
    return GenerationRequest(
        kind=kind,
        stream=parse_lenient_bool(payload.get("stream"), "stream"),
        include_usage=_include_usage(payload),
        model=model if isinstance(model, str) and model else default_model,
        prompt_tokens=prompt_tokens(chars),
        completion_tokens=default_max_tokens if max_tokens is None else _clamp(max_tokens),
        finish_reason="stop" if max_tokens is None else "length",
        kv_prefix_tokens=kv_prefix_tokens,
        knowledge_ids=parse_knowledge_ids_header(knowledge_ids_header),
        prompt_text=rendered_prompt(payload, kind) if render_prompt else "",
    )


def parse_knowledge_ids_header(value: str | None) -> tuple[str, ...]:
    """``x-cacheroute-kv-knowledge-ids: k1,k2``: ids, lower-cased like the KDN's; () if absent."""
    if not value:
        return ()
    return tuple(kid.strip().lower() for kid in value.split(",") if kid.strip())


def rendered_prompt(payload: dict[str, Any], kind: Kind) -> str:
    """The text the prefix cache hashes: each message's role and text, or the prompt (already
    validated by the counting above)."""
    if kind == "text":
        prompt = payload["prompt"]
        return prompt if isinstance(prompt, str) else "".join(prompt)
    parts = []
    for message in payload["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content
                              if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append(f"<|{message.get('role')}|>{content or ''}\n")
    return "".join(parts)


def parse_kv_prefix_header(value: str | None) -> int | None:
    """``x-cacheroute-kv-prefix-tokens``: a decimal integer >= 0, or absent (None).

    A real vLLM ignores the header; the simulation rejects a malformed one (400) because it
    can only come from a Proxy bug.
    """
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise InvalidRequest(f"{KV_PREFIX_HEADER} must be an integer >= 0, got {value!r}")
    return int(text)


def parse_lenient_bool(value: Any, name: str) -> bool:
    """bool, 0/1, or "true"/"false"-like strings (the original Instance's leniency)."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise InvalidRequest(f"{name} must be a boolean, got {value!r}")


def _decode_object(body: bytes) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise InvalidJSON() from None
    if not isinstance(payload, dict):
        raise InvalidRequest("body must be a JSON object")
    return payload


def _chat_chars(payload: dict[str, Any]) -> int:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        total += _content_chars(message.get("content"), i)
    return total


def _content_chars(content: Any, index: int) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        # Multi-part content: only text parts carry prompt characters.
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise InvalidRequest(f"messages[{index}].content must be a string, a list of parts or null")


def _prompt_chars(payload: dict[str, Any]) -> int:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(len(p) for p in prompt)
    raise InvalidRequest("prompt must be a string or a non-empty list of strings")


def _max_tokens(payload: dict[str, Any], kind: Kind) -> int | None:
    value = payload.get("max_tokens")
    if value is None and kind == "chat":
        value = payload.get("max_completion_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"max_tokens must be an integer, got {value!r}")
    return value


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    if not isinstance(options, dict):
        return False
    return parse_lenient_bool(options.get("include_usage"), "stream_options.include_usage")


def _clamp(max_tokens: int) -> int:
    return min(max(max_tokens, 1), MAX_TOKENS_LIMIT)
