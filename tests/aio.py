"""Async HTTP helpers for tests that hold many streams open at once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp


class OpenStream:
    """A streaming chat request whose first chunk has arrived."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.received = b""

    @classmethod
    async def open(cls, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> "OpenStream":
        response = await session.post(url, json=body)
        stream = cls(response)
        if response.status == 200:
            stream.received += await asyncio.wait_for(response.content.readany(), 10)
        return stream

    @property
    def worker(self) -> str:
        return self.response.headers.get("x-cacheroute-worker", "")

    async def finish(self, timeout: float = 20) -> bytes:
        async def read_rest() -> None:
            async for chunk in self.response.content.iter_any():
                self.received += chunk
        await asyncio.wait_for(read_rest(), timeout)
        return self.received

    def close(self) -> None:
        self.response.close()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        return json.loads(await response.read())


def meta_of(stream_bytes: bytes) -> dict[str, Any]:
    """The cacheroute_meta payload at the end of a proxied stream."""
    marker = b"event: cacheroute_meta\ndata: "
    start = stream_bytes.rindex(marker) + len(marker)
    return json.loads(stream_bytes[start:stream_bytes.index(b"\n", start)])
