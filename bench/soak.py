"""Bounded soak under chaos: the real supervisor, steady mixed load, a flapping instance, a
worker SIGKILLed every minute; then the end invariants (nothing left in flight, no event lost,
timelines drained, worker RSS flat).

Run:  python -m bench.soak --duration 600 --out bench/results/soak.json     (make soak DURATION=600)

What it starts, on 127.0.0.1 only, with free ports and a private segment name, and stops by pid:
- `python -m supervisor run`: sidecar + 4 workers (least_load), PROXY_SIM_INSTANCES=0;
- 3 simulated instances (`python -m sim_instance ... --proxy-cp-url <cp> --time-scale 0.2`)
  that register themselves; instance 0 is the *flapper*.

Load: `--clients` closed-loop clients (default 20) with a little think time, each sending one
request at a time through the shared port: streaming and non-streaming chat, plain OpenAI and
Scheduler-shaped bodies, and ~10 % client cancels (connection closed before the response, or
mid-stream after the first token). One TCP connection per request, so the kernel spreads them
over the workers and a connection error can be tied to the worker that was killed.

Chaos (times from the start of the load):
- every `--flap-interval` s (20) the flapper's `fail_status` toggles 503 / none through
  `/sim/config`; every `--restart-every`-th (3rd) flap event instead stops that process
  (SIGTERM: it unregisters) and starts it again on the same port and id (it re-registers);
- every `--kill-interval` s (60, first at `--kill-offset` 45, each moved by up to
  `--kill-jitter` 10 s, seeded) one worker, in rotation, is
  SIGKILLed: its pid is read from its private port's `/healthz`, checked against
  `/debug/status` → `workers[]`, and the supervisor restarts it.

Outcomes of every request are classified (see `classify`):
- `ok`: 200 with a complete body (JSON with `_cacheroute_meta.error == null`; a stream ending
  with `data: [DONE]` and a clean `cacheroute_meta`);
- `client_cancelled`: the client closed the connection on purpose;
- `expected_worker_kill`: a connection error, truncated body or reset whose response came from
  the killed worker's pid, or that had no response head yet and was in progress at the kill
  (started at most `--kill-grace` s after it);
- `expected_flap`: the flapper's own 503 passed through (`x-cacheroute-instance` = flapper, an
  error code that is not one of the proxy's own) while its 503 knob was on; or, while the
  flapper was being restarted, a 502 `upstream_unavailable`/`upstream_failed` or a truncated
  stream from the flapper;
- everything else is `unexpected` (proxy 429/503/504, a 5xx from a healthy instance, a client
  timeout, a connection error nowhere near a kill, a 200 with a meta error, ...).

Measures: outcome counts, latency p50/p99 of `ok` requests (and TTFT of streams), worker RSS
per lineage (worker index + pid; a restarted worker is a new lineage with its own baseline
taken once it is `--warmup` s old; growth is reported for lineages that lived >= 60 s), the
events dropped by every worker lineage as seen while it lived (a killed worker's count leaves
`/debug/status` with its row), the chaos log, and at the end — after the load stops and the
counters settle (`--quiesce-timeout`) — the invariants checked by `end_checks`.

Exit status 0 when every invariant holds, 1 otherwise; the JSON is written either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent

# The proxy's own error codes (README "Endpoints"): a 5xx carrying one of these did not come
# from an instance.
PROXY_ERROR_CODES = frozenset({
    "invalid_json", "invalid_request_payload", "payload_too_large", "no_instance", "queue_full",
    "queue_timeout", "upstream_unavailable", "upstream_failed", "upstream_timeout",
    "internal_error"})
QUEUE_LANES = ("inflight", "active_prepare", "active_ready", "prepare_queue_depth",
               "ready_queue_depth")
ACCEPTABLE_CATEGORIES = ("ok", "client_cancelled", "expected_worker_kill", "expected_flap")

SCHEDULER_BODY: dict[str, Any] = {
    "Request_ID": 0, "Request_type": "request",
    "Prompt": {"model": "llama3-70b", "user_prompt": "Who wrote X?", "token_length": 42, "bs": 1,
               "max_tokens": 4, "stream": True, "temperature": 0.7, "top_p": 0.95},
    "Service": {"Enable_PD_Disaggregation": True, "Enable_know_injection": False,
                "Injection_type": "text", "Enable_compress": False, "Compress_factor": 0.3,
                "Enable_security": False, "Knowledge_block_num": 0, "Knowledge_List": [],
                "Knowledge_length": 0, "SLO_TTFT": 15000, "SLO_E2E": 215000, "SLO_TPOT": 200,
                "Endpoint_type": "chat/completions"},
    "Task": {"User_addr": "127.0.0.1", "KDN_server_addr": "", "default_know_addr": "",
             "P_proxy_id": "hp_127.0.0.1:8001", "P_proxy_addr": "127.0.0.1", "P_proxy_port": 8001,
             "D_proxy_addr": "", "D_proxy_port": 0, "prefill_instance": "0", "decode_instance": "",
             "batch_order": 0, "User_url_path": "/v1/chat/completions"},
}
WORDS = ("cache", "route", "proxy", "shared", "memory", "worker", "instance", "token", "queue",
         "stream", "prefill", "decode", "latency", "timeline", "sidecar", "segment")


@dataclass
class SoakConfig:
    duration_s: float = 600.0        # load duration (the warm-up is part of it)
    warmup_s: float = 20.0           # RSS baselines are taken once this old
    clients: int = 20
    workers: int = 4
    instances: int = 3
    time_scale: float = 0.2
    think_max_s: float = 0.3         # uniform 0..this between a client's requests
    max_tokens: tuple[int, int] = (8, 64)
    prompt_tokens: tuple[int, int] = (16, 600)
    stream_share: float = 0.6
    scheduler_share: float = 0.5
    cancel_rate: float = 0.10
    flap_interval_s: float = 20.0
    restart_every: int = 3           # every Nth flap event restarts the flapper's process
    restart_down_s: float = 2.0      # how long the flapper stays stopped
    kill_interval_s: float = 60.0
    kill_offset_s: float = 45.0
    kill_jitter_s: float = 10.0      # each kill time moves by a seeded uniform -j..+j, so kills
    #                                  land both while the flapper answers 503 and while it serves
    max_kills: int | None = None
    kill_grace_s: float = 2.0        # a headless connection error this soon after a kill is its
    chaos_quiet_tail_s: float = 10.0  # no chaos event starts in the last N s of the load
    status_sample_s: float = 2.0
    rss_sample_s: float = 5.0
    rss_min_lifetime_s: float = 60.0
    rss_growth_limit_pct: float = 10.0
    check_rss: bool = True
    quiesce_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    seed: int = 1
    log_dir: str | None = None


# --- processes -------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child: SIGTERM when the soak dies, so nothing it started outlives it (the
    supervisor then stops its own children and removes the segment)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """A child started here (always from the main thread: PDEATHSIG follows the creating
    thread) and stopped here by its pid."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.popen = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**os.environ, **env},
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=_die_with_parent)  # noqa: PLW1509 - as the supervisor

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signum)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int) -> int:
    for _ in range(200):
        base = free_port()
        if base + count >= 65000:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


