"""The body of a control-plane write, by one rule for every JSON route (docs/protocol.md,
"Routes and access").

Taken as JSON: a body sent as `application/json` (or a `+json` type), or with no content type,
or as `application/x-www-form-urlencoded` when it parses as JSON, because that is what a plain
`curl -d '{...}'` sends and an operator expects it to work. Refused with 415 naming
application/json: any other type (`text/xml`, ...), and a form body that is not JSON.

What a web page in a browser on this host can POST cross-site without a CORS preflight (a form
or text/plain body, or one with no content type: fetch with a Blob or an ArrayBuffer) is
refused whatever its bytes: with no token, it would let the page register an instance and so
receive requests. A browser marks every such request with `Origin` (on any POST) and, since
2019-2023, `Sec-Fetch-Site`; a page cannot remove either, and curl, the agent and scripts send
neither. A JSON content type needs a preflight, which this server never grants to another origin.
"""

from __future__ import annotations

from typing import TypeVar

from starlette.requests import Request

from cacheroute_proxy.http import HTTPError, decode_json, read_body

T = TypeVar("T")

BODY_LIMIT = 1024 * 1024
JSON_TYPE = "application/json"
CURL_FORM_TYPE = "application/x-www-form-urlencoded"  # what `curl -d` sends
_SIMPLE_TYPES = frozenset({"", "text/plain", CURL_FORM_TYPE, "multipart/form-data"})


async def json_body(request: Request, schema: type[T]) -> T:
    """The body decoded into `schema`; 415 for a body of the wrong type, else decode_json's
    400 (not JSON), 413 (over BODY_LIMIT) and 422 (a field)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type in _SIMPLE_TYPES and _from_a_web_page(request):
        raise HTTPError(415, "unsupported_media_type",
                        f"control-plane writes take {JSON_TYPE}; a web page's "
                        f"{media_type or 'body without a content type'} is refused (a page could "
                        "send it cross-site without a CORS preflight)")
    if not (_is_json(media_type) or media_type in ("", CURL_FORM_TYPE)):
        raise HTTPError(415, "unsupported_media_type",
                        f"control-plane writes take {JSON_TYPE}, not {media_type}")
    body = await read_body(request, BODY_LIMIT)
    try:
        return decode_json(body, schema)
    except HTTPError as exc:
        if media_type == CURL_FORM_TYPE and exc.code == "invalid_json":  # a real form
            raise HTTPError(415, "unsupported_media_type",
                            f"the body was sent as {CURL_FORM_TYPE} and is not JSON: control-plane "
                            f"writes take {JSON_TYPE}") from None
        raise


def _is_json(media_type: str) -> bool:
    return media_type == JSON_TYPE or (media_type.startswith("application/") and media_type.endswith("+json"))


def _from_a_web_page(request: Request) -> bool:
    headers = request.headers
    return "origin" in headers or "sec-fetch-site" in headers
