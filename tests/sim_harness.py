"""The simulated Instance as a process, for its tests: start it on free ports, talk HTTP and
SSE to it, and the module-scoped `sim` fixture (one process per test module, reset between
tests). Every process started here is stopped by pid in a ``finally``/fixture teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from cacheroute_sim.processes import free_port, free_port_pair

ROOT = Path(__file__).resolve().parents[1]
TIME_SCALE = 0.05
MAX_CONCURRENCY = 4
# The shared sim's (fake) Redis target, handed to the KDN on every KV inject.
REDIS_ARGS = ("--redis-host", "10.9.8.7", "--redis-port", "6390", "--redis-db", "3",
              "--redis-password", "pw")
KDN_TIMEOUT_S = 0.5
# The simulators run on uvloop, whose timers count whole milliseconds from the start of the
# loop's turn: a simulated wait, timed by the client, may end up to 1 ms before its time.
TIMER_EARLY_S = 0.001
T = TypeVar("T")


# --------------------------------------------------------------------------- process helpers

class SimProcess:
    """One ``python -m cacheroute_sim.instance`` (or ``module``) subprocess, output captured to a file."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None, module: str = "cacheroute_sim.instance") -> None:
        self.port = port or free_port_pair()  # and its default control-plane port
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
                                     env=env if env is not None else clean_env())

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


def clean_env() -> dict[str, str]:
    # The developer's shell must not leak a token or CP URL into tests that check headers.
    env = {k: v for k, v in os.environ.items() if k not in ("PROXY_CP_TOKEN", "PROXY_CP_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def running_sim(log_path: Path, *args: str, port: int | None = None, ready: bool = True,
                module: str = "cacheroute_sim.instance") -> Iterator[SimProcess]:
    sim = SimProcess(list(args), log_path, port=port, module=module)
    try:
        if ready:
            sim.wait_ready()
        yield sim
    finally:
        sim.terminate()


def poll_until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
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
    with quiet(shared_sim, ("active", "queued", "held"), timeout_s=3):
        http("POST", shared_sim.url + "/sim/kv/clear")  # no KV kept from an earlier test
        yield shared_sim


@contextmanager
def quiet(process: SimProcess, busy_stats: tuple[str, ...], timeout_s: float) -> Iterator[None]:
    """A shared simulator (instance or KDN) reset before and after a test: a failed test must
    not leave held requests or changed knobs for the next one."""
    quiesce(process, busy_stats, timeout_s)
    try:
        yield
    finally:
        quiesce(process, busy_stats, timeout_s)


def quiesce(process: SimProcess, busy_stats: tuple[str, ...], timeout_s: float) -> None:
    """Default knobs, everything released, every `busy_stats` counter 0, then zeroed stats."""
    http("POST", process.url + "/sim/config/reset")
    deadline = time.monotonic() + timeout_s
    while True:
        http("POST", process.url + "/sim/release")
        _, _, stats = http("GET", process.url + "/sim/stats")
        if all(stats[key] == 0 for key in busy_stats):
            break
        assert time.monotonic() < deadline, f"{process.url} did not quiesce: {stats}"
        time.sleep(0.02)
    http("POST", process.url + "/sim/stats/reset")
