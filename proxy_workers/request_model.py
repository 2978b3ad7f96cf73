"""Recovering a data-plane request: the Scheduler's CacheRoute `Request` or a plain OpenAI body
(docs/protocol.md, "Data plane"), validated with msgspec and turned into what goes to the
instance.

Unlike the original, types are checked on decode (a `token_length` of "abc" is a 422 naming the
field, not a hang later), and a plain OpenAI body is forwarded byte for byte, so system
messages, history, tools and stop sequences reach the backend.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import msgspec

from cacheroute_proxy.http import HTTPError

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=100_000_000)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=100)]


class Endpoint(str, Enum):
    """A proxied route. `path` and `route` are plain attributes, set once: each request reads
    them, and an Enum's `value` is a property in Python (two calls a read)."""

    CHAT = "chat/completions"
    COMPLETIONS = "completions"

    path: str  # the URL path: "/v1/chat/completions"
    route: str  # the value as a plain str: the metrics' route label, "chat/completions"

    def __new__(cls, value: str) -> Endpoint:
        member = str.__new__(cls, value)
        member._value_ = value
        member.path = "/v1/" + value
        member.route = value
        return member


class PromptSection(msgspec.Struct):
    model: str
    user_prompt: str
    token_length: TokenCount | None = None
    bs: int = 1
    max_tokens: MaxTokens | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: Probability | None = None


class ServiceSection(msgspec.Struct):
    Enable_know_injection: bool = False
    Injection_type: str = "kvcache"
    Knowledge_List: list[str] = []
    Knowledge_length: TokenCount = 0
    Endpoint_type: str | None = None


class TaskSection(msgspec.Struct):
    KDN_server_addr: str = ""


class SchedulerRequest(msgspec.Struct):
    """The Scheduler's `Request` dataclass as JSON; unknown keys are carried and ignored."""

    Prompt: PromptSection
    Request_ID: int = 0
    Request_type: str = "request"
    Service: ServiceSection = msgspec.field(default_factory=ServiceSection)
    Task: TaskSection = msgspec.field(default_factory=TaskSection)


class Message(msgspec.Struct):
    role: str
    content: Any = None


class OpenAIChatBody(msgspec.Struct):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    model: str | None = None
    stream: bool = False
    max_tokens: MaxTokens | None = None


class OpenAICompletionBody(msgspec.Struct):
    prompt: str | list[Any]
    model: str | None = None
    stream: bool = False
    max_tokens: MaxTokens | None = None


DEFAULT_DECODE_TOKENS = 128  # for predictions when the client does not say (OpenAI's default is open)
INJECTION_ALIASES = {"kv": "kvcache", "kv_cache": "kvcache", "kv-cache": "kvcache",
                     "kvcache": "kvcache", "text": "text", "prompt": "text"}


class KnowledgeSpec(msgspec.Struct):
    """What the Scheduler asked for: which knowledge, how to inject it, where to fetch it."""

    enabled: bool
    injection_type: str  # "text" or "kvcache" (the Scheduler's normalisation: unknown -> kvcache)
    knowledge_ids: list[str]
    knowledge_tokens: int
    kdn_addr: str

    @property
    def wanted(self) -> bool:
        return self.enabled and bool(self.knowledge_ids)

    def tokens_of(self, count: int) -> int:
        """The tokens of `count` of its ids: `Knowledge_length` names only their sum, so the ids
        share it evenly."""
        return self.knowledge_tokens * count // max(1, len(self.knowledge_ids))


class ProxyRequest(msgspec.Struct):
    """What the worker forwards, whatever shape the client used."""

    endpoint: Endpoint
    upstream_body: bytes
    stream: bool
    model: str | None
    request_id: int
    token_length: int | None
    source: str  # "cacheroute" or "openai"
    prompt_tokens: int = 1
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    # The upstream body as a dict, for a Scheduler request whose knowledge is injected before
    # forwarding (re-encoded then); None when the body is forwarded as received.
    body: dict[str, Any] | None = None
    knowledge: KnowledgeSpec | None = None
    # A plain OpenAI request's messages (chat) or prompt (completions), as decoded, for
    # kv_aware's prefix hashes (proxy_workers/affinity.py), and those hashes once computed.
    parsed_prompt: Any = None
    prefix_keys: list[int] | None = None
    # False while prefix_keys are only those of the leading messages the worker memoized (what
    # it routes on), until the exact keys replace them just after the request is sent.
    prefix_exact: bool = True
    # The full blocks its leading messages fill (engine_prefix.LeadKeys), when it is routed on
    # them: the prompt's size in an engine's cache, which its leading keys may fall short of.
    prompt_blocks: int | None = None

    def encoded_body(self) -> bytes:
        return self.upstream_body if self.body is None else _encoder.encode(self.body)


_encoder = msgspec.json.Encoder()


_SCHEDULER_KEY = b'"Prompt"'
_typed = {schema: msgspec.json.Decoder(schema)
          for schema in (SchedulerRequest, OpenAIChatBody, OpenAICompletionBody)}
