"""Tests of the simulated Instance (cacheroute_sim/instance/): the timing model, request parsing and
knobs in-process; the data plane's wire behaviour (SSE framing, live timing, concurrency),
and its faults (truncated bodies, held and hung connections, disconnect detection) against a
real ``python -m cacheroute_sim.instance`` process (tests/sim_harness.py). Registration and the KV path
are in test_sim_instance_control_plane.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import pytest

from cacheroute_sim.common.knobs import KnobStore
from cacheroute_sim.instance import timing
from cacheroute_sim.instance.config import ConfigError, Knobs
from cacheroute_sim.instance.engine import Engine
from cacheroute_sim.instance.generation import GenerationResponse
from cacheroute_sim.instance.request_model import (
    GenerationRequest,
    InvalidJSON,
    InvalidRequest,
    parse_generation_request,
    parse_lenient_bool,
)
from cacheroute_sim.instance.resources import (
    CPU_BUSY_PCT,
    CPU_IDLE_PCT,
    GPU_WEIGHTS_MB,
    HOST_MEMORY_PER_REQUEST_MB,
    KV_MB_PER_TOKEN,
    SimulatedResources,
    gpu_utilization_pct,
)
from tests.sim_harness import (
    MAX_CONCURRENCY,
    TIME_SCALE,
    SimProcess,
    apost,
    astats,
    chat_body,
    content_of,
    http,
    next_event,
    read_events,
    run,
    sse_payloads,
    wait_stats,
)
from tests.sim_harness import shared_sim, sim  # noqa: F401 - pytest fixtures

# One parallel test worker runs them all: they share the module's simulated instance.
pytestmark = pytest.mark.xdist_group(__name__)


# ------------------------------------------------------------------------ timing (pure)

@pytest.mark.parametrize("tokens,ms", [(1, 60.0), (10, 60.0), (35, 47.0), (40, 50.13),
                                       (89, 88.38), (115, 95.67), (209, 245.835),
                                       (303, 396.0), (345, 472.0)])
def test_prefill_follows_the_anchors(tokens: int, ms: float) -> None:
    assert timing.prefill_ms(tokens) == pytest.approx(ms, abs=1e-6)


def test_prefill_long_prompt_uses_the_fitted_slope() -> None:
    assert timing.prefill_ms(346) == pytest.approx(1.48604 * 346 - 64.205)
    assert timing.prefill_ms(1000) == pytest.approx(1421.835)
    # Slope between two long prompts is exactly the fitted ms/token.
    assert timing.prefill_ms(3000) - timing.prefill_ms(2000) == pytest.approx(1486.04)


def test_itl_grows_with_the_decode_batch() -> None:
    assert timing.itl_ms(1) == 24.0
    assert timing.itl_ms(8) == 28.0
    assert timing.itl_ms(4) == pytest.approx(24 + 12 / 7)
    assert timing.itl_ms(0) == 24.0 and timing.itl_ms(50) == 28.0  # clamped to 1..8


def test_prompt_tokens_is_chars_over_four_rounded_up() -> None:
    assert [timing.prompt_tokens(c) for c in (0, 1, 4, 5, 400)] == [1, 1, 1, 2, 100]


# --------------------------------------------------------------- parsing and knobs (pure)

def _parse(body: Any, kind: str = "chat") -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_generation_request(raw, kind, default_max_tokens=16,  # type: ignore[arg-type]
                                    default_model="sim-model")


def test_parse_counts_all_message_contents_and_clamps_max_tokens() -> None:
    req = _parse({"messages": [{"role": "system", "content": "a" * 10},
                               {"role": "user", "content": [{"type": "text", "text": "b" * 7}]}],
                  "max_tokens": 100000})
    assert (req.prompt_tokens, req.completion_tokens, req.finish_reason) == (5, 8192, "length")
    assert _parse({"prompt": ["ab", "cde"], "max_tokens": -3}, "text").completion_tokens == 1
    default = _parse({"prompt": "x"}, "text")
    assert (default.completion_tokens, default.finish_reason, default.model) == (16, "stop",
                                                                                  "sim-model")


@pytest.mark.parametrize("value,expected", [(True, True), ("true", True), ("TRUE", True),
                                            (1, True), ("1", True), (False, False),
                                            ("false", False), (0, False), (None, False)])
def test_stream_flag_is_lenient(value: Any, expected: bool) -> None:
    assert parse_lenient_bool(value, "stream") is expected


@pytest.mark.parametrize("body,error", [
    (b"{nope", InvalidJSON), ([1, 2], InvalidRequest), ({"model": "m"}, InvalidRequest),
    ({"messages": []}, InvalidRequest), ({"messages": ["hi"]}, InvalidRequest),
    ({"messages": [{"content": "x"}], "stream": "maybe"}, InvalidRequest),
    ({"messages": [{"content": "x"}], "max_tokens": "10"}, InvalidRequest)])
def test_parse_rejects_bad_bodies(body: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        _parse(body)


def test_knob_updates_are_validated() -> None:
    knobs = Knobs().updated({"fail_status": 503, "slow_factor": 3})
    assert (knobs.fail_status, knobs.fail_rate, knobs.slow_factor) == (503, 1.0, 3.0)
    for bad in ({"slow_factor": -1}, {"fail_rate": 1.5}, {"fail_status": 200},
                {"hang": "yes"}, {"no_such_knob": 1}, {"drop_after_chunks": -1}):
        with pytest.raises(ConfigError):
            Knobs().updated(bad)


# ---------------------------------------------------------- the simulated machine (pure)
def test_the_simulated_machine_reads_its_engine_s_load() -> None:
    """GPU and CPU busy as the slots are, over the window since the last snapshot; memory
    with the requests in flight; the GPU's memory with the KV held."""
    engine = Engine(time_scale=0.0, max_concurrency=4, knobs=KnobStore(Knobs()), kv_mem_gb=1.0)
    machine = SimulatedResources(engine, max_concurrency=4)
    idle = machine.snapshot("i").devices
    assert (idle.gpu[0].utilization_pct_avg, idle.cpu.utilization_pct) == (0.0, CPU_IDLE_PCT)
    engine.stats.active, engine.stats.inflight = 4, 6
    machine.sample()
    engine.stats.active = 2
    machine.sample()
    engine.residency.admit("k1", 10_000, engine.knobs.current)
    busy = machine.snapshot("i")
    gpu = busy.devices.gpu[0]
    assert (gpu.utilization_pct_max, gpu.utilization_pct_current, gpu.utilization_sample_count) == \
        (100.0, gpu_utilization_pct(0.5), 2)
    assert gpu.utilization_pct_avg == round((100.0 + gpu_utilization_pct(0.5)) / 2, 1)
    assert busy.devices.cpu.utilization_pct == round(CPU_IDLE_PCT + CPU_BUSY_PCT * 0.75, 1)
    assert busy.devices.memory.used_mb == idle.memory.used_mb + 6 * HOST_MEMORY_PER_REQUEST_MB
    assert gpu.memory_used_mb == round(idle.gpu[0].memory_used_mb + 10_000 * KV_MB_PER_TOKEN, 1)
    assert gpu.memory_total_mb == idle.gpu[0].memory_total_mb == round(GPU_WEIGHTS_MB + 1024.0, 1)
    assert busy.capacity_hint is not None and busy.capacity_hint.admission_state == "accepting"