def _get_sync(url: str, timeout: float = 2.0) -> Any:
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_sync(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


# --- statistics --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"count": len(values), "p50_ms": round(1000 * percentile(values, 0.50), 1),
            "p99_ms": round(1000 * percentile(values, 0.99), 1), "max_ms": round(1000 * max(values), 1)}


# --- outcome classification ----------------------------------------------------------------------
def _overlaps(rec: dict[str, Any], start: float, end: float, slack: float = 0.5) -> bool:
    return rec["t_start"] <= end + slack and rec["t_end"] >= start - slack


def classify(rec: dict[str, Any], kills: list[dict[str, Any]], fail_windows: list[tuple[float, float]],
             restart_windows: list[tuple[float, float]], flapper_id: str, kill_grace_s: float) -> str:
    """One of ACCEPTABLE_CATEGORIES, or "unexpected" (module docstring)."""
    outcome = rec["outcome"]
    if outcome == "ok":
        return "ok"
    if outcome.startswith("client_cancelled"):
        return "client_cancelled"
    # A worker SIGKILLed mid-request: the connection resets (before or after the head).
    broken = outcome.startswith("conn_error") or outcome == "stream_truncated"
    if broken:
        for kill in kills:
            if rec.get("worker_pid") == kill["pid"] and rec["t_end"] >= kill["t"] - 0.1:
                return "expected_worker_kill"
            if rec.get("worker_pid") is None and rec["t_start"] <= kill["t"] + kill_grace_s \
                    and rec["t_end"] >= kill["t"] - 0.1:
                return "expected_worker_kill"
    if rec.get("instance") == flapper_id:
        status, code = rec.get("status"), rec.get("error_code")
        if status == 503 and code not in PROXY_ERROR_CODES \
                and any(_overlaps(rec, a, b) for a, b in fail_windows):
            return "expected_flap"
        restarting = any(_overlaps(rec, a, b) for a, b in restart_windows)
        if restarting and (outcome == "stream_truncated"
                           or (status == 502 and code in ("upstream_unavailable", "upstream_failed"))):
            return "expected_flap"
    return "unexpected"


def _meta_of(stream: bytes) -> dict[str, Any] | None:
    """The `cacheroute_meta` payload at the end of a proxied stream, if there is one."""
    marker = b"event: cacheroute_meta\ndata: "
    start = stream.rfind(marker)
    if start < 0:
        return None
    start += len(marker)
    end = stream.find(b"\n", start)
    try:
        meta = json.loads(stream[start:end if end >= 0 else len(stream)])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


