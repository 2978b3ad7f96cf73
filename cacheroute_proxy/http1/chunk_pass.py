"""A relayed chunked body's whole chunks passed to the client as they came: the compiled
ChunkPass (_chunk_pass.c) where the install built it, and the type its users see. Without it
(None) every read of a relayed body is parsed and framed again, as before it."""

from __future__ import annotations

from typing import Protocol

try:
    from ._chunk_pass import ChunkPass
except ImportError:  # not built (setup.py)
    ChunkPass = None

NATIVE_CHUNK_PASS = ChunkPass is not None


class ChunkPasser(Protocol):
    """Each read of the body goes to it first: 0 (parse it), 1 (passed on), 2 (passed on, and
    the client's socket is full). It passes only while `relaying` (set by the response while a
    relay waits) and `ready` (set by the consumer: it would pass such data on unchanged)."""

    relaying: bool
    ready: bool

    def __call__(self, data: bytes, /) -> int: ...
