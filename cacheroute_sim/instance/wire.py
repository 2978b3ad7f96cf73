"""OpenAI wire formats the simulated Instance emits, as msgspec Structs.

Field order follows OpenAI/vLLM output so byte-level diffs against a real server stay small.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from cacheroute_sim.instance.request_model import GenerationRequest

TOKEN_TEXT = "tok "
SSE_DONE = b"data: [DONE]\n\n"


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatDelta(msgspec.Struct, omit_defaults=True):
    # omit_defaults: the role chunk carries only role, content chunks only content, the
    # final chunk an empty delta {} -- exactly like OpenAI.
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class TextCompletion(msgspec.Struct, omit_defaults=True):
    # Used for both the non-streaming body and stream chunks (OpenAI uses one shape).
    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class SimError(msgspec.Struct):
    message: str
    type: str
    code: int


class SimErrorBody(msgspec.Struct):
    error: SimError


class Formatter:
    """Builds the chunks and bodies of one response (one id and timestamp throughout)."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        prefix = "chatcmpl-sim-" if request.kind == "chat" else "cmpl-sim-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self) -> Usage:
        r = self.request
        return Usage(r.prompt_tokens, r.completion_tokens, r.prompt_tokens + r.completion_tokens)

    def first_token_event(self) -> bytes:
        """Role chunk (chat only) plus the first content chunk, sent together after prefill."""
        token = self.token_event()
        if self.request.kind != "chat":
            return token
        return sse(self._chat_chunk(ChatDelta(role="assistant"), None)) + token

    def token_event(self) -> bytes:
        if self.request.kind == "chat":
            return sse(self._chat_chunk(ChatDelta(content=TOKEN_TEXT), None))
        return sse(self._text_chunk(TOKEN_TEXT, None))

    def final_events(self) -> bytes:
        """Finish chunk, optional usage chunk, then [DONE]."""
        reason = self.request.finish_reason
        usage: ChatChunk | TextCompletion
        if self.request.kind == "chat":
            out = sse(self._chat_chunk(ChatDelta(), reason))
            usage = ChatChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                              model=self.request.model, choices=[], usage=self.usage())
        else:
            out = sse(self._text_chunk("", reason))
            usage = TextCompletion(id=self.id, object="text_completion", created=self.created,
                                   model=self.request.model, choices=[], usage=self.usage())
        if self.request.include_usage:
            out += sse(usage)
        return out + SSE_DONE

    def full_body(self) -> bytes:
        r = self.request
        text = TOKEN_TEXT * r.completion_tokens
        if r.kind == "chat":
            choice = ChatChoice(0, ChatMessage("assistant", text), r.finish_reason)
            return msgspec.json.encode(ChatCompletion(self.id, "chat.completion", self.created,
                                                      r.model, [choice], self.usage()))
        text_choice = TextChoice(0, text, None, r.finish_reason)
        return msgspec.json.encode(TextCompletion(id=self.id, object="text_completion",
                                                  created=self.created, model=r.model,
                                                  choices=[text_choice], usage=self.usage()))

    def _chat_chunk(self, delta: ChatDelta, finish_reason: str | None) -> ChatChunk:
        return ChatChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                         model=self.request.model,
                         choices=[ChatChunkChoice(0, delta, finish_reason)])

    def _text_chunk(self, text: str, finish_reason: str | None) -> TextCompletion:
        return TextCompletion(id=self.id, object="text_completion", created=self.created,
                              model=self.request.model,
                              choices=[TextChoice(0, text, None, finish_reason)])


def sse(event: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def error_body(status: int) -> bytes:
    return msgspec.json.encode(SimErrorBody(SimError("simulated failure", "sim_error", status)))