# --------------------------------------------------------------------- data plane (wire)

def test_chat_stream_format(sim: SimProcess) -> None:
    status, headers, raw = http("POST", sim.url + "/v1/chat/completions",
                                chat_body(stream=True, max_tokens=5))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-sim-instance"] == "sim-a"
    events = sse_payloads(raw)
    assert events[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-sim-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"},
                                     "finish_reason": None}]
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert contents == ["tok "] * 5
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]


def test_chat_stream_without_max_tokens_uses_default_and_stops(sim: SimProcess) -> None:
    _, _, raw = http("POST", sim.url + "/v1/chat/completions",
                     chat_body(stream="true", stream_options={"include_usage": True}))
    chunks = [json.loads(e) for e in sse_payloads(raw)[:-1]]
    assert sum(1 for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]) == 16
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}


def test_chat_non_stream_usage(sim: SimProcess) -> None:
    body = {"messages": [{"role": "system", "content": "s" * 20},
                         {"role": "user", "content": "u" * 21}], "max_tokens": 5, "stream": False}
    status, headers, reply = http("POST", sim.url + "/v1/chat/completions", body)
    assert status == 200 and headers["x-sim-instance"] == "sim-a"
    assert reply["object"] == "chat.completion" and reply["model"] == "sim-model"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "tok " * 5}
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