_OPENAI_SCHEMA = {Endpoint.CHAT: OpenAIChatBody, Endpoint.COMPLETIONS: OpenAICompletionBody}


def recover(endpoint: Endpoint, body: bytes) -> ProxyRequest:
    """Validate and normalise a body; HTTPError 400/422 naming the problem otherwise.

    A valid body is decoded once, straight into the Struct of its shape (a Scheduler request
    names the key "Prompt"; anything else is a plain OpenAI body). A body that does not decode
    so takes the general path, which says exactly what is wrong with it. (A typed decode skips
    the keys its Struct does not name without checking their strings' UTF-8: checked here.)"""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return _recover_slowly(endpoint, body)
    if _SCHEDULER_KEY in body:
        try:
            return _scheduler_request(endpoint, _typed[SchedulerRequest].decode(body))
        except (msgspec.DecodeError, RecursionError):  # not one after all ("Prompt" as a value), or invalid
            pass
    else:
        try:
            return _openai_request(endpoint, _typed[_OPENAI_SCHEMA[endpoint]].decode(body), body)
        except (msgspec.DecodeError, RecursionError):
            pass
    return _recover_slowly(endpoint, body)


def _recover_slowly(endpoint: Endpoint, body: bytes) -> ProxyRequest:
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HTTPError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise HTTPError(400, "invalid_json", "body is nested too deeply") from None
    if not isinstance(raw, dict):
        raise HTTPError(400, "invalid_request_payload", "body must be a JSON object")
    if "Prompt" in raw:
        return _scheduler_request(endpoint, _convert(raw, SchedulerRequest))
    return _from_openai(endpoint, raw, body)


def _convert(raw: Any, schema: type[Any]) -> Any:
    try:
        return msgspec.convert(raw, schema)
    except msgspec.ValidationError as exc:
        raise HTTPError(422, "invalid_request_payload", str(exc)) from None


def _scheduler_request(endpoint: Endpoint, req: SchedulerRequest) -> ProxyRequest:
    prompt = req.Prompt
    # Completions answer JSON: the Scheduler's stream flag is for chat.
    stream = prompt.stream if endpoint is Endpoint.CHAT else False
    body: dict[str, Any] = {"model": prompt.model}
    if endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": prompt.user_prompt}]
    else:
        body["prompt"] = prompt.user_prompt
    body["stream"] = stream
    for name in ("max_tokens", "temperature", "top_p"):
        value = getattr(prompt, name)
        if value is not None:
            body[name] = value
    service = req.Service
    knowledge = KnowledgeSpec(
        enabled=service.Enable_know_injection,
        injection_type=INJECTION_ALIASES.get(service.Injection_type.strip().lower(), "kvcache"),
        knowledge_ids=list(service.Knowledge_List), knowledge_tokens=service.Knowledge_length,
        kdn_addr=req.Task.KDN_server_addr)
    prompt_tokens = prompt.token_length or _estimate_tokens(len(prompt.user_prompt))
    return ProxyRequest(endpoint=endpoint, upstream_body=b"", stream=stream,
                        model=prompt.model, request_id=req.Request_ID,
                        token_length=prompt.token_length, source="cacheroute",
                        prompt_tokens=prompt_tokens,
                        decode_tokens=prompt.max_tokens or DEFAULT_DECODE_TOKENS,
                        body=body, knowledge=knowledge)


def _from_openai(endpoint: Endpoint, raw: dict[str, Any], body: bytes) -> ProxyRequest:
    required = "messages" if endpoint is Endpoint.CHAT else "prompt"
    if required not in raw:
        raise HTTPError(422, "invalid_request_payload",
                        f"Object missing required field `{required}` (or a CacheRoute `Prompt`)")
    return _openai_request(endpoint, _convert(raw, _OPENAI_SCHEMA[endpoint]), body)


def _openai_request(endpoint: Endpoint, parsed: Any, body: bytes) -> ProxyRequest:
    if endpoint is Endpoint.CHAT:
        chars = 0
        for message in parsed.messages:  # a loop, not sum() over a generator: half the cost
            content = message.content
            chars += len(content) if isinstance(content, str) else len(str(content))
        prompt = parsed.messages
    else:
        prompt = parsed.prompt
        chars = len(prompt) if isinstance(prompt, str) else len(str(prompt))
    return ProxyRequest(endpoint=endpoint, upstream_body=body, stream=parsed.stream,
                        model=parsed.model, request_id=0, token_length=None, source="openai",
                        prompt_tokens=_estimate_tokens(chars),
                        decode_tokens=parsed.max_tokens or DEFAULT_DECODE_TOKENS,
                        parsed_prompt=prompt)


def _estimate_tokens(chars: int) -> int:
    """~4 characters a token: good enough to predict prefill time without a tokenizer."""
    return max(1, -(-chars // 4))
