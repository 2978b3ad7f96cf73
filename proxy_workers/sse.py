"""SSE pass-through: the instance's bytes go to the client unchanged, except its `data: [DONE]`,
which is withheld so the proxy's `cacheroute_meta` event can come first.

Chunks that cannot contain the marker are passed on without being split or copied; only a
chunk boundary inside a line costs a concatenation.
"""

from __future__ import annotations

from .trace import Knowledge, Trace, encode_meta

DONE_EVENT = b"data: [DONE]\n\n"
_MARKER = b"[DONE]"


class DoneStripper:
    """Feeds upstream chunks, returns what to send now; remembers whether [DONE] was seen."""

    __slots__ = ("_pending", "saw_done")

    def __init__(self) -> None:
        self._pending = b""
        self.saw_done = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:]
        complete = data[:cut] if self._pending else data
        if _MARKER not in complete:
            return complete
        return self._drop_done_lines(complete)

    def flush(self) -> bytes:
        """What is left after the upstream ended (a trailing partial line, unchanged)."""
        rest, self._pending = self._pending, b""
        if rest.strip().startswith(b"data:") and rest.split(b":", 1)[1].strip() == _MARKER:
            self.saw_done = True
            return b""
        return rest

    def _drop_done_lines(self, data: bytes) -> bytes:
        kept = []
        for line in data.splitlines(keepends=True):
            if line.startswith(b"data:") and line[5:].strip() == _MARKER:
                self.saw_done = True
                continue
            kept.append(line)
        return b"".join(kept)


def meta_event(trace: Trace, error: str | None, knowledge: Knowledge | None = None) -> bytes:
    """The stream's `cacheroute_meta` event (without knowledge: its lists and ack empty)."""
    meta = encode_meta(trace, error, knowledge if knowledge is not None else Knowledge())
    return b"event: cacheroute_meta\ndata: " + meta + b"\n\n"


def cut_meta_event(trace: Trace, error: str, knowledge: Knowledge | None = None) -> bytes:
    """The meta event that ends a stream cut short. Relayed bytes end on a line, not always on
    an event: the leading blank line ends a half-sent event first (after a whole one it is an
    empty line, which SSE ignores), so the meta never merges into the instance's last event."""
    return b"\n" + meta_event(trace, error, knowledge)
