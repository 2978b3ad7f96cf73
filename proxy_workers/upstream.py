"""Talking to instances: one pooled keep-alive aiohttp session per worker, bounded timeouts.

Three separate bounds, because they fail differently: connect (the instance is down),
first byte (it accepted the request but never answers: a hung engine) and idle (a stream that
stalls mid-way). None of them is the original's 6-hour total.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp

from cacheroute.config import Settings
from cacheroute.http import HTTPError


def base_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class UpstreamFailure(Exception):
    """The instance failed after the response started; `reason` goes into cacheroute_meta."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Upstream:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._headers = {"Content-Type": "application/json"}
        if settings.openai_api_key:  # never "Bearer None"
            self._headers["Authorization"] = f"Bearer {settings.openai_api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._settings.upstream_pool_size,
                                         keepalive_timeout=60, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, connect=self._settings.upstream_connect_timeout_s,
                                        sock_connect=self._settings.upstream_connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream.start() not called"
        return self._session

    async def open(self, url: str, body: bytes, extra_headers: dict[str, str] | None = None
                   ) -> aiohttp.ClientResponse:
        """POST and wait for the response head; HTTPError 502/504 if that does not happen."""
        assert self._session is not None, "Upstream.start() not called"
        try:
            async with asyncio.timeout(self._settings.upstream_first_byte_timeout_s):
                headers = self._headers if not extra_headers else {**self._headers, **extra_headers}
                return await self._session.post(url, data=body, headers=headers)
        except TimeoutError:
            raise HTTPError(504, "upstream_timeout",
                            f"{url} sent no response within {self._settings.upstream_first_byte_timeout_s:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise HTTPError(502, "upstream_unavailable", f"cannot connect to {url}: {exc.os_error}") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a host idna rejects
            raise HTTPError(502, "upstream_unavailable", f"{url}: {type(exc).__name__}: {exc}") from None

    async def chunks(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body as it arrives; UpstreamFailure on a stall, reset or truncation."""
        idle = self._settings.upstream_idle_timeout_s
        content = response.content
        while True:
            try:
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
            except TimeoutError:
                raise UpstreamFailure(f"upstream_idle_timeout: no data for {idle:g}s") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamFailure(f"upstream_failed: {type(exc).__name__}: {exc}") from None
            if not chunk:
                return
            yield chunk

    async def read_all(self, response: aiohttp.ClientResponse) -> bytes:
        parts = [chunk async for chunk in self.chunks(response)]
        return b"".join(parts)
