"""Pure units: request recovery, SSE pass-through, configuration."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheroute_proxy.config import Settings
from cacheroute_proxy.http import HTTPError
from proxy_workers.request_model import Endpoint, _recover_slowly, recover
from tests import fuzz_strategies as fz
from proxy_workers.sse import DONE_EVENT, DoneStripper, StreamRelay, meta_event
from proxy_workers.trace import Trace


def _scheduler(**prompt):
    return json.dumps({"Request_ID": 3, "Prompt": {"model": "m", "user_prompt": "q", **prompt}}).encode()


def test_scheduler_chat_body_becomes_openai_body():
    req = recover(Endpoint.CHAT, _scheduler(stream=True, max_tokens=9, temperature=0.5, top_p=None))
    assert req.source == "cacheroute" and req.stream and req.request_id == 3
    assert json.loads(req.encoded_body()) == {"model": "m", "messages": [{"role": "user", "content": "q"}],
                                             "stream": True, "max_tokens": 9, "temperature": 0.5}


def test_scheduler_completions_never_stream():
    req = recover(Endpoint.COMPLETIONS, _scheduler(stream=True))
    assert not req.stream and json.loads(req.encoded_body())["prompt"] == "q"


def test_openai_body_is_forwarded_unchanged():
    raw = b'{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}],"stop":["x"]}'
    req = recover(Endpoint.CHAT, raw)
    assert req.encoded_body() is raw and req.source == "openai" and not req.stream


@pytest.mark.parametrize("endpoint, raw, status, words", [
    (Endpoint.CHAT, b"nope", 400, "JSON"),
    (Endpoint.CHAT, b'"str"', 400, "object"),
    (Endpoint.COMPLETIONS, b'{"messages": []}', 422, "prompt"),
    (Endpoint.CHAT, _scheduler(max_tokens=0), 422, "max_tokens"),
    (Endpoint.CHAT, _scheduler(max_tokens=10**9), 422, "max_tokens"),
    (Endpoint.CHAT, _scheduler(token_length=-1), 422, "token_length"),
    (Endpoint.CHAT, _scheduler(stream="yes"), 422, "stream"),
])
def test_bad_requests(endpoint, raw, status, words):
    with pytest.raises(HTTPError) as info:
        recover(endpoint, raw)
    assert info.value.status == status and words in info.value.detail


def test_done_is_withheld_and_everything_else_passes_unchanged():
    stripper = DoneStripper()
    upstream = [b"data: {\"a\":1}\n\n", b"data: {\"b\"", b":2}\n\ndata: [DO", b"NE]\n\n"]
    sent = [stripper.feed(c) for c in upstream]
    assert sent == [upstream[0], upstream[1], b":2}\n\n", b""]  # only the marker's line was held
    assert stripper.flush() == b"" and stripper.saw_done


@pytest.mark.parametrize("chunk", [b"data: {\"x\": 1}\n\n", b"data: {\"x\": \"[DONE]\"}\n\n",
                                   b"data: [DONE]\n\nevent: late\ndata: {}\n\n", b"data: partial"])
def test_a_chunk_that_does_not_end_the_stream_is_passed_as_is(chunk):
    stripper = DoneStripper()
    assert stripper.feed(chunk) is chunk and stripper.flush() == b"" and not stripper.saw_done


@pytest.mark.parametrize("tail", [b"data: [DONE]\n\n", b"data:[DONE]\r\n\r\n", b"data: [DONE]"])
def test_the_marker_is_found_at_the_tail_in_any_spelling(tail):
    stripper = DoneStripper()
    assert stripper.feed(b"data: {}\n\n" + tail) == b"" and stripper.saw_done
    assert stripper.flush() == b"data: {}\n\n"  # the events before it leave with the end


def test_events_held_with_a_marker_that_was_not_the_end_go_before_what_follows():
    stripper = DoneStripper()
    assert stripper.feed(b"data: {}\n\ndata: [DONE]\n\n") == b""
    assert stripper.feed(b"data: {\"late\":1}\n\n") == b"data: {}\n\ndata: {\"late\":1}\n\n"
    assert not stripper.saw_done


def test_a_held_line_that_never_became_the_marker_is_flushed_unchanged():
    stripper = DoneStripper()
    assert stripper.feed(b"data: {}\n\ndata: [DO") == b"data: {}\n\n"
    assert stripper.flush() == b"data: [DO" and not stripper.saw_done


def test_the_stream_relay_writes_what_passes_and_calls_back_at_the_first_piece():
    written, firsts = [], []
    relay = StreamRelay(lambda data: written.append(data) or len(written) > 1, lambda: firsts.append(1))
    assert relay(b"data: {}\n\n") is False and firsts == [1]
    assert relay(b"data: {}\n\n") is True  # the writer said it is full
    assert relay(b"data: [DONE]\n\n") is False and firsts == [1] and relay.saw_done
    assert written == [b"data: {}\n\n"] * 2


def test_the_first_piece_is_written_before_the_first_token_bookkeeping_runs():
    order: list[str] = []
    relay = StreamRelay(lambda data: order.append("write") or False, lambda: order.append("first"))
    relay(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
    relay(b"data: {}\n\n")
    assert order == ["write", "first", "write"]


def test_meta_event_shape():
    event = meta_event(Trace(proxy_recv_ms=1), None)
    assert event.startswith(b"event: cacheroute_meta\ndata: {\"trace\":") and event.endswith(b"\n\n")
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_no_authorization_header_without_a_key():
    from proxy_workers.upstream import Upstream

    assert b"uthorization" not in Upstream(Settings())._own  # never "Bearer None"
    assert b"Authorization: Bearer k\r\n" in Upstream(Settings(openai_api_key="k"))._own


# --- the one-decode path against the general one -----------------------------------------------
def _outcome(recovering, endpoint: Endpoint, raw: bytes):
    try:
        return recovering(endpoint, raw)
    except HTTPError as exc:
        return ("refused", exc.status, exc.code, exc.detail)


@settings(max_examples=400, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fz.data_case("127.0.0.1:9", branches=tuple(b for f in fz.FAMILIES.values() for b in f)),
       plant=st.sampled_from([None, "value", "nested"]))
def test_decoding_straight_into_the_struct_answers_as_the_general_path(case, plant) -> None:
    """Whatever the body, `recover` (one typed decode, the general path only when that fails)
    gives what the general path gives: the same request, or the same refusal word for word.
    Some bodies also carry the string "Prompt" as a value, which sends them to the Scheduler
    decode first."""
    raw = case.raw
    if plant and raw.startswith(b"{") and raw.rstrip().endswith(b"}"):
        extra = b'"x":"Prompt"' if plant == "value" else b'"x":{"Prompt":1}'
        raw = raw.rstrip()[:-1] + (b"," if raw.strip() != b"{}" else b"") + extra + b"}"
    endpoint = Endpoint.CHAT if case.path == fz.CHAT else Endpoint.COMPLETIONS
    assert _outcome(recover, endpoint, raw) == _outcome(_recover_slowly, endpoint, raw)


@pytest.mark.parametrize("endpoint", list(Endpoint))
@pytest.mark.parametrize("key", ["x", "Prompt"])
def test_nesting_too_deep_for_the_typed_decode_is_the_general_paths_400(endpoint, key) -> None:
    deep = "[" * 5000 + "]" * 5000
    body = f'{{"messages": [{{"role": "user", "content": "x"}}], "prompt": "x", "{key}": {deep}}}'
    with pytest.raises(HTTPError) as refused:
        recover(endpoint, body.encode())
    assert (refused.value.status, refused.value.code) == (400, "invalid_json")
