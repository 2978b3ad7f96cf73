"""The W3C Trace Context `traceparent` header (https://www.w3.org/TR/trace-context/ §3.2):
`version-traceid-parentid-flags`, lower-case hex, e.g.
`00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01`.

Parsing never raises: a header that is not a valid traceparent is no traceparent at all, and
the proxy starts a new trace instead of refusing the request (the Recommendation's rule for a
receiver). Version 00 is exactly 55 characters; a later version (not ff) may carry more after
a dash, and its first four fields are read as version 00's. All-zero trace or span ids are
invalid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"

SAMPLED = 0x01
_HEX = frozenset(b"0123456789abcdef")
_V00_LENGTH = 55  # 2 + 1 + 32 + 1 + 16 + 1 + 2


class TraceParent(NamedTuple):
    """A parsed traceparent: the trace id (128 bits), the caller's span id (64 bits), flags."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse(value: bytes | str) -> TraceParent | None:
    """The traceparent in `value`, or None if it is not a valid one."""
    raw = value.encode("latin-1") if isinstance(value, str) else value
    raw = raw.strip(b" \t")
    if len(raw) < _V00_LENGTH or raw[2:3] != b"-" or raw[35:36] != b"-" or raw[52:53] != b"-":
        return None
    version = raw[0:2]
    if not _is_hex(version) or version == b"ff":
        return None
    if version == b"00" and len(raw) != _V00_LENGTH:
        return None
    if len(raw) > _V00_LENGTH and raw[55:56] != b"-":  # a later version's extra fields
        return None
    trace_hex, span_hex, flags_hex = raw[3:35], raw[36:52], raw[53:55]
    if not (_is_hex(trace_hex) and _is_hex(span_hex) and _is_hex(flags_hex)):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, int(flags_hex, 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """Version 00's text for these ids: what the proxy sends on (it speaks version 00 only)."""
    if not (0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64 and 0 <= flags < 256):
        raise ValueError("traceparent ids must be non-zero and fit 128/64 bits, flags one byte")
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def from_headers(headers: list[tuple[bytes, bytes]]) -> tuple[TraceParent | None, bytes | None]:
    """The client's trace context in ASGI headers (lower-case names): its traceparent, if one
    valid header is there, and its tracestate (several headers joined with commas, as the
    Recommendation allows), kept only beside a valid traceparent -- without one it means
    nothing (§3.3.1). Two traceparent headers are one invalid one."""
    parents: list[bytes] = []
    states: list[bytes] = []
    for name, value in headers:
        if name == TRACEPARENT:
            parents.append(value)
        elif name == TRACESTATE:
            states.append(value)
    parent = parse(parents[0]) if len(parents) == 1 else None
    if parent is None:
        return None, None
    state = b",".join(s.strip() for s in states if s.strip())
    return parent, state or None


def passed_on(headers: Sequence[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The client's traceparent and tracestate as they came, for a call the proxy makes on the
    request's behalf with spans off (the KDN's): a hop that is no part of the trace passes the
    context on untouched. None if the client sent neither."""
    found = {name.decode(): value.decode("latin-1") for name, value in headers
             if name == TRACEPARENT or name == TRACESTATE}
    return found or None


def _is_hex(text: bytes) -> bool:
    return all(c in _HEX for c in text)
