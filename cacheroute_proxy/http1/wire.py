"""The bytes of HTTP/1.1 the server writes: status lines, the `date` header, the header checks,
and the plain answers it gives on its own (400, 413, 500)."""

from __future__ import annotations

import email.utils
import re
import time
from http import HTTPStatus

Header = tuple[bytes, bytes]

_STATUS_LINES = {int(s): b"HTTP/1.1 %d %s\r\n" % (s, s.phrase.encode()) for s in HTTPStatus}
NO_BODY_STATUSES = frozenset({204, 304})
# What a header may not carry (response splitting); uvicorn refuses the same.
UNSAFE_NAME = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")
UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0A-\x1F\x7F]")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def check_header(name: bytes, value: bytes) -> None:
    if UNSAFE_NAME.search(name):
        raise RuntimeError("Invalid HTTP header name.")
    if UNSAFE_VALUE.search(value):
        raise RuntimeError("Invalid HTTP header value.")


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class _DateHeader:
    """The `date` header, formatted once a second, not once a response."""

    def __init__(self) -> None:
        self._second = -1
        self.value = b""

    def current(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self.value = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.value


DATE = _DateHeader()


def plain_answer(status: int, text: bytes) -> bytes:
    return (status_line(status) + DATE.current() + b"server: cacheroute-proxy\r\n"
            b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(text) + text)
