"""SSE pass-through: the instance's bytes go to the client unchanged, except its final
`data: [DONE]`, which is withheld so the proxy's `cacheroute_meta` event can come first.

Nothing parses the stream: a chunk is passed on as it came, without being split or copied,
unless its tail holds the marker or may be the start of its line. What precedes the marker in
its chunk is held too, so the stream's last events, the meta and `[DONE]` leave in one write.
"""

from __future__ import annotations

from typing import Callable

from cacheroute_proxy.http1.chunk_pass import ChunkPasser

from .trace import EMPTY_KNOWLEDGE, Knowledge, Trace, encode_meta

DONE_EVENT = b"data: [DONE]\n\n"
_MARKER = b"[DONE]"
_DONE_LINES = (b"data: [DONE]", b"data:[DONE]")
_LOOK_BACK = 48  # bytes from a chunk's end searched for the marker: its line, line ends, spaces


class DoneStripper:
    """Feeds upstream chunks, returns what to send now; `saw_done`: the last one ended with [DONE].

    Only a chunk's tail is looked at: `data: [DONE]` ends a stream, so a chunk that does not
    end with it passes as it came, and one that ends in the middle of a line holds back just
    that line, if it could be the start of the marker's. A chunk that ends with the marker is
    held whole but for the marker's line, for `flush` to hand over with the end. (A `[DONE]`
    line anywhere but at the end of the stream is relayed like any other.)"""

    __slots__ = ("_held", "saw_done")

    def __init__(self) -> None:
        self._held = b""
        self.saw_done = False

    def feed(self, chunk: bytes) -> bytes:
        self.saw_done = False  # a piece after the marker: it did not end the stream
        if self._held:
            chunk, self._held = self._held + chunk, b""
        at = chunk.find(_MARKER, -_LOOK_BACK)
        if at >= 0:
            start = chunk.rfind(b"\n", 0, at) + 1
            if chunk[start:].strip() in _DONE_LINES:
                self.saw_done = True
                self._held = chunk[:start]  # leaves with the end (flush), in the same write
                return b""
            return chunk
        if chunk[-1:] == b"\n":
            return chunk
        start = chunk.rfind(b"\n") + 1  # ends mid-line: hold it if it may become the marker's
        rest = chunk[start:]
        if _DONE_LINES[0].startswith(rest) or _DONE_LINES[1].startswith(rest):
            self._held = rest
            return chunk[:start]
        return chunk

    def flush(self) -> bytes:
        """What is held after the upstream ended: the events before the marker, or a line cut
        short (unchanged)."""
        rest, self._held = self._held, b""
        return rest


# What a ChunkPass looks for in a read's last chunk before it passes the read on as it came:
# the data that `StreamRelay.__call__` passes on unchanged (Cycle.chunk_passer).
PASS_TAIL = (_MARKER, _LOOK_BACK)


class StreamRelay(DoneStripper):
    """The sink of an instance's stream (UpstreamResponse.relay): each piece to the client as
    it arrives (`write` says True when the client is full), but for the final `[DONE]`, with
    `on_first` called at the first piece, once that piece is on its way: the client's first
    token waits for no bookkeeping.

    `passer` (Cycle.chunk_passer, or None) passes reads to the client before they get here,
    while it is `ready`: from the first piece on, as long as nothing is held."""

    __slots__ = ("_write", "_on_first", "passer")

    def __init__(self, write: Callable[[bytes], bool], on_first: Callable[[], None],
                 passer: ChunkPasser | None = None) -> None:
        super().__init__()
        self._write = write
        self._on_first: Callable[[], None] | None = on_first
        self.passer = passer

    def __call__(self, chunk: bytes) -> bool:
        # `feed`'s pass-through case, inlined for the common piece (not the first, nothing held,
        # no marker near its end, ending a line): a stream is a call a token, each on a cold
        # cache when tokens come milliseconds apart, so the frame saved is saved per token.
        if self._on_first is None and not self._held and chunk[-1:] == b"\n" \
                and chunk.find(_MARKER, -_LOOK_BACK) < 0:
            return self._write(chunk)
        data = self.feed(chunk)
        full = self._write(data) if data else False
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first()
        if self.passer is not None:
            self.passer.ready = not self._held
        return full


def meta_event(trace: Trace, error: str | None, knowledge: Knowledge | None = None) -> bytes:
    """The stream's `cacheroute_meta` event (without knowledge: its lists and ack empty)."""
    meta = encode_meta(trace, error, knowledge if knowledge is not None else EMPTY_KNOWLEDGE)
    return b"event: cacheroute_meta\ndata: " + meta + b"\n\n"


def cut_meta_event(trace: Trace, error: str, knowledge: Knowledge | None = None) -> bytes:
    """The meta event that ends a stream cut short. Relayed bytes end on a line, not always on
    an event: the leading blank line ends a half-sent event first (after a whole one it is an
    empty line, which SSE ignores), so the meta never merges into the instance's last event."""
    return b"\n" + meta_event(trace, error, knowledge)
