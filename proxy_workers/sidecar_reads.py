"""Observation routes the sidecar owns, answered by every worker by asking it: what the registry
keeps (resource snapshots, topology, pool_resource) lives in the sidecar's memory, not in the
shared table, so a worker has no copy of its own.

Not a hot path: one short-lived connection per call, the caller's Authorization header passed
on (the sidecar checks it again), a short timeout, and a JSON 502 or 504 naming the sidecar
when it does not answer. The sidecar's status and body come back unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, NamedTuple

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from cacheroute_proxy.auth import TokenGuard
from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError, from_http_error

# The routes forwarded as they are, query string included.
SIDECAR_READS = ("/debug/instance_resources", "/debug/pool_resource", "/debug/pool_resource_sources",
                 "/v1/topology/kdn_links")
SIDECAR_READ_TIMEOUT_S = 2.0
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}

Handler = Callable[[Request], Awaitable[Response]]


class SidecarAnswer(NamedTuple):
    status: int
    body: bytes
    content_type: str


def control_plane_url(settings: Settings) -> str:
    """Where a worker reaches the sidecar: its control plane, on loopback if it listens on all."""
    host = _WILDCARDS.get(settings.cp_host, settings.cp_host)
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.cp_port}"


async def ask_sidecar(base: str, target: str, auth: str | None = None,
                      timeout_s: float = SIDECAR_READ_TIMEOUT_S) -> SidecarAnswer:
    """`GET {base}{target}` on a connection of its own; HTTPError 504 `sidecar_timeout` or 502
    `sidecar_unreachable`, naming the address, when the sidecar does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{base}{target}", headers={"Authorization": auth} if auth else {},
                                   allow_redirects=False) as answer:
                return SidecarAnswer(answer.status, await answer.read(),
                                     answer.headers.get("content-type", "application/json"))
    except asyncio.TimeoutError:
        raise HTTPError(504, "sidecar_timeout",
                        f"the sidecar's control plane ({base}) did not answer within {timeout_s:g}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise HTTPError(502, "sidecar_unreachable",
                        f"the sidecar's control plane ({base}) did not answer: {exc or type(exc).__name__}") from None


def sidecar_read(settings: Settings, guard: TokenGuard,
                 timeout_s: float = SIDECAR_READ_TIMEOUT_S) -> Handler:
    base = control_plane_url(settings)

    async def forward(request: Request) -> Response:
        try:
            guard.check(request)
            query = request.url.query
            answer = await ask_sidecar(base, f"{request.url.path}{'?' + query if query else ''}",
                                       request.headers.get("authorization"), timeout_s)
        except HTTPError as exc:
            return from_http_error(exc)
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type)
    return forward
