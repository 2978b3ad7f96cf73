"""HTTP helpers shared by both planes: msgspec JSON responses and one error shape.

Every error body is ``{"error": <code>, "detail": <string>}`` (the original's shape), so a
client can tell bad input (4xx, the detail names the field) from a proxy fault (5xx).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class HTTPError(Exception):
    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else _encoder.encode(content)


def error_response(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def from_http_error(exc: HTTPError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.detail, exc.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) as soon as it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, "payload_too_large", f"body of {declared} bytes exceeds the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, "payload_too_large", f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(body: bytes, schema: type[T], invalid_code: str = "invalid_payload") -> T:
    """Decode and validate; 400 for bytes that are not JSON, 422 naming the field otherwise."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise HTTPError(422, invalid_code, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise HTTPError(400, "invalid_json", str(exc)) from None
    except RecursionError:
        raise HTTPError(400, "invalid_json", "body is nested too deeply") from None


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, "not_found", f"no route {request.method} {request.url.path}")


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")


async def internal_error(request: Request, exc: Exception) -> Response:
    logging.getLogger("cacheroute.http").error("unhandled error on %s %s", request.method,
                                               request.url.path, exc_info=exc)
    return error_response(500, "internal_error", f"{type(exc).__name__} (details in the log)")


# Starlette exception_handlers for both planes: every error is JSON in the same shape.
ERROR_HANDLERS = {404: not_found, 405: method_not_allowed, Exception: internal_error}
