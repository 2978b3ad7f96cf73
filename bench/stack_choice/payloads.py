"""What every server and the backend answer, and what the load generator sends."""

from __future__ import annotations

import json
from pathlib import Path

HOST = "127.0.0.1"
N_CHUNKS = 20  # SSE chunks per streaming response (the last one is "data: [DONE]")
REPO = Path(__file__).resolve().parents[2]

JSON_BODY = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "bench-model",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hello from the backend"},
         "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
}
JSON_BYTES = json.dumps(JSON_BODY, separators=(",", ":")).encode()
SSE_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench-model",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
SSE_DONE = b"data: [DONE]\n\n"
REQ_BODY = (
    '{"model":"bench-model","messages":[{"role":"user","content":"Say hello."}],'
    '"max_tokens":16,"stream":false}'
)