def test_completions_unary_and_stream(sim: SimProcess) -> None:
    status, _, reply = http("POST", sim.url + "/v1/completions", {"prompt": "p" * 8,
                                                                  "max_tokens": 3})
    assert status == 200 and reply["object"] == "text_completion"
    assert reply["id"].startswith("cmpl-sim-") and reply["choices"][0]["text"] == "tok " * 3
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    _, headers, raw = http("POST", sim.url + "/v1/completions",
                           {"prompt": "p", "max_tokens": 3, "stream": 1})
    events = sse_payloads(raw)
    assert headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["tok ", "tok ", "tok ", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_invalid_requests_get_400(sim: SimProcess) -> None:
    chat, text = sim.url + "/v1/chat/completions", sim.url + "/v1/completions"
    assert http("POST", chat, raw=b"{not json")[::2] == (400, {"error": "invalid_json"})
    for url, body in ((chat, [1]), (chat, {"model": "m"}), (text, {"messages": []}),
                      (chat, chat_body(stream="perhaps"))):
        status, _, reply = http("POST", url, body)
        assert status == 400 and reply["error"] == "invalid_request" and reply["detail"]
    _, _, stats = http("GET", sim.url + "/sim/stats")
    assert (stats["invalid"], stats["total"]) == (5, 0)


def test_sim_config_api(sim: SimProcess) -> None:
    status, _, knobs = http("POST", sim.url + "/sim/config", {"slow_factor": 2, "hang": False})
    assert status == 200 and knobs["slow_factor"] == 2.0
    assert http("GET", sim.url + "/sim/config")[2] == knobs
    for bad in ({"slow_factor": -1}, {"bogus": True}, [1]):
        assert http("POST", sim.url + "/sim/config", bad)[0] == 400
    assert http("POST", sim.url + "/sim/config", raw=b"{")[0] == 400
    assert http("GET", sim.url + "/sim/config")[2]["slow_factor"] == 2.0  # unchanged by errors
    assert http("POST", sim.url + "/sim/config/reset")[2]["slow_factor"] == 1.0
    assert http("GET", sim.url + "/healthz")[2] == {"ok": True}


def _post_with_headers(url: str, body: Any, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    """(status, the answer's headers as an email.Message, body) of a POST with these headers."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_header_knobs_and_the_recorded_request_headers(sim: SimProcess) -> None:
    url = sim.url + "/v1/chat/completions"
    assert http("POST", sim.url + "/sim/config", {"response_headers": {"X-Extra": "1"},
                                                  "request_id_headers": True})[0] == 200
    sent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "X-Request-Id": "req-17"}
    for body in (chat_body(stream=True, max_tokens=2), chat_body(max_tokens=2)):
        status, headers, _ = _post_with_headers(url, body, sent)
        assert status == 200 and headers["x-extra"] == "1" and headers["x-request-id"] == "req-17"
    recorded = http("GET", sim.url + "/sim/stats")[2]["last_request_headers"]
    assert ["traceparent", sent["traceparent"]] in recorded and ["x-request-id", "req-17"] in recorded

    http("POST", sim.url + "/sim/config", {"fail_status": 503})
    status, headers, _ = _post_with_headers(url, chat_body(max_tokens=2), {})
    assert status == 503 and headers["x-extra"] == "1"
    assert len(headers["x-request-id"]) == 32  # none was sent: a new one, as vLLM makes
    assert headers.get_all("x-request-id") == [headers["x-request-id"]]
    # Not on the other routes, and not recorded from them.
    status, headers, _ = _post_with_headers(sim.url + "/sim/stats/reset", {}, sent)
    assert "x-extra" not in headers and http("GET", sim.url + "/sim/stats")[2]["last_request_headers"] == []


@pytest.mark.parametrize("bad", [{"response_headers": {"bad name": "x"}},
                                 {"response_headers": {"x-a": "one\r\nx-b: two"}},
                                 {"response_headers": ["x-a"]}, {"request_id_headers": "yes"}])
def test_header_knobs_are_validated(sim: SimProcess, bad: dict[str, Any]) -> None:
    assert http("POST", sim.url + "/sim/config", bad)[0] == 400
    assert http("GET", sim.url + "/sim/config")[2]["response_headers"] == {}


def test_header_knob_flags() -> None:
    from cacheroute_sim.instance.__main__ import config_from_args

    knobs = config_from_args(["--response-header", "X-A: 1", "--response-header", "x-b:two:2",
                              "--request-id-headers"]).knobs
    assert knobs.response_headers == {"X-A": "1", "x-b": "two:2"} and knobs.request_id_headers
    assert config_from_args([]).knobs.response_headers == {}
    with pytest.raises(SystemExit):
        config_from_args(["--response-header", "novalue"])


# --------------------------------------------------------------------------- timing (live)

def test_stream_timing_matches_the_model(sim: SimProcess) -> None:
    # slow_factor 1/TIME_SCALE turns the sim back into real-GPU time for this request.
    http("POST", sim.url + "/sim/config", {"slow_factor": 1 / TIME_SCALE})
    prompt, n = "x" * 400, 6  # 100 tokens -> 92.34 ms prefill; 5 gaps of 24 ms

    async def go() -> tuple[float, float]:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(sim.url + "/v1/chat/completions",
                              json=chat_body(prompt, stream=True, max_tokens=n)) as r:
                await read_events(r, 2)  # role + first token arrive together after prefill
                ttft = time.monotonic() - t0
                await read_events(r, n - 1)
                decode = time.monotonic() - t0 - ttft
                assert await read_events(r, 2) and await next_event(r) is None
        return ttft, decode

    ttft, decode = run(go())
    assert 0.092 * 0.95 <= ttft < 0.092 + 0.25
    assert 5 * 0.024 * 0.95 <= decode < 5 * 0.024 + 0.25


def test_slow_factor_slows_every_step(sim: SimProcess) -> None:
    def elapsed() -> float:
        t0 = time.monotonic()
        assert http("POST", sim.url + "/v1/chat/completions", chat_body(max_tokens=8))[0] == 200
        return time.monotonic() - t0

    fast = elapsed()  # (60 + 7*24) ms * 0.05 = 11 ms
    http("POST", sim.url + "/sim/config", {"slow_factor": 20})
    slow = elapsed()  # 228 ms
    assert slow >= 0.228 * 0.95 and fast < 0.15 and slow > fast + 0.1


def test_prefill_is_serialized(sim: SimProcess) -> None:
    # 4 prompts of 1000 tokens: 1421.8 ms * 0.05 = 71 ms each, one after another.
    body = chat_body("y" * 4000, max_tokens=1)

    async def go() -> float:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            await asyncio.gather(*(apost(s, sim.url + "/v1/chat/completions", body)
                                   for _ in range(4)))
            return time.monotonic() - t0

    assert run(go()) >= 4 * 0.0711 * 0.95


def test_concurrency_limit_queues_fifo(sim: SimProcess) -> None:
    # Held streams keep their slot, so the queue is observable without racing the clock.
    http("POST", sim.url + "/sim/config", {"hold_streams": True})
    n = MAX_CONCURRENCY + 2

    async def one(s: aiohttp.ClientSession) -> int:
        async with s.post(sim.url + "/v1/chat/completions",
                          json=chat_body(stream=True, max_tokens=3)) as r:
            events = []
            while (e := await next_event(r)) is not None:
                events.append(e)
            assert events[-1] == "[DONE]"
            return sum(1 for e in events[:-1] if content_of(e))

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(one(s)) for _ in range(n)]
            st = await wait_stats(s, sim.url, lambda st: st["held"] == MAX_CONCURRENCY
                                  and st["queued"] == 2)
            assert st["active"] == MAX_CONCURRENCY
            await apost(s, sim.url + "/sim/release", {})
            # The two queued requests now get slots (and, admitted under hold_streams, hold).
            st = await wait_stats(s, sim.url, lambda st: st["held"] == 2 and st["queued"] == 0)
            await apost(s, sim.url + "/sim/release", {})
            assert await asyncio.gather(*tasks) == [3] * n
            st = await astats(s, sim.url)
            assert st["max_active"] == MAX_CONCURRENCY
            assert (st["total"], st["completed"], st["active"]) == (n, n, 0)

    run(go())


def test_concurrency_limit_without_holds(sim: SimProcess) -> None:
    body = chat_body(max_tokens=40)  # ~50 ms each at this time scale: they overlap

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(apost(s, sim.url + "/v1/chat/completions", body)
                                   for _ in range(MAX_CONCURRENCY + 2)))
            return await astats(s, sim.url)

    stats = run(go())
    assert stats["max_active"] == MAX_CONCURRENCY
    assert stats["completed"] == MAX_CONCURRENCY + 2


# ------------------------------------------------------------------------------ faults

def test_fail_status(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"fail_status": 503})
    status, headers, reply = http("POST", sim.url + "/v1/chat/completions", chat_body())
    assert status == 503 and headers["x-sim-instance"] == "sim-a"
    assert reply == {"error": {"message": "simulated failure", "type": "sim_error", "code": 503}}
    assert http("POST", sim.url + "/v1/completions", {"prompt": "x", "stream": True})[0] == 503
    http("POST", sim.url + "/sim/config", {"fail_rate": 0.0})
    assert http("POST", sim.url + "/v1/chat/completions", chat_body())[0] == 200
    _, _, stats = http("GET", sim.url + "/sim/stats")
    assert (stats["failed"], stats["completed"]) == (2, 1)


def test_hang_sends_nothing_until_release(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"hang": True})

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            unary = asyncio.create_task(apost(s, sim.url + "/v1/chat/completions",
                                              chat_body(max_tokens=2)))

            async def stream_status() -> int:
                async with s.post(sim.url + "/v1/completions",
                                  json={"prompt": "x", "stream": True}) as r:
                    await r.read()
                    return r.status

            stream = asyncio.create_task(stream_status())
            st = await wait_stats(s, sim.url, lambda st: st["held"] == 2)
            assert st["active"] == 0  # hung before admission: no slot taken
            await asyncio.sleep(0.2)
            assert not unary.done() and not stream.done()  # not even headers
            async with s.post(sim.url + "/sim/release") as r:
                assert (await r.json()) == {"released": 2}
            reply = await unary
            assert reply["choices"][0]["message"]["content"] == "tok tok "
            assert await stream == 200

    run(go())


def test_client_disconnect_while_hung_is_counted(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"hang": True})

    async def go() -> float:
        async with aiohttp.ClientSession() as s:
            async with aiohttp.ClientSession() as client:  # its own pool, closed below
                req = asyncio.create_task(apost(client, sim.url + "/v1/chat/completions",
                                                chat_body()))
                await wait_stats(s, sim.url, lambda st: st["held"] == 1)
                req.cancel()
            t0 = time.monotonic()
            st = await wait_stats(s, sim.url, lambda st: st["held"] == 0
                                  and st["disconnected"] == 1)
            assert st["completed"] == 0
            return time.monotonic() - t0

    assert run(go()) < 0.5


def test_drop_after_chunks_breaks_the_stream(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"drop_after_chunks": 3})

    async def go() -> list[str]:
        got: list[str] = []
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.url + "/v1/chat/completions",
                              json=chat_body(stream=True, max_tokens=10)) as r:
                with pytest.raises(aiohttp.ClientPayloadError):
                    while (e := await next_event(r)) is not None:
                        got.append(e)
        return got

    events = run(go())
    assert [content_of(e) for e in events] == [None, "tok ", "tok ", "tok "]  # role + 3
    _, _, stats = http("GET", sim.url + "/sim/stats")
    assert (stats["dropped"], stats["completed"], stats["active"]) == (1, 0, 0)
    assert "Traceback" not in sim.log()  # an intended drop is not logged as a crash


def test_drop_after_chunks_truncates_a_unary_body(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"drop_after_chunks": 0})

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()

    run(go())
    assert http("GET", sim.url + "/sim/stats")[2]["dropped"] == 1


def test_stall_after_chunks_keeps_the_connection_open(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"stall_after_chunks": 2})

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.url + "/v1/chat/completions",
                              json=chat_body(stream=True, max_tokens=5)) as r:
                first = await read_events(r, 3)  # role + 2 tokens
                assert [content_of(e) for e in first] == [None, "tok ", "tok "]
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(next_event(r), 0.3)
                st = await astats(s, sim.url)
                assert (st["held"], st["active"]) == (1, 1)
                await apost(s, sim.url + "/sim/release", {})
                rest = []
                while (e := await next_event(r)) is not None:
                    rest.append(e)
        assert [content_of(e) for e in rest[:-2]] == ["tok "] * 3 and rest[-1] == "[DONE]"

    run(go())


def test_hold_streams_until_release(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"hold_streams": True})

    async def one(s: aiohttp.ClientSession, held: asyncio.Event) -> list[str]:
        async with s.post(sim.url + "/v1/chat/completions",
                          json=chat_body(stream=True, max_tokens=4)) as r:
            events = await read_events(r, 2)  # role + first token, then the hold
            held.set()
            while (e := await next_event(r)) is not None:
                events.append(e)
            return events

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            flags = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(one(s, f)) for f in flags]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 3)
            await wait_stats(s, sim.url, lambda st: st["held"] == 2)
            await asyncio.sleep(0.15)
            assert not any(t.done() for t in tasks)
            async with s.post(sim.url + "/sim/release") as r:
                assert (await r.json())["released"] == 2
            for events in await asyncio.gather(*tasks):
                assert [content_of(e) for e in events[1:5]] == ["tok "] * 4
                assert events[-1] == "[DONE]"

    run(go())


def test_disconnect_while_held_frees_the_slot(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config", {"hold_streams": True})

    async def go() -> float:
        async with aiohttp.ClientSession() as s:
            clients = [aiohttp.ClientSession() for _ in range(MAX_CONCURRENCY)]
            try:
                responses = [await c.post(sim.url + "/v1/chat/completions",
                                          json=chat_body(stream=True)) for c in clients]
                for r in responses:
                    await read_events(r, 2)
                st = await wait_stats(s, sim.url, lambda st: st["held"] == MAX_CONCURRENCY)
                assert st["active"] == MAX_CONCURRENCY  # every slot is taken
            finally:
                for c in clients:
                    await c.close()  # closes the held connections
            t0 = time.monotonic()
            st = await wait_stats(s, sim.url, lambda st: st["active"] == 0 and st["held"] == 0)
            latency = time.monotonic() - t0
            assert st["disconnected"] == MAX_CONCURRENCY and st["decoding"] == 0
            # All slots are really free: a normal request is admitted at once.
            async with s.post(sim.url + "/sim/config", json={"hold_streams": False}):
                pass
            reply = await asyncio.wait_for(
                apost(s, sim.url + "/v1/chat/completions", chat_body(max_tokens=2)), 2)
            assert reply["usage"]["completion_tokens"] == 2
            return latency

    assert run(go()) < 0.5


def test_a_freed_slot_is_never_seen_before_its_disconnect_is_counted() -> None:
    """In process, one loop step at a time: whoever polls /sim/stats and sees the slot free
    must also see the disconnect that freed it (the test above polls exactly that)."""
    engine = Engine(time_scale=0.01, max_concurrency=1,
                    knobs=KnobStore(Knobs(hold_streams=True)))
    request = GenerationRequest(kind="chat", stream=True, include_usage=False, model="m",
                                prompt_tokens=10, completion_tokens=4, finish_reason="length")
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    async def go() -> list[tuple[int, int]]:
        response = GenerationResponse(request, engine, random.Random(0))
        task = asyncio.create_task(response({"type": "http"}, receive, send))
        while engine.stats.held == 0:
            await asyncio.sleep(0.001)
        gone.set()
        seen = []
        while not task.done():
            seen.append((engine.stats.active, engine.stats.disconnected))
            await asyncio.sleep(0)
        await task
        return seen

    seen = asyncio.run(go())
    assert (0, 0) not in seen and seen[-1] == (0, 1)


