"""A plain OpenAI-compatible fake backend for bench-peers: Starlette on uvicorn, written for the
benchmark so its figures do not depend on the project's simulator (it imports neither
cacheroute_sim nor the product).

It answers the way vLLM's OpenAI server does, on the wire: POST /v1/chat/completions and
/v1/completions (non-stream JSON with content-length; `"stream": true` as SSE, `data: {...}\\n\\n`
chunks then `data: [DONE]\\n\\n`, chunked), GET /health (200, empty, what vllm-router waits
for), GET /v1/models and /version; uvicorn's `date` and `server: uvicorn`, and `x-request-id`
(the request's, else a new one, as vLLM's --enable-request-id-headers). The answer is tiny and
fixed (max_tokens words, one SSE chunk each) and comes without artificial delay: the backend is
cheap, so the proxies in front of it decide the numbers. With --token-interval-ms a stream's
chunks come that far apart, as an engine sends one token per decode step: a relay then wakes
for every token instead of finding many in one read.

    python -m bench.peers.openai_fake --host 127.0.0.1 --port 9100 [--model sim-model]
        [--token-interval-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULT_MAX_TOKENS = 16
WORD = "hello"
REQUEST_ID = "x-request-id"
SSE_DONE = b"data: [DONE]\n\n"


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(body) + b"\n\n"


def error(status: int, message: str) -> JSONResponse:
    """vLLM's error body shape."""
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError",
                         "param": None, "code": status}, status_code=status)


class Fake:
    """The answers of one fake instance (served model name fixed at start)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.created = int(time.time())

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": None}

    def chat(self, request_id: str, tokens: int, prompt_tokens: int) -> dict[str, Any]:
        message = {"role": "assistant", "reasoning_content": None,
                   "content": " ".join([WORD] * tokens), "tool_calls": []}
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion",
                "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "length", "stop_reason": None}],
                "usage": self.usage(prompt_tokens, tokens), "prompt_logprobs": None}

    def chat_chunks(self, request_id: str, tokens: int) -> list[bytes]:
        head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                "created": self.created, "model": self.model}

        def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            return sse({**head, "choices": [choice]})

        return [chunk({"role": "assistant", "content": ""}, None),
                *(chunk({"content": _word(i)}, None) for i in range(tokens)),
                chunk({"content": ""}, "length"), SSE_DONE]

    def completion(self, request_id: str, tokens: int, prompt_tokens: int) -> dict[str, Any]:
        return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": " ".join([WORD] * tokens), "logprobs": None,
                             "finish_reason": "length", "stop_reason": None,
                             "prompt_logprobs": None}],
                "usage": self.usage(prompt_tokens, tokens)}

    def completion_chunks(self, request_id: str, tokens: int) -> list[bytes]:
        head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": self.created,
                "model": self.model}

        def chunk(text: str, finish: str | None) -> bytes:
            return sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish, "stop_reason": None}]})

        return [*(chunk(_word(i), None) for i in range(tokens)), chunk("", "length"), SSE_DONE]

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": 2048, "permission": []}]}


def _word(i: int) -> str:
    return WORD if i == 0 else " " + WORD


def _prompt_tokens(body: dict[str, Any]) -> int:
    """A rough count (words), enough for a plausible `usage`."""
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"].split())
    return sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or []
               if isinstance(m, dict))


async def _parsed(request: Request, required: str) -> dict[str, Any] | JSONResponse:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return error(400, "the request body is not valid JSON")
    if not isinstance(body, dict) or required not in body:
        return error(400, f"'{required}' is required")
    tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        return error(400, "max_tokens must be a positive integer")
    return body


def _request_id(request: Request) -> str:
    return request.headers.get(REQUEST_ID) or uuid.uuid4().hex


async def _relay(chunks: list[bytes], interval_s: float) -> AsyncIterator[bytes]:
    for index, chunk in enumerate(chunks):
        if interval_s and index:
            await asyncio.sleep(interval_s)
        yield chunk


def generation_route(fake: Fake, required: str,
                     whole: Callable[[str, int, int], dict[str, Any]],
                     chunks: Callable[[str, int], list[bytes]], interval_s: float) -> Callable[..., Any]:
    async def endpoint(request: Request) -> Response:
        body = await _parsed(request, required)
        if isinstance(body, JSONResponse):
            return body
        request_id, tokens = _request_id(request), body.get("max_tokens", DEFAULT_MAX_TOKENS)
        headers = {REQUEST_ID: request_id}
        if body.get("stream"):
            return StreamingResponse(_relay(chunks(request_id, tokens), interval_s),
                                     media_type="text/event-stream", headers=headers)
        return Response(_dumps(whole(request_id, tokens, _prompt_tokens(body))),
                        media_type="application/json", headers=headers)
    return endpoint


def build_app(model: str = "sim-model", token_interval_ms: float = 0.0) -> Starlette:
    fake = Fake(model)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(fake.models())

    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": "0.0.0+openai-fake"})

    interval_s = token_interval_ms / 1000
    return Starlette(routes=[
        Route("/v1/chat/completions", generation_route(fake, "messages", fake.chat, fake.chat_chunks,
                                                       interval_s), methods=["POST"]),
        Route("/v1/completions", generation_route(fake, "prompt", fake.completion,
                                                  fake.completion_chunks, interval_s), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m bench.peers.openai_fake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim-model", help="the served model name")
    p.add_argument("--token-interval-ms", type=float, default=0.0,
                   help="between a stream's chunks (0: all at once)")
    a = p.parse_args(argv)
    # vLLM's server: uvicorn with a 5 s keep-alive; no access log (the backend must stay cheap).
    uvicorn.run(build_app(a.model, a.token_interval_ms), host=a.host, port=a.port, log_level="warning",
                access_log=False, timeout_keep_alive=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