# --- the soak ----------------------------------------------------------------------------------------
@dataclass
class Lineage:
    worker_index: int
    pid: int
    created_at: float              # wall clock (psutil create_time)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (soak t, rss bytes)
    events_dropped_max: int = 0
    events_pending_max: int = 0


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.run_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="cacheroute-soak-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dp_port, self.cp_port = free_port(), free_port()
        self.private_base = free_port_range(cfg.workers)
        self.shm_name = f"/cacheroute_soak_{uuid.uuid4().hex[:10]}"
        self.env = {
            "PROXY_DP_PORT": str(self.dp_port), "PROXY_CP_PORT": str(self.cp_port),
            "PROXY_WORKER_PRIVATE_PORT_BASE": str(self.private_base),
            "PROXY_SHM_NAME": self.shm_name, "PROXY_SIM_INSTANCES": "0",
            "PROXY_INSTANCE_STRATEGY": "least_load", "PROXY_WORKERS": str(cfg.workers),
            "PROXY_SHM_INSTANCE_CAPACITY": "32", "PROXY_SHM_WORKER_CAPACITY": "16",
        }
        self.supervisor: Proc | None = None
        self.instance_ports = [free_port_range(2) for _ in range(cfg.instances)]  # port, port + 1
        self.instance_ids = [f"soak-sim-{i}" for i in range(cfg.instances)]
        self.instances: list[Proc | None] = [None] * cfg.instances
        self.flapper = 0
        self.t0 = 0.0                  # monotonic start of the load
        self.t0_wall = time.time()
        self.load_end = 0.0
        self.records: list[dict[str, Any]] = []
        self.chaos: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.fail_windows: list[tuple[float, float]] = []
        self.restart_windows: list[tuple[float, float]] = []
        self.lineages: dict[tuple[int, int], Lineage] = {}
        self.sidecar_rss: list[tuple[float, int]] = []
        self.sidecar_pids: set[int] = set()
        self.monitor_errors: list[str] = []
        self.flapper_failed: dict[int, int] = {}  # flapper pid -> 503s it answered
        self.final: dict[str, Any] = {}
        self.quiesced_after_s: float | None = None
        self.stop_result: dict[str, Any] = {}
        self.started_wall = time.time()
        self._request_id = 0
        self._stopping = asyncio.Event()

    # --- addresses --------------------------------------------------------------------------
    @property
    def dp_url(self) -> str:
        return f"http://127.0.0.1:{self.dp_port}"

    @property
    def cp_url(self) -> str:
        return f"http://127.0.0.1:{self.cp_port}"

    def worker_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.private_base + index}"

    def instance_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.instance_ports[i]}"

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- start and stop (synchronous, main thread) ---------------------------------------------
    def start(self) -> None:
        self.supervisor = Proc("supervisor", ["-m", "supervisor", "run"], self.env,
                               self.run_dir / "supervisor.log")
        for index in range(self.cfg.workers):
            _wait_sync(lambda i=index: _get_sync(f"{self.worker_url(i)}/healthz", 1)["ok"], 40,
                       f"worker {index} healthy\n{self.supervisor.tail()}")
        for i in range(self.cfg.instances):
            self._start_instance(i)
        for i in range(self.cfg.instances):
            _wait_sync(lambda i=i: self._registered_sync(i), 30, f"{self.instance_ids[i]} registered")

    def _instance_argv(self, i: int) -> list[str]:
        return ["-m", "sim_instance", "--host", "127.0.0.1", "--port", str(self.instance_ports[i]),
                "--cp-port", str(self.instance_ports[i] + 1), "--instance-id", self.instance_ids[i],
                "--proxy-cp-url", self.cp_url, "--time-scale", str(self.cfg.time_scale),
                "--seed", str(self.cfg.seed + i)]

    def _start_instance(self, i: int) -> None:
        self.instances[i] = Proc(self.instance_ids[i], self._instance_argv(i), {},
                                 self.run_dir / f"{self.instance_ids[i]}.log")

    def _registered_sync(self, i: int) -> bool:
        loads = _get_sync(f"{self.cp_url}/debug/instance_loads", 2)
        return any(r["instance_id"] == self.instance_ids[i] and r["is_alive"] for r in loads["instances"])

    def stop(self) -> None:
        """Instances first (they unregister), then the supervisor (SIGINT: workers, sidecar,
        segment); each by its pid; whatever does not stop in time is SIGKILLed."""
        codes: dict[str, Any] = {}
        for i, proc in enumerate(self.instances):
            if proc is not None:
                codes[self.instance_ids[i]] = proc.stop(signal.SIGTERM, 20)
        worker_pids = []
        if self.supervisor is not None:
            with contextlib.suppress(psutil.Error):
                worker_pids = [c.pid for c in psutil.Process(self.supervisor.pid).children()]
            codes["supervisor"] = self.supervisor.stop(signal.SIGINT, 60)
        time.sleep(0.2)
        leftovers = [pid for pid in worker_pids if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        self.stop_result = {
            "exit_codes": codes, "supervisor_children_left": leftovers,
            "segment_removed": not os.path.exists(f"/dev/shm{self.shm_name}")}

    # --- the run ---------------------------------------------------------------------------------
    async def drive(self) -> None:
        cfg = self.cfg
        self._stopping = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        control_timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as load, \
                aiohttp.ClientSession(timeout=control_timeout) as control:
            self.control = control
            self.t0 = time.monotonic()
            self.t0_wall = time.time()  # psutil's create_time is wall clock
            self.load_end = self.t0 + cfg.duration_s
            clients = [asyncio.ensure_future(self._client(load, random.Random(cfg.seed * 1000 + c)))
                       for c in range(cfg.clients)]
            helpers = [asyncio.ensure_future(coro) for coro in (
                self._status_sampler(), self._flapper(), self._killer())]
            await asyncio.gather(*clients)
            self._stopping.set()
            results = await asyncio.gather(*helpers, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    self.monitor_errors.append(f"{type(result).__name__}: {result}")
            await self._sample_once(final=True)
            await self._count_flapper_failures()
            await self._flapper_clean()
            await self._quiesce()

    # --- load ------------------------------------------------------------------------------------------
    def _body(self, rng: random.Random, stream: bool, scheduler: bool) -> dict[str, Any]:
        max_tokens = rng.randint(*self.cfg.max_tokens)
        tokens = rng.randint(*self.cfg.prompt_tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(tokens))
        if not scheduler:
            return {"model": "sim", "messages": [{"role": "user", "content": text}],
                    "stream": stream, "max_tokens": max_tokens}
        self._request_id += 1
        body = json.loads(json.dumps(SCHEDULER_BODY))
        body["Request_ID"] = self._request_id
        body["Prompt"].update(user_prompt=text, token_length=tokens, max_tokens=max_tokens,
                              stream=stream)
        return body

    async def _client(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        cfg = self.cfg
        await asyncio.sleep(rng.uniform(0, cfg.think_max_s))
        while time.monotonic() < self.load_end:
            stream = rng.random() < cfg.stream_share
            scheduler = rng.random() < cfg.scheduler_share
            cancel = None
            if rng.random() < cfg.cancel_rate:
                cancel = "mid_stream" if stream and rng.random() < 0.5 else "before_response"
            rec: dict[str, Any] = {"stream": stream, "shape": "scheduler" if scheduler else "openai",
                                   "cancel": cancel, "worker_pid": None, "instance": None,
                                   "status": None, "error_code": None}
            body = self._body(rng, stream, scheduler)
            rec["t_start"] = self.now()
            work = asyncio.ensure_future(self._request(session, body, rec))
            try:
                if cancel == "before_response":
                    # Closing the connection at a random moment before the response.
                    done, _ = await asyncio.wait({work}, timeout=rng.uniform(0.01, 0.25))
                    if not done:
                        work.cancel()
                        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
                            await work
                        rec["outcome"] = "client_cancelled"
                    else:
                        work.result()
                else:
                    await asyncio.wait_for(work, cfg.request_timeout_s)
            except TimeoutError:
                rec["outcome"] = "client_timeout"
            except (aiohttp.ClientError, OSError) as exc:
                rec["outcome"] = f"conn_error_{type(exc).__name__}"
                rec["detail"] = str(exc)[:200]
            rec["t_end"] = self.now()
            rec["latency_s"] = rec["t_end"] - rec["t_start"]
            self.records.append(rec)
            await asyncio.sleep(rng.uniform(0, cfg.think_max_s))

    async def _request(self, session: aiohttp.ClientSession, body: dict[str, Any], rec: dict[str, Any]) -> None:
        t_start = time.monotonic()
        async with session.post(f"{self.dp_url}/v1/chat/completions", json=body) as response:
            rec["status"] = response.status
            worker = response.headers.get("x-cacheroute-worker", "")
            if "-pid" in worker:
                rec["worker_pid"] = int(worker.rsplit("-pid", 1)[1])
            rec["instance"] = response.headers.get("x-cacheroute-instance")
            if response.status != 200:
                raw = await response.read()
                with contextlib.suppress(ValueError, AttributeError):
                    rec["error_code"] = json.loads(raw).get("error")
                rec["outcome"] = f"http_{response.status}_{rec['error_code']}"
                return
            if rec["stream"]:
                received = bytearray()
                async for chunk in response.content.iter_any():
                    if "ttft_s" not in rec and b'"content"' in chunk:
                        rec["ttft_s"] = time.monotonic() - t_start
                    received += chunk
                    if rec["cancel"] == "mid_stream" and "ttft_s" in rec:
                        response.close()  # the client goes away mid-stream
                        rec["outcome"] = "client_cancelled_mid_stream"
                        return
                text = bytes(received)
                meta = _meta_of(text)
                if not text.endswith(b"data: [DONE]\n\n"):
                    rec["outcome"] = "stream_truncated"
                    rec["detail"] = None if meta is None else str(meta.get("error"))[:200]
                elif meta is None or meta.get("error") is not None:
                    rec["outcome"] = "ok_with_meta_error"
                    rec["detail"] = None if meta is None else str(meta.get("error"))[:200]
                else:
                    rec["outcome"] = "ok"
                    rec["retries"] = meta.get("trace", {}).get("retries", 0)
            else:
                payload = json.loads(await response.read())
                meta = payload.get("_cacheroute_meta") or {}
                if meta.get("error") is None and payload.get("choices"):
                    rec["outcome"] = "ok"
                    rec["retries"] = meta.get("trace", {}).get("retries", 0)
                else:
                    rec["outcome"] = "ok_with_meta_error"
                    rec["detail"] = str(meta.get("error"))[:200]

    # --- monitors and chaos -------------------------------------------------------------------------------
    async def _get(self, url: str) -> Any:
        async with self.control.get(url) as response:
            return await response.json(content_type=None)

    async def _post(self, url: str, body: Any) -> Any:
        async with self.control.post(url, json=body) as response:
            assert response.status == 200, (url, response.status, await response.text())
            return await response.json(content_type=None)

    async def _sleep_until(self, t: float) -> bool:
        """Sleep until soak time t; False if the load ended first."""
        delay = t - self.now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
        return not self._stopping.is_set()

    def _chaos_allowed(self, t: float) -> bool:
        return t <= self.cfg.duration_s - self.cfg.chaos_quiet_tail_s

    async def _status_sampler(self) -> None:
        next_rss = self.cfg.warmup_s  # first RSS sample right after the warm-up, then every N s
        while not self._stopping.is_set():
            try:
                rss_due = self.now() >= next_rss
                await self._sample_once(final=False, rss=rss_due)
                if rss_due:
                    next_rss += self.cfg.rss_sample_s
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                self.monitor_errors.append(f"t={self.now():.1f} status sample: {exc!r}")
            if not await self._sleep_until(self.now() + self.cfg.status_sample_s):
                return

    async def _sample_once(self, final: bool, rss: bool = True) -> None:
        status = await self._get(f"{self.cp_url}/debug/status")
        t = self.now()
        self.sidecar_pids.add(status["sidecar"]["pid"])
        for row in status["workers"]:
            if not row["alive"]:
                continue
            key = (row["worker_index"], row["pid"])
            lineage = self.lineages.get(key)
            if lineage is None:
                try:
                    created = psutil.Process(row["pid"]).create_time()
                except psutil.Error:
                    continue
                lineage = self.lineages[key] = Lineage(row["worker_index"], row["pid"], created)
            lineage.events_dropped_max = max(lineage.events_dropped_max, row["events_dropped"])
            lineage.events_pending_max = max(lineage.events_pending_max, row["events_pending"])
            if rss and t >= self.cfg.warmup_s:
                with contextlib.suppress(psutil.Error):
                    lineage.samples.append((t, psutil.Process(row["pid"]).memory_info().rss))
        if rss and t >= self.cfg.warmup_s:
            with contextlib.suppress(psutil.Error):
                self.sidecar_rss.append((t, psutil.Process(status["sidecar"]["pid"]).memory_info().rss))

    async def _set_fail(self, on: bool) -> None:
        await self._post(f"{self.instance_url(self.flapper)}/sim/config",
                         {"fail_status": 503 if on else None})

    async def _flapper(self) -> None:
        cfg = self.cfg
        fail_on_since: float | None = None
        k = 0
        while True:
            k += 1
            t = k * cfg.flap_interval_s
            if not self._chaos_allowed(t) or not await self._sleep_until(t):
                break
            try:
                if cfg.restart_every and k % cfg.restart_every == 0:
                    if fail_on_since is not None:
                        self.fail_windows.append((fail_on_since, self.now()))
                        fail_on_since = None
                    await self._restart_flapper()
                else:
                    if fail_on_since is None:
                        await self._set_fail(True)
                        fail_on_since = self.now()
                        self.chaos.append({"t": round(fail_on_since, 2), "event": "flap_fail_503_on"})
                    else:
                        await self._set_fail(False)
                        self.fail_windows.append((fail_on_since, self.now()))
                        self.chaos.append({"t": round(self.now(), 2), "event": "flap_fail_off"})
                        fail_on_since = None
            except (aiohttp.ClientError, OSError, TimeoutError, AssertionError, RuntimeError) as exc:
                self.monitor_errors.append(f"t={self.now():.1f} flap: {exc!r}")
        if fail_on_since is not None:
            # The last 503 window lasts until the next event would have come, or the quiet tail.
            await self._sleep_until(min(k * cfg.flap_interval_s, cfg.duration_s - cfg.chaos_quiet_tail_s))
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AssertionError):
                await self._set_fail(False)
            self.fail_windows.append((fail_on_since, self.now()))
            self.chaos.append({"t": round(self.now(), 2), "event": "flap_fail_off"})

    async def _flapper_clean(self) -> None:
        """The flapper answers normally again (its knob off) before the end checks."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AssertionError):
            await self._set_fail(False)

    async def _count_flapper_failures(self) -> None:
        """The flapper's own count of 503s answered, per process (a restart resets it)."""
        proc = self.instances[self.flapper]
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            stats = await self._get(f"{self.instance_url(self.flapper)}/sim/stats")
            if proc is not None:
                self.flapper_failed[proc.pid] = stats["failed"]

    async def _restart_flapper(self) -> None:
        i = self.flapper
        t_stop = self.now()
        proc = self.instances[i]
        old_pid = proc.pid if proc else None
        await self._count_flapper_failures()
        if proc is not None:
            proc.popen.send_signal(signal.SIGTERM)  # unregisters, then shuts down
            deadline = time.monotonic() + 20
            while proc.running() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            code = proc.stop(signal.SIGKILL, 5)  # no-op if it already exited
        else:
            code = None
        t_stopped = self.now()
        await asyncio.sleep(self.cfg.restart_down_s)
        self._start_instance(i)  # main thread: the event loop runs on it
        deadline = time.monotonic() + 30
        registered = False
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                loads = await self._get(f"{self.cp_url}/debug/instance_loads")
                if any(r["instance_id"] == self.instance_ids[i] and r["is_alive"] for r in loads["instances"]):
                    registered = True
                    break
            await asyncio.sleep(0.1)
        t_registered = self.now()
        new = self.instances[i]
        self.restart_windows.append((t_stop, t_registered + 1.0))
        self.chaos.append({"t": round(t_stop, 2), "event": "flap_restart", "old_pid": old_pid,
                           "exit_code": code, "stopped_after_s": round(t_stopped - t_stop, 2),
                           "new_pid": None if new is None else new.pid,
                           "registered": registered,
                           "registered_after_s": round(t_registered - t_stop, 2)})
        if not registered:
            raise RuntimeError(f"{self.instance_ids[i]} did not re-register within 30 s")

    async def _killer(self) -> None:
        cfg = self.cfg
        n = 0
        jitter = random.Random(cfg.seed + 7)
        while cfg.max_kills is None or n < cfg.max_kills:
            t = cfg.kill_offset_s + n * cfg.kill_interval_s + jitter.uniform(-cfg.kill_jitter_s, cfg.kill_jitter_s)
            if not self._chaos_allowed(t) or not await self._sleep_until(t):
                return
            index = n % cfg.workers
            n += 1
            try:
                await self._kill_worker(index)
            except (aiohttp.ClientError, OSError, TimeoutError, AssertionError, RuntimeError,
                    psutil.Error) as exc:
                self.monitor_errors.append(f"t={self.now():.1f} kill worker {index}: {exc!r}")

    async def _kill_worker(self, index: int) -> None:
        health = await self._get(f"{self.worker_url(index)}/healthz")
        pid = health["pid"]
        status = await self._get(f"{self.cp_url}/debug/status")
        rows = [r for r in status["workers"] if r["pid"] == pid and r["alive"]]
        assert rows and rows[0]["worker_index"] == index, (index, pid, status["workers"])
        cmdline = " ".join(psutil.Process(pid).cmdline())
        assert "proxy_workers" in cmdline, (pid, cmdline)
        lineage = self.lineages.get((index, pid))
        if lineage is not None:
            lineage.events_dropped_max = max(lineage.events_dropped_max, rows[0]["events_dropped"])
        with contextlib.suppress(psutil.Error):
            if lineage is not None and self.now() >= self.cfg.warmup_s:
                lineage.samples.append((self.now(), psutil.Process(pid).memory_info().rss))
        t_kill = self.now()
        os.kill(pid, signal.SIGKILL)
        kill = {"t": t_kill, "worker_index": index, "pid": pid,
                "events_dropped_before": rows[0]["events_dropped"]}
        self.kills.append(kill)
        deadline = time.monotonic() + 30
        new_pid = None
        while time.monotonic() < deadline and new_pid is None:
            await asyncio.sleep(0.1)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                got = (await self._get(f"{self.worker_url(index)}/healthz"))["pid"]
                new_pid = got if got != pid else None
        kill["new_pid"] = new_pid
        kill["replaced_after_s"] = None if new_pid is None else round(self.now() - t_kill, 2)
        reaped = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and reaped is None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                status = await self._get(f"{self.cp_url}/debug/status")
                reaped = next((r for r in status["reaper"]["last_reaped"] if r["pid"] == pid), None)
            if reaped is None:
                await asyncio.sleep(0.1)
        kill["reaped"] = reaped is not None
        kill["subtracted_inflight"] = None if reaped is None else reaped["subtracted"]
        kill["died_mid_update"] = None if reaped is None else reaped["died_mid_update"]
        self.chaos.append({"event": "worker_sigkill", **{k: (round(v, 2) if isinstance(v, float) else v)
                                                         for k, v in kill.items()}})
        if new_pid is None:
            raise RuntimeError(f"worker {index} was not replaced within 30 s")

    # --- the end ----------------------------------------------------------------------------------------------
    async def _snapshot(self) -> dict[str, Any]:
        sources = {"control_plane": self.cp_url,
                   **{f"worker{i}": self.worker_url(i) for i in range(self.cfg.workers)}}
        loads = {}
        for name, base in sources.items():
            loads[name] = await self._get(f"{base}/debug/instance_loads")
        health = {i: await self._get(f"{self.worker_url(i)}/healthz") for i in range(self.cfg.workers)}
        status = await self._get(f"{self.cp_url}/debug/status")
        return {"loads": loads, "status": status, "health": health}

    @staticmethod
    def _settled(snap: dict[str, Any]) -> bool:
        ch = snap["status"]["event_channel"]
        lanes_zero = all(row.get(lane) == 0 for loads in snap["loads"].values()
                         for row in loads["instances"] for lane in QUEUE_LANES)
        return lanes_zero and ch["pending_reservations"] == 0 and ch["decoding"] == 0

    async def _quiesce(self) -> None:
        t_quiet = time.monotonic()
        deadline = t_quiet + self.cfg.quiesce_timeout_s
        snap: dict[str, Any] = {}
        while True:
            try:
                snap = await self._snapshot()
                if self._settled(snap) and time.monotonic() - t_quiet >= 1.0:
                    self.quiesced_after_s = round(time.monotonic() - t_quiet, 2)
                    break
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                self.monitor_errors.append(f"quiesce snapshot: {exc!r}")
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
        if not snap:
            snap = await self._snapshot()
        self.final = snap
        stats = {}
        for i, inst_id in enumerate(self.instance_ids):
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                stats[inst_id] = await self._get(f"{self.instance_url(i)}/sim/stats")
        self.final["sim_stats"] = stats

    # --- report ------------------------------------------------------------------------------------------------
    def outcome_summary(self) -> dict[str, Any]:
        outcomes: dict[str, int] = {}
        categories: dict[str, int] = {c: 0 for c in (*ACCEPTABLE_CATEGORIES, "unexpected")}
        unexpected_by_outcome: dict[str, int] = {}
        unexpected_samples: list[dict[str, Any]] = []
        flapper_id = self.instance_ids[self.flapper]
        for rec in self.records:
            outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
            category = classify(rec, self.kills, self.fail_windows, self.restart_windows,
                                flapper_id, self.cfg.kill_grace_s)
            rec["category"] = category
            categories[category] += 1
            if category == "unexpected":
                unexpected_by_outcome[rec["outcome"]] = unexpected_by_outcome.get(rec["outcome"], 0) + 1
                if len(unexpected_samples) < 40:
                    unexpected_samples.append({k: (round(v, 3) if isinstance(v, float) else v)
                                               for k, v in rec.items()})
        ok = [r for r in self.records if r["outcome"] == "ok"]
        by_instance: dict[str, int] = {}
        by_worker_index: dict[str, int] = {}
        pid_to_index = {pid: idx for (idx, pid) in self.lineages}
        for r in ok:
            by_instance[r["instance"]] = by_instance.get(r["instance"], 0) + 1
            w = str(pid_to_index.get(r["worker_pid"], "?"))
            by_worker_index[w] = by_worker_index.get(w, 0) + 1
        five_xx = {k: v for k, v in outcomes.items() if k.startswith("http_5")}
        five_xx_unexpected = sum(1 for r in self.records
                                 if r["category"] == "unexpected" and (r.get("status") or 0) >= 500)
        return {
            "total": len(self.records),
            "per_second": round(len(self.records) / self.cfg.duration_s, 1),
            "outcomes": dict(sorted(outcomes.items(), key=lambda kv: -kv[1])),
            "categories": categories,
            "acceptable_categories": list(ACCEPTABLE_CATEGORIES),
            "unexpected_by_outcome": unexpected_by_outcome,
            "unexpected_samples": unexpected_samples,
            "http_5xx": five_xx, "http_5xx_unexpected": five_xx_unexpected,
            "client_cancels_attempted": sum(1 for r in self.records if r["cancel"]),
            "retried_on_another_instance": sum(1 for r in ok if r.get("retries")),
            "mix": {"stream": sum(1 for r in self.records if r["stream"]),
                    "non_stream": sum(1 for r in self.records if not r["stream"]),
                    "scheduler": sum(1 for r in self.records if r["shape"] == "scheduler"),
                    "openai": sum(1 for r in self.records if r["shape"] == "openai")},
            "ok_by_instance": by_instance, "ok_by_worker_index": by_worker_index,
            "latency": {
                "all_ok": _ms([r["latency_s"] for r in ok]),
                "stream_ok": _ms([r["latency_s"] for r in ok if r["stream"]]),
                "non_stream_ok": _ms([r["latency_s"] for r in ok if not r["stream"]]),
                "stream_ttft": _ms([r["ttft_s"] for r in ok if r["stream"] and "ttft_s" in r]),
            },
        }

    def rss_summary(self) -> dict[str, Any]:
        lineages = []
        growths = []
        for lin in sorted(self.lineages.values(), key=lambda l: (l.worker_index, l.created_at)):
            t_created = lin.created_at - self.t0_wall  # soak time at which the worker started
            # Baseline: the first sample once the worker is warmup_s old (and the soak too).
            base = next(((t, rss) for t, rss in lin.samples if t - t_created >= self.cfg.warmup_s), None)
            last = lin.samples[-1] if lin.samples else None
            lived = None if last is None else last[0] - t_created
            entry: dict[str, Any] = {
                "worker_index": lin.worker_index, "pid": lin.pid,
                "started_at_s": round(t_created, 1), "lived_s": None if lived is None else round(lived, 1),
                "samples": len(lin.samples),
                "replaced": any(k["pid"] == lin.pid for k in self.kills),
                "events_dropped_max": lin.events_dropped_max,
                "events_pending_max": lin.events_pending_max}
            if base and last and last[0] > base[0]:
                growth = 100.0 * (last[1] - base[1]) / base[1]
                entry.update(baseline_at_s=round(base[0], 1), baseline_rss_mb=round(base[1] / 2**20, 2),
                             end_at_s=round(last[0], 1), end_rss_mb=round(last[1] / 2**20, 2),
                             peak_rss_mb=round(max(r for _, r in lin.samples) / 2**20, 2),
                             growth_pct=round(growth, 2))
                entry["reported"] = lived is not None and lived >= self.cfg.rss_min_lifetime_s
                if entry["reported"]:
                    growths.append(growth)
            else:
                entry["reported"] = False
            lineages.append(entry)
        sidecar = None
        if len(self.sidecar_rss) >= 2:
            (_, r0), (_, r1) = self.sidecar_rss[0], self.sidecar_rss[-1]
            sidecar = {"start_rss_mb": round(r0 / 2**20, 2), "end_rss_mb": round(r1 / 2**20, 2),
                       "growth_pct": round(100.0 * (r1 - r0) / r0, 2)}
        return {"lineages": lineages, "reported_lineages": len(growths),
                "max_growth_pct": None if not growths else round(max(growths), 2),
                "limit_pct": self.cfg.rss_growth_limit_pct,
                "min_lifetime_s": self.cfg.rss_min_lifetime_s, "sidecar": sidecar}

    def end_checks(self, outcomes: dict[str, Any], rss: dict[str, Any]) -> dict[str, Any]:
        snap = self.final
        status = snap.get("status", {})
        ch = status.get("event_channel", {})
        nonzero = []
        for source, loads in snap.get("loads", {}).items():
            for row in loads["instances"]:
                bad = {lane: row.get(lane) for lane in QUEUE_LANES if row.get(lane) != 0}
                if bad:
                    nonzero.append({"source": source, "instance": row["instance_id"],
                                    "alive": row["is_alive"], **bad})
        alive_ids = sorted(r["instance_id"] for r in snap.get("loads", {}).get("control_plane", {})
                           .get("instances", []) if r["is_alive"])
        workers_alive = [w for w in status.get("workers", []) if w["alive"]]
        health_pids = sorted(h["pid"] for h in snap.get("health", {}).values())
        dropped_rows = {f"w{w['worker_index']}-pid{w['pid']}": w["events_dropped"]
                        for w in status.get("workers", [])}
        dropped_lineages = {f"w{l.worker_index}-pid{l.pid}": l.events_dropped_max
                            for l in self.lineages.values() if l.events_dropped_max}
        checks: dict[str, dict[str, Any]] = {
            "inflight_and_lanes_zero_everywhere": {
                "pass": not nonzero and bool(snap.get("loads")),
                "sources": sorted(snap.get("loads", {})), "lanes": list(QUEUE_LANES),
                "nonzero": nonzero, "quiesced_after_s": self.quiesced_after_s},
            "every_instance_alive": {"pass": alive_ids == sorted(self.instance_ids), "alive": alive_ids},
            "no_event_dropped": {
                "pass": ch.get("events_dropped_by_workers") == 0 and not any(dropped_rows.values())
                and not dropped_lineages,
                "events_dropped_by_workers": ch.get("events_dropped_by_workers"),
                "workers_events_dropped": dropped_rows,
                "dropped_by_any_lineage_while_alive": dropped_lineages},
            "timelines_drained": {
                "pass": ch.get("pending_reservations") == 0 and ch.get("decoding") == 0,
                "pending_reservations": ch.get("pending_reservations"), "decoding": ch.get("decoding"),
                "expired_reservations": ch.get("expired_reservations"),
                "events_consumed": ch.get("events_consumed"),
                "events_from_previous_epoch": ch.get("events_from_previous_epoch")},
            "reaper": {
                "pass": status.get("reaper", {}).get("reaped", 0) >= len(self.kills)
                and all(k.get("reaped") and k.get("new_pid") for k in self.kills),
                "corrections": status.get("reaper", {}).get("corrections"),
                "reaped": status.get("reaper", {}).get("reaped"),
                "subtracted": status.get("reaper", {}).get("subtracted"),
                "kills": len(self.kills)},
            "workers_all_alive": {
                "pass": len(workers_alive) == self.cfg.workers
                and sorted(w["pid"] for w in workers_alive) == health_pids,
                "alive_rows": len(workers_alive), "rows": len(status.get("workers", []))},
            "sidecar_never_restarted": {"pass": len(self.sidecar_pids) == 1,
                                        "pids": sorted(self.sidecar_pids)},
            "no_unexpected_outcome": {"pass": outcomes["categories"]["unexpected"] == 0,
                                      "unexpected": outcomes["categories"]["unexpected"],
                                      "by_outcome": outcomes["unexpected_by_outcome"]},
            "chaos_ran_cleanly": {"pass": not self.monitor_errors, "errors": self.monitor_errors[:20]},
        }
        if self.cfg.check_rss:
            checks["worker_rss_growth_under_limit"] = {
                "pass": rss["max_growth_pct"] is not None
                and rss["max_growth_pct"] < self.cfg.rss_growth_limit_pct,
                "max_growth_pct": rss["max_growth_pct"], "limit_pct": self.cfg.rss_growth_limit_pct,
                "reported_lineages": rss["reported_lineages"]}
        return checks

    def report(self, command: str) -> dict[str, Any]:
        outcomes = self.outcome_summary()
        rss = self.rss_summary()
        checks = self.end_checks(outcomes, rss)
        checks["clean_stop"] = {"pass": bool(self.stop_result.get("segment_removed"))
                                and not self.stop_result.get("supervisor_children_left")
                                and self.stop_result.get("exit_codes", {}).get("supervisor") == 0,
                                **self.stop_result}
        status = self.final.get("status", {})
        return {
            "command": command,
            "passed": all(c["pass"] for c in checks.values()),
            "failed_checks": [name for name, c in checks.items() if not c["pass"]],
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.cfg).items()},
            "setup": {"workers": self.cfg.workers, "strategy": "least_load",
                      "instances": self.instance_ids, "flapper": self.instance_ids[self.flapper],
                      "sim_time_scale": self.cfg.time_scale, "shm_name": self.shm_name,
                      "log_dir": str(self.run_dir)},
            "requests": outcomes,
            "chaos": {"worker_kills": len(self.kills),
                      "flap_503_windows": len(self.fail_windows),
                      "flapper_restarts": len(self.restart_windows),
                      "flapper_503_answered": sum(self.flapper_failed.values()),
                      "flapper_503_seen_by_clients": sum(
                          1 for r in self.records if r.get("instance") == self.instance_ids[self.flapper]
                          and r.get("status") == 503),
                      "events": sorted(self.chaos, key=lambda e: e["t"])},
            "worker_rss": rss,
            "end_checks": checks,
            "final_status": {k: status.get(k) for k in ("event_channel", "reaper", "workers", "sidecar")},
            "sim_stats": self.final.get("sim_stats"),
            "machine": {"cpus": os.cpu_count(), "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                        "python": sys.version.split()[0]},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started_wall)),
            "wall_s": round(time.time() - self.started_wall, 1),
        }


def run_soak(cfg: SoakConfig, command: str = "") -> dict[str, Any]:
    """Start, drive, check, stop. Always stops what it started, then returns the report."""
    soak = Soak(cfg)
    try:
        soak.start()
        asyncio.run(soak.drive())
    finally:
        soak.stop()
    return soak.report(command)


def summary_lines(report: dict[str, Any]) -> list[str]:
    req = report["requests"]
    lat = req["latency"]
    rss = report["worker_rss"]
    verdict = "PASSED" if report["passed"] else "FAILED: " + ", ".join(report["failed_checks"])
    chaos = report["chaos"]
    lines = [
        (f"soak {report['config']['duration_s']:.0f}s: {req['total']} requests "
         f"({req['per_second']}/s), {verdict}"),
        f"  categories: {req['categories']}",
        f"  outcomes:   {req['outcomes']}",
        (f"  latency ok: p50 {lat['all_ok']['p50_ms']} ms, p99 {lat['all_ok']['p99_ms']} ms; "
         f"stream TTFT p50 {lat['stream_ttft']['p50_ms']} ms, p99 {lat['stream_ttft']['p99_ms']} ms"),
        (f"  chaos: {chaos['worker_kills']} worker kills, {chaos['flap_503_windows']} 503 windows, "
         f"{chaos['flapper_restarts']} flapper restarts; the flapper answered "
         f"{chaos['flapper_503_answered']} 503s, clients saw {chaos['flapper_503_seen_by_clients']}"),
        (f"  worker RSS: max growth {rss['max_growth_pct']} % over {rss['reported_lineages']} "
         f"lineages (limit {rss['limit_pct']} %); sidecar {rss['sidecar']}"),
    ]
    for name, check in report["end_checks"].items():
        detail = {k: v for k, v in check.items() if k != "pass" and not isinstance(v, (list, dict))}
        lines.append(f"  [{'ok' if check['pass'] else 'FAIL'}] {name} {detail}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load (default 600)")
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--warmup", type=float, default=d.warmup_s)
    p.add_argument("--flap-interval", type=float, default=d.flap_interval_s)
    p.add_argument("--restart-every", type=int, default=d.restart_every)
    p.add_argument("--kill-interval", type=float, default=d.kill_interval_s)
    p.add_argument("--kill-offset", type=float, default=d.kill_offset_s)
    p.add_argument("--kill-jitter", type=float, default=d.kill_jitter_s)
    p.add_argument("--kill-grace", type=float, default=d.kill_grace_s)
    p.add_argument("--cancel-rate", type=float, default=d.cancel_rate)
    p.add_argument("--quiesce-timeout", type=float, default=d.quiesce_timeout_s)
    p.add_argument("--rss-limit", type=float, default=d.rss_growth_limit_pct)
    p.add_argument("--no-rss-check", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-dir", default=None, help="process logs (default: a new /tmp directory)")
    args = p.parse_args(argv)
    cfg = SoakConfig(duration_s=args.duration, clients=args.clients, time_scale=args.time_scale,
                     warmup_s=args.warmup, flap_interval_s=args.flap_interval,
                     restart_every=args.restart_every, kill_interval_s=args.kill_interval,
                     kill_offset_s=args.kill_offset, kill_jitter_s=args.kill_jitter, kill_grace_s=args.kill_grace,
                     cancel_rate=args.cancel_rate, quiesce_timeout_s=args.quiesce_timeout,
                     rss_growth_limit_pct=args.rss_limit, check_rss=not args.no_rss_check,
                     seed=args.seed, log_dir=args.log_dir)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_soak's finally: everything is stopped

    signal.signal(signal.SIGTERM, on_term)
    command = "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run_soak(cfg, command)
    print("\n".join(summary_lines(report)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)
        print(f"written {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
