"""Plain-text helpers the CLI's views share."""

from __future__ import annotations

from typing import Sequence


def printable(value: object) -> str:
    """A value from the wire as terminal-safe text: an id holding escape sequences or newlines
    must not redraw the operator's screen (shown escaped instead)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns as wide as their widest cell, indented by two spaces."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(f"{cell:<{w}}" for cell, w in zip(line, widths)).rstrip()
             for line in (headers, *rows)]
    return "\n".join("  " + line for line in lines)
