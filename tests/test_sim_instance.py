"""Tests of the simulated Instance (sim_instance/).

The pure parts (timing model, request parsing, knobs) are tested in-process. Everything
else runs against a real ``python -m sim_instance`` subprocess on a free port, because what
matters is the wire behaviour a Proxy sees: SSE framing, truncated bodies, held connections,
disconnect detection, registration traffic and the exit status on SIGTERM.
Every process started here is stopped by pid in a ``finally``/fixture teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from bench.common import free_port, free_port_range
from sim_instance import timing
from sim_instance.config import ConfigError, Knobs, SimConfig
from sim_instance.registration import register_body
from sim_instance.request_model import (
    InvalidJSON,
    InvalidRequest,
    parse_generation_request,
    parse_kv_prefix_header,
    parse_lenient_bool,
)

ROOT = Path(__file__).resolve().parents[1]
TIME_SCALE = 0.05
MAX_CONCURRENCY = 4
# The shared sim's (fake) Redis target, handed to the KDN on every KV inject.
REDIS_ARGS = ("--redis-host", "10.9.8.7", "--redis-port", "6390", "--redis-db", "3",
              "--redis-password", "pw")
KDN_TIMEOUT_S = 0.5
T = TypeVar("T")


# --------------------------------------------------------------------------- process helpers

def free_port_pair() -> int:
    """A port P such that P and P + 1 are both free right now (data + default CP port)."""
    return free_port_range(2)


class SimProcess:
    """One ``python -m sim_instance`` (or ``module``) subprocess, output captured to a file."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None, module: str = "sim_instance") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The Instance control plane, when a test gave it an explicit --cp-port.
        self.cp_url: str | None = None
        if "--cp-port" in args:
            self.cp_url = f"http://127.0.0.1:{args[args.index('--cp-port') + 1]}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env if env is not None else _clean_env())

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sim exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=0.5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"sim not ready after {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 5.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _clean_env() -> dict[str, str]:
    # The developer's shell must not leak a token or CP URL into tests that check headers.
    env = {k: v for k, v in os.environ.items() if k not in ("PROXY_CP_TOKEN", "PROXY_CP_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def running_sim(log_path: Path, *args: str, port: int | None = None, ready: bool = True,
                module: str = "sim_instance") -> Iterator[SimProcess]:
    sim = SimProcess(list(args), log_path, port=port, module=module)
    try:
        if ready:
            sim.wait_ready()
        yield sim
    finally:
        sim.terminate()


def _wait_until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def run(coro: Awaitable[T], timeout: float = 15.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


# ------------------------------------------------------------------------------ HTTP helpers

def http(method: str, url: str, body: Any = None, raw: bytes | None = None
         ) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, headers, payload = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, payload = e.code, dict(e.headers), e.read()
    ctype = headers.get("content-type", "")
    return status, headers, json.loads(payload) if "json" in ctype else payload


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def sse_payloads(raw: bytes) -> list[str]:
    return [line[len(b"data: "):].decode() for line in raw.split(b"\n")
            if line.startswith(b"data: ")]


async def next_event(resp: aiohttp.ClientResponse) -> str | None:
    """The next SSE data payload, or None at a clean end of the body."""
    while True:
        line = await resp.content.readline()
        if not line:
            return None
        if line.startswith(b"data: "):
            return line[len(b"data: "):].strip().decode()


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[str]:
    out: list[str] = []
    for _ in range(n):
        event = await next_event(resp)
        assert event is not None, f"stream ended after {out}"
        out.append(event)
    return out


def content_of(event: str) -> str | None:
    choice = json.loads(event)["choices"][0]
    content = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return content if isinstance(content, str) else None


async def astats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(base + "/sim/stats") as r:
        stats: dict[str, Any] = await r.json()
        return stats


async def wait_stats(session: aiohttp.ClientSession, base: str,
                     pred: Callable[[dict[str, Any]], bool], timeout: float = 3.0
                     ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = await astats(session, base)
        if pred(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"stats never matched: {stats}")
        await asyncio.sleep(0.01)


async def apost(session: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


# ---------------------------------------------------------------------------- shared sim

@pytest.fixture(scope="module")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    log = tmp_path_factory.mktemp("sim") / "shared.log"
    with running_sim(log, "--no-register", "--time-scale", str(TIME_SCALE),
                     "--max-concurrency", str(MAX_CONCURRENCY), "--instance-id", "sim-a",
                     "--cp-port", str(free_port()), *REDIS_ARGS,
                     "--kdn-timeout", str(KDN_TIMEOUT_S)) as s:
        yield s


@pytest.fixture
def sim(shared_sim: SimProcess) -> Iterator[SimProcess]:
    """The shared sim with default knobs, nothing in flight and zeroed counters."""
    _quiesce(shared_sim)
    try:
        yield shared_sim
    finally:
        _quiesce(shared_sim)  # a failed test must not leave held requests for the next one


def _quiesce(sim: SimProcess) -> None:
    http("POST", sim.url + "/sim/config/reset")
    deadline = time.monotonic() + 3
    while True:
        http("POST", sim.url + "/sim/release")
        _, _, stats = http("GET", sim.url + "/sim/stats")
        if stats["active"] == stats["queued"] == stats["held"] == 0:
            break
        assert time.monotonic() < deadline, f"sim did not quiesce: {stats}"
        time.sleep(0.02)
    http("POST", sim.url + "/sim/stats/reset")


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


# ------------------------------------------------------------------------- registration

class FakeControlPlane:
    """A tiny stand-in for the Proxy control plane; records calls, scripts heartbeat replies."""

    def __init__(self, port: int, heartbeat_replies: list[dict[str, Any]] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.calls: list[dict[str, Any]] = []
        self.heartbeat_replies = deque(heartbeat_replies or [])
        self.cond = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeControlPlane:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def wait_for_calls(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.calls) >= count, timeout):
                raise AssertionError(f"only {len(self.calls)} calls: {self.calls}")
            return list(self.calls)

    def _reply(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/instance/register":
            return {"instance_id": body["instance_id"], "heartbeat_interval_s": 10, "ttl_s": 30,
                    "capability_fingerprint": "sha256:fake"}
        if path == "/v1/instance/heartbeat" and self.heartbeat_replies:
            return self.heartbeat_replies.popleft()
        return {"ok": True}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with fake.cond:
                    reply = fake._reply(self.path, body)
                    fake.calls.append({"path": self.path, "body": body, "t": time.monotonic(),
                                       "auth": self.headers.get("authorization")})
                    fake.cond.notify_all()
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


REQUIRES_CAPS = {"ok": False, "error": "capability_fingerprint_mismatch",
                 "requires_capabilities": True, "expected_fingerprint": "sha256:other",
                 "reported_fingerprint": "sha256:fake"}


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_registration_lifecycle(tmp_path: Path) -> None:
    cp_port, interval = free_port(), 0.3
    script: list[dict[str, Any]] = [{"ok": True}, REQUIRES_CAPS, {"ok": True}, {"ok": False}]
    with FakeControlPlane(cp_port, script) as cp:
        # No --cp-port: the Instance control plane listens on data port + 1, like 9001/9002.
        sim = SimProcess(["--proxy-cp-url", cp.url, "--instance-id", "sim-reg",
                          "--register-token", "s3cret", "--heartbeat-interval", str(interval),
                          "--time-scale", str(TIME_SCALE), "--shutdown-grace", "1"],
                         tmp_path / "reg.log", port=free_port_pair())
        try:
            cp.wait_for_calls(7)
            # Registered only once both listeners are up.
            assert http("GET", f"http://127.0.0.1:{sim.port + 1}/healthz")[::2] == (
                200, {"ok": True})
            # A hung request keeps uvicorn draining for the full 1 s grace at shutdown; the
            # unregister must not wait for that (the Proxy should stop routing here first).
            http("POST", sim.url + "/sim/config", {"hang": True})
            hung = threading.Thread(target=http, args=("POST", sim.url + "/v1/completions",
                                                       {"prompt": "x"}), daemon=True)
            hung.start()
            _wait_until(lambda: http("GET", sim.url + "/sim/stats")[2]["held"] == 1)
            t_signal = time.monotonic()
            exit_status = sim.terminate()
            exit_after = time.monotonic() - t_signal
            hung.join(5)
            calls = list(cp.calls)
        finally:
            sim.terminate()
    paths = [c["path"].rsplit("/", 1)[1] for c in calls]
    assert paths[:7] == ["register", "heartbeat", "heartbeat", "heartbeat", "heartbeat",
                         "register", "heartbeat"], paths
    assert paths[-1] == "unregister" and calls[-1]["body"] == {"instance_id": "sim-reg"}
    assert exit_status == 0, sim.log()
    assert calls[-1]["t"] - t_signal < 0.5 < 0.9 < exit_after, (calls[-1]["t"] - t_signal,
                                                                 exit_after)
    assert all(c["auth"] == "Bearer s3cret" for c in calls)
    assert calls[0]["body"] == {
        "instance_id": "sim-reg", "host": "127.0.0.1", "port": sim.port,
        "endpoints": ["chat/completions", "completions"], "tags": [], "weight": 1.0,
        "meta": {"version": "instance_v1", "simulated": True, "max_num_seqs": 8,
                 "cp_port": sim.port + 1},
        "capabilities": {"schema_version": "1",
                         "model": {"identifier": "sim-model", "revision": None}}}
    plain = {"instance_id": "sim-reg", "capability_fingerprint": "sha256:fake"}
    assert calls[1]["body"] == calls[2]["body"] == calls[4]["body"] == plain
    assert calls[3]["body"] == {**plain, "capabilities": calls[0]["body"]["capabilities"]}
    # The interval override wins over the reply's 10 s; the caps resend is immediate.
    assert interval * 0.8 < calls[2]["t"] - calls[1]["t"] < interval + 0.5
    assert calls[3]["t"] - calls[2]["t"] < 0.2
    # {"ok": false} without requires_capabilities: re-register at once, not one interval later.
    assert calls[5]["t"] - calls[4]["t"] < 0.2 and calls[5]["body"] == calls[0]["body"]


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_registration_waits_for_a_late_control_plane(tmp_path: Path) -> None:
    cp_port = free_port()
    with running_sim(tmp_path / "late.log", "--proxy-cp-url", f"http://127.0.0.1:{cp_port}",
                     "--heartbeat-interval", "0.2") as sim:
        # The data plane serves while the control plane is down.
        assert http("POST", sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] \
            == 200
        time.sleep(1.2)  # several failed attempts (backoff 0.2, 0.4, 0.8 s)
        with FakeControlPlane(cp_port) as cp:
            calls = cp.wait_for_calls(2, timeout=5)  # register + a heartbeat
            assert [c["path"] for c in calls[:2]] == ["/v1/instance/register",
                                                      "/v1/instance/heartbeat"]
            assert all(c["auth"] is None for c in calls)  # no token: no header at all
            assert calls[0]["body"]["instance_id"] == f"hp_127.0.0.1:{sim.port}"
            exit_status = sim.terminate()
            assert cp.calls[-1]["path"] == "/v1/instance/unregister"
    assert exit_status == 0
    log = sim.log()
    assert log.count("control plane unreachable") == 1, log  # once per state change
    assert "registered as" in log


@pytest.mark.timeout(20)
def test_sigterm_with_a_hung_request_exits_zero(tmp_path: Path) -> None:
    with running_sim(tmp_path / "term.log", "--no-register", "--hang",
                     "--shutdown-grace", "0.3") as sim:
        async def go() -> int:
            async with aiohttp.ClientSession() as s:
                async def hung_call() -> int:
                    async with s.post(sim.url + "/v1/chat/completions", json=chat_body()) as r:
                        await r.read()
                        return r.status

                req = asyncio.create_task(hung_call())
                await wait_stats(s, sim.url, lambda st: st["held"] == 1)
                t0 = time.monotonic()
                status = await asyncio.to_thread(sim.terminate)
                assert time.monotonic() - t0 < 3
                # Cut off by the shutdown grace with an explicit 503, not left hanging.
                assert await asyncio.wait_for(req, 2) == 503
                return status

        assert run(go()) == 0, sim.log()


# ------------------------------------------------------------------ KV path: pure parts

def test_redis_pull_and_kv_hit_prefill_follow_the_reference() -> None:
    # §5.3: 2764.34 ms/GB x tokens x 0.0000381 GB + 12.46 ms.
    assert timing.redis_pull_ms(0) == pytest.approx(12.4608, abs=1e-3)
    assert timing.redis_pull_ms(2560) == pytest.approx(2764.3408 * 2560 * 0.0000381 + 12.4608)
    # The hit skips N tokens of prefill and costs their pull instead.
    assert timing.kv_hit_prefill_ms(3000, 2560) == pytest.approx(
        timing.redis_pull_ms(2560) + timing.prefill_ms(440))
    # Never more than the prompt, never less than one computed token.
    assert timing.kv_hit_prefill_ms(3000, 9999) == pytest.approx(
        timing.redis_pull_ms(3000) + timing.prefill_ms(1))
    assert timing.kv_hit_prefill_ms(100, 0) == pytest.approx(
        timing.redis_pull_ms(0) + timing.prefill_ms(100))


@pytest.mark.parametrize("value,expected", [(None, None), ("0", 0), ("2560", 2560),
                                            (" 17 ", 17)])
def test_kv_prefix_header_parses(value: str | None, expected: int | None) -> None:
    assert parse_kv_prefix_header(value) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "", "abc", "１２"])
def test_kv_prefix_header_rejects_garbage(value: str) -> None:
    with pytest.raises(InvalidRequest, match="x-cacheroute-kv-prefix-tokens"):
        parse_kv_prefix_header(value)


def test_control_plane_port_and_register_meta() -> None:
    assert SimConfig(port=9001).resolved_cp_port == 9002
    assert SimConfig(port=9001, cp_port=0).resolved_cp_port == 0
    assert SimConfig(port=9001, cp_port=9500).resolved_cp_port == 9500
    assert SimConfig(port=65535).resolved_cp_port == 0
    with pytest.raises(ValueError, match="cp_port must differ"):
        SimConfig(port=9001, cp_port=9001)
    config = SimConfig(port=9001, max_concurrency=3)
    assert register_body(config, 9002)["meta"] == {"version": "instance_v1", "simulated": True,
                                                   "max_num_seqs": 3, "cp_port": 9002}
    assert register_body(config, None)["meta"] == {"version": "instance_v1", "simulated": True,
                                                   "max_num_seqs": 3}


# ------------------------------------------------------------ KV path: prefix-hit timing

def _prefill_time(sim: SimProcess, prompt_chars: int, prefix: str | None) -> float:
    """Wall time of a one-token completion: prefill only (no decode step)."""
    headers = {"content-type": "application/json"}
    if prefix is not None:
        headers["x-cacheroute-kv-prefix-tokens"] = prefix
    req = urllib.request.Request(
        sim.url + "/v1/completions", method="POST", headers=headers,
        data=json.dumps({"prompt": "p" * prompt_chars, "max_tokens": 1}).encode())
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        r.read()
    return time.monotonic() - t0


def test_kv_prefix_header_shortens_prefill(sim: SimProcess) -> None:
    # 3000 prompt tokens: 4.39 s of prefill; a 2560-token hit leaves 440 tokens (0.59 s)
    # plus a 0.28 s Redis pull. At TIME_SCALE 0.05: 220 ms vs 44 ms.
    # Reference numbers, not timing.py's (a wrong formula there must not move the target):
    # 1.48604*3000 - 64.205 = 4393.9 ms; 2764.34*2560*0.0000381 + 12.46 + 1.48604*440 - 64.205
    # = 871.7 ms.
    full = _prefill_time(sim, 12000, None)
    hit = _prefill_time(sim, 12000, "2560")
    expected_full = 4393.915 * TIME_SCALE / 1000
    expected_hit = 871.736 * TIME_SCALE / 1000
    assert expected_full <= full < expected_full + 0.08, (full, expected_full)
    assert expected_hit <= hit < expected_hit + 0.08, (hit, expected_hit)
    assert full - hit == pytest.approx(expected_full - expected_hit, abs=0.06)
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_prefix_hits"], st["kv_prefix_tokens_total"], st["completed"]) == (1, 2560, 2)


def test_kv_prefix_header_on_a_chat_stream_and_its_limits(sim: SimProcess) -> None:
    async def ttft(prefix: str) -> float:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(sim.url + "/v1/chat/completions",
                              json=chat_body("c" * 12000, stream=True, max_tokens=2),
                              headers={"x-cacheroute-kv-prefix-tokens": prefix}) as r:
                await read_events(r, 2)
                elapsed = time.monotonic() - t0
                await r.read()
        return elapsed

    # A claim larger than the prompt is capped at the prompt: pull 3000 tokens, compute 1.
    first = run(ttft("100000"))
    expected = 388.425 * TIME_SCALE / 1000  # 2764.34*3000*0.0000381 + 12.46 + 60 (1 token)
    # libuv (uvloop) timers have millisecond granularity and may fire up to 1 ms early.
    assert expected - 0.001 <= first < expected + 0.08, (first, expected)
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_prefix_hits"], st["kv_prefix_tokens_total"]) == (1, 3000)
    # Without the header: no hit.
    assert http("POST", sim.url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert http("GET", sim.url + "/sim/stats")[2]["kv_prefix_hits"] == 1
    req = urllib.request.Request(sim.url + "/v1/completions", method="POST",
                                 data=b'{"prompt": "x"}',
                                 headers={"x-cacheroute-kv-prefix-tokens": "-5"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    body = json.loads(err.value.read())
    assert err.value.code == 400 and body["error"] == "invalid_request"
    assert "x-cacheroute-kv-prefix-tokens" in body["detail"]


# ------------------------------------------------------- KV path: control plane -> KDN

# A small KDN store: DOC1 1000 tokens kv_ready (4 keys), doc2 text only, doc3 10 tokens.
KDN_KNOWLEDGE = [{"id": "DOC1", "content": "d" * 4000, "kv_ready": True},
                 {"id": "doc2", "content": "e" * 400, "kv_ready": False},
                 {"id": "doc3", "content": "f" * 40, "kv_ready": True}]
# 1000 bytes/token at 80 Mbps, full efficiency: DOC1's 1 MB of KV takes 100 ms.
KDN_LINK_ARGS = ("--kv-bytes-per-token", "1000", "--bandwidth-mbps", "80",
                 "--link-efficiency", "1", "--rtt-ms", "0")


@pytest.fixture(scope="module")
def shared_kdn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    tmp = tmp_path_factory.mktemp("kdn")
    (tmp / "k.json").write_text(json.dumps(KDN_KNOWLEDGE))
    with running_sim(tmp / "kdn.log", "--knowledge", str(tmp / "k.json"), *KDN_LINK_ARGS,
                     module="sim_kdn") as kdn:
        yield kdn


@pytest.fixture
def kdn(shared_kdn: SimProcess) -> Iterator[SimProcess]:
    for path in ("/sim/config/reset", "/sim/release", "/sim/stats/reset"):
        http("POST", shared_kdn.url + path)
    try:
        yield shared_kdn
    finally:
        http("POST", shared_kdn.url + "/sim/config/reset")
        http("POST", shared_kdn.url + "/sim/release")


def cp_inject(sim: SimProcess, kdn_addr: str, kids: list[str], request_id: Any = 42
              ) -> tuple[float, int, dict[str, str], Any]:
    assert sim.cp_url is not None
    body = {"request_id": request_id, "kdn_addr": kdn_addr, "model": "m-1",
            "knowledge_ids": kids}
    t0 = time.monotonic()
    status, headers, reply = http("POST", sim.cp_url + "/v1/kv/inject_ready", body)
    return time.monotonic() - t0, status, headers, reply


def test_cp_inject_goes_through_the_kdn(sim: SimProcess, kdn: SimProcess) -> None:
    assert sim.cp_url is not None
    assert http("GET", sim.cp_url + "/healthz")[::2] == (200, {"ok": True})
    elapsed, status, headers, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}",
                                              ["DOC1", "doc2", "missing", "doc3"])
    assert status == 200 and headers["x-sim-instance"] == "sim-a"
    assert ack == {"ok": True, "injected_kids": ["doc1", "doc3"], "text_only_kids": ["doc2"],
                   "miss_kids": ["missing"], "keys_injected": 5, "payload_bytes": 1_010_000,
                   "payload_files": 5, "network_sim_enabled": True, "detail": ""}
    assert 0.101 <= elapsed < 0.101 + 0.1, elapsed  # 1.01 MB at 10 000 bytes/ms
    _, _, kst = http("GET", kdn.url + "/sim/stats")
    # The KDN saw this Instance's Redis target and the Proxy's request fields.
    assert kst["last_inject"] == {"request_id": 42, "model": "m-1",
                                  "knowledge_ids": ["doc1", "doc2", "missing", "doc3"],
                                  "redis_host": "10.9.8.7", "redis_port": 6390, "redis_db": 3,
                                  "redis_password_set": True}
    assert kst["links"]["10.9.8.7:6390"]["bytes"] == 1_010_000
    # A full URL works as kdn_addr too; the answer is the KDN's, byte for byte.
    _, status, _, again = cp_inject(sim, f"http://127.0.0.1:{kdn.port}/", ["doc3"])
    assert status == 200 and again["injected_kids"] == ["doc3"]
    direct = http("POST", kdn.url + "/knowledge/inject_ready_kv",
                  {"request_id": 1, "model": "m", "knowledge_ids": ["doc3"]})[2]
    assert again == direct
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (2, 0)


def test_cp_relays_kdn_client_errors_verbatim(sim: SimProcess, kdn: SimProcess) -> None:
    _, status, _, reply = cp_inject(sim, f"127.0.0.1:{kdn.port}", [])
    assert (status, reply) == (400, {"ok": False, "detail": "knowledge_ids is empty"})
    assert http("GET", sim.url + "/sim/stats")[2]["kv_inject_failed"] == 0


def test_cp_kdn_down_is_a_502_with_the_reason(sim: SimProcess) -> None:
    dead = free_port()
    _, status, _, ack = cp_inject(sim, f"127.0.0.1:{dead}", ["doc1"])
    assert status == 502 and ack["ok"] is False and ack["injected_kids"] == []
    assert ack["keys_injected"] == 0 and "kdn unreachable" in ack["detail"]
    assert f"127.0.0.1:{dead}" in ack["detail"]
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (1, 1)


def test_cp_kdn_error_and_timeout_are_502s(sim: SimProcess, kdn: SimProcess) -> None:
    http("POST", kdn.url + "/sim/config", {"fail_status": 503, "fault_on": "inject"})
    _, status, _, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}", ["doc1"])
    assert status == 502 and ack["ok"] is False and "kdn answered HTTP 503" in ack["detail"]
    http("POST", kdn.url + "/sim/config", {"fail_status": None, "hang": True})
    elapsed, status, _, ack = cp_inject(sim, f"127.0.0.1:{kdn.port}", ["doc1"])
    assert status == 502 and f"kdn timeout after {KDN_TIMEOUT_S:g} s" in ack["detail"], ack
    assert KDN_TIMEOUT_S <= elapsed < KDN_TIMEOUT_S + 0.5
    _, _, st = http("GET", sim.url + "/sim/stats")
    assert (st["kv_injects"], st["kv_inject_failed"]) == (2, 2)


def test_cp_rejects_malformed_requests(sim: SimProcess) -> None:
    assert sim.cp_url is not None
    url = sim.cp_url + "/v1/kv/inject_ready"
    good = {"request_id": 1, "kdn_addr": "127.0.0.1:1", "model": "m", "knowledge_ids": ["a"]}
    for bad, detail in [({**good, "request_id": "1"}, "request_id"),
                        ({k: v for k, v in good.items() if k != "kdn_addr"}, "kdn_addr"),
                        ({**good, "knowledge_ids": [1]}, "knowledge_ids"),
                        ({**good, "kdn_addr": " "}, "kdn_addr is empty")]:
        status, _, reply = http("POST", url, bad)
        assert status == 400 and reply["ok"] is False and detail in reply["detail"], reply
    assert http("POST", url, raw=b"{")[::2] == (400, {"ok": False, "detail": "invalid_json"})
    assert http("GET", sim.url + "/sim/stats")[2]["kv_injects"] == 0


@pytest.mark.timeout(30)
def test_cp_port_zero_taken_default_and_taken_explicit(tmp_path: Path) -> None:
    # --cp-port 0: no control plane, no meta.cp_port.
    port = free_port_pair()
    with FakeControlPlane(free_port()) as cp, \
            running_sim(tmp_path / "zero.log", "--proxy-cp-url", cp.url, "--cp-port", "0",
                        port=port):
        meta = cp.wait_for_calls(1)[0]["body"]["meta"]
        assert meta == {"version": "instance_v1", "simulated": True, "max_num_seqs": 8}
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/healthz", timeout=1)
    # Default port (data + 1) taken: serve the data plane anyway, register without cp_port.
    port = free_port_pair()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port + 1))
        blocker.listen()
        with FakeControlPlane(free_port()) as cp, \
                running_sim(tmp_path / "taken.log", "--proxy-cp-url", cp.url,
                            port=port) as sim:
            meta = cp.wait_for_calls(1)[0]["body"]["meta"]
            assert "cp_port" not in meta
            assert "running without a control plane" in sim.log()
        # An explicit --cp-port that cannot be bound is fatal.
        sim = SimProcess(["--no-register", "--cp-port", str(port + 1)], tmp_path / "x.log")
        try:
            assert sim.proc.wait(10) == 1
            assert "cannot bind the control plane" in sim.log()
        finally:
            sim.terminate()
