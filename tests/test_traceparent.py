"""The traceparent header's parsing and formatting (proxy_workers/traceparent.py), against the
W3C Trace Context rules: what is valid, what is not (never an exception), the client's
tracestate kept only beside a valid traceparent, and the header names the proxy writes
itself when spans are on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy_workers.headers import forwarded_block, request_dropped
from proxy_workers.traceparent import TraceParent, format_traceparent, from_headers, parse, passed_on

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_valid_version_00_header_is_parsed():
    assert parse(VALID) == TraceParent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert parse(VALID.encode()) == parse(VALID)
    assert parse(VALID).sampled and not parse(VALID[:-2] + "00").sampled


@pytest.mark.parametrize("value", [
    "",
    "00",
    VALID[:-1],                                     # too short
    VALID + "0",                                    # version 00 is exactly 55 characters
    VALID + "-extra",                               # ... even with a dash
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff is forbidden
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0x",  # not hex
    "00_0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331_01",  # wrong separators
    "00-0af7651916cd43dd8448eb211c80319-cb7ad6b7169203331-01",  # fields shifted
    "0g-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",  # later version: dash needed
])
def test_an_invalid_header_is_none(value):
    assert parse(value) is None


def test_a_later_version_is_read_as_version_00_with_its_extra_fields_ignored():
    assert parse("cc" + VALID[2:] + "-what-comes-later") == parse(VALID)
    assert parse("01" + VALID[2:]) == parse(VALID)


def test_surrounding_blanks_are_optional_whitespace():
    assert parse(f" {VALID}\t") == parse(VALID)


@given(st.integers(1, (1 << 128) - 1), st.integers(1, (1 << 64) - 1), st.integers(0, 255))
def test_format_and_parse_round_trip(trace_id, span_id, flags):
    text = format_traceparent(trace_id, span_id, flags)
    assert len(text) == 55 and text == text.lower()
    assert parse(text) == (trace_id, span_id, flags)


@given(st.binary(max_size=80))
def test_parsing_anything_never_raises(raw):
    result = parse(raw)
    assert result is None or (result.trace_id and result.span_id)


@pytest.mark.parametrize("ids", [(0, 1, 1), (1, 0, 1), (1 << 128, 1, 1), (1, 1 << 64, 1), (1, 1, 256)])
def test_format_refuses_what_no_traceparent_can_hold(ids):
    with pytest.raises(ValueError):
        format_traceparent(*ids)


def test_from_headers_keeps_tracestate_beside_a_valid_traceparent_only():
    headers = [(b"traceparent", VALID.encode()), (b"tracestate", b"a=1"), (b"tracestate", b" b=2 ")]
    assert from_headers(headers) == (parse(VALID), b"a=1,b=2")
    assert from_headers([(b"traceparent", b"junk"), (b"tracestate", b"a=1")]) == (None, None)
    assert from_headers([(b"tracestate", b"a=1")]) == (None, None)
    assert from_headers([(b"traceparent", VALID.encode())]) == (parse(VALID), None)
    # Two traceparent headers cannot both be the caller: neither is.
    assert from_headers([(b"traceparent", VALID.encode())] * 2) == (None, None)


def test_passed_on_gives_the_client_context_as_it_came():
    headers = [(b"user-agent", b"x"), (b"traceparent", b"not even valid"), (b"tracestate", b"a=1")]
    assert passed_on(headers) == {"traceparent": "not even valid", "tracestate": "a=1"}
    assert passed_on([(b"user-agent", b"x")]) is None


def test_with_spans_on_the_proxy_writes_the_trace_context_itself():
    headers = [(b"traceparent", VALID.encode()), (b"tracestate", b"a=1"), (b"x-session-id", b"s")]
    assert forwarded_block(headers, request_dropped(False)) == \
        b"traceparent: " + VALID.encode() + b"\r\ntracestate: a=1\r\nx-session-id: s\r\n"
    assert forwarded_block(headers, request_dropped(False, replace_trace_context=True)) == \
        b"x-session-id: s\r\n"
    assert b"authorization" in request_dropped(True, replace_trace_context=True)
