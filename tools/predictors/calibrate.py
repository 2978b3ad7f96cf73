"""Measure a running OpenAI-compatible instance into predictor benchmark tables.

    # an engine on loopback (vLLM, or the simulated instance: docs/testing.md), then
    python -m tools.predictors.calibrate --url http://127.0.0.1:9901 --out-dir /tmp/cal
    # then fit a profile from the tables:
    python -m tools.predictors.refit --base llama3-70b-8x5090 --name NAME --aggregate median \\
        --ttft /tmp/cal/ttft.json --tpot /tmp/cal/tpot.json --out proxy_workers/predictors/profiles/NAME.json

What is measured (all over loopback only; the whole run is bounded by ``--max-seconds``):

- TTFT at bs=1: one streaming chat request at a time per prompt length; time from sending the
  request to the first chunk that carries a token (``carries_a_token``: ``delta.content``, even
  empty, in a chunk that is not the role-only opening one). ``max_tokens=1``. Prompts are
  ``4·L`` characters (≈ L tokens; the simulated instance counts exactly ceil(chars/4)), and
  each starts with a unique nonce so a prefix cache cannot serve a repeat. If the server
  reports ``usage.prompt_tokens`` (``stream_options.include_usage``) that count is recorded
  instead of the estimate. Default lengths lie above the short-prompt anchor range (345
  tokens): the fitted line is what applies there.
- TPOT at bs ∈ {1, 2, 4, 8}: bs concurrent streams with a long ``max_tokens`` (and
  ``ignore_eos``). Prefills are staggered, so only the window when all bs streams are decoding
  counts: from the last stream's first content chunk until every stream has produced
  ``--tpot-window-tokens`` more chunks (then all streams are closed, which aborts them) or the
  first stream ends. TPOT = mean gap between consecutive content chunks inside that window,
  assuming one token per chunk; the context length recorded is prompt + mean chunk index.

Rows are raw samples (repeats included); ``refit_predictors --aggregate median`` reduces them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import json
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from tools.predictors.tables import TpotTable, TtftTable, write_table

DEFAULT_TTFT_LENGTHS = (400, 700, 1000, 1500, 2000, 2500, 3000)
DEFAULT_TPOT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_TPOT_LENGTHS = (64, 512)

_FILLER = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
           "quiet hills and calm rivers flow toward distant green valleys ")


class CalibrationError(RuntimeError):
    pass


def make_prompt(tokens: int, nonce: str) -> str:
    """Exactly 4·tokens characters: a nonce, then filler text."""
    chars = 4 * tokens
    head = f"[{nonce}] "
    body = _FILLER * (chars // len(_FILLER) + 2)
    return (head + body)[:chars]


def require_loopback(url: str) -> None:
    """Refuse anything but a loopback address (this tool is not meant to load remote hosts)."""
    host = urlsplit(url).hostname
    if not host:
        raise CalibrationError(f"--url {url!r} has no host")
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise CalibrationError(f"--url host {host!r} does not resolve ({exc})") from None
    addresses = {str(info[4][0]) for info in infos}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                for a in addresses):
        raise CalibrationError(f"--url host {host!r} resolves to {sorted(addresses)}: "
                               "only loopback instances are calibrated")


@dataclass
class StreamTrace:
    sent_at: float
    prompt_tokens_estimate: int
    chunk_times: list[float] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    finished_at: float | None = None  # set when the stream ended by itself ([DONE] / EOF)

    @property
    def prompt_tokens(self) -> int:
        return self.usage_prompt_tokens or self.prompt_tokens_estimate


async def run_stream(session: aiohttp.ClientSession, url: str, model: str, tokens: int,
                     max_tokens: int, trace: StreamTrace | None = None) -> StreamTrace:
    """One streaming chat request; records the arrival time of every content chunk."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": make_prompt(tokens, uuid.uuid4().hex[:12])}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    trace = trace or StreamTrace(sent_at=0.0, prompt_tokens_estimate=tokens)
    trace.sent_at = time.perf_counter()
    async with session.post(url.rstrip("/") + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise CalibrationError(f"instance answered {resp.status}: {text}")
        try:
            await _read_events(resp, trace)
        except asyncio.CancelledError:
            resp.close()  # drop the connection: the instance sees the client go and aborts
            raise
        trace.finished_at = time.perf_counter()
    return trace


async def _read_events(resp: aiohttp.ClientResponse, trace: StreamTrace) -> None:
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        usage = event.get("usage")
        if usage and usage.get("prompt_tokens"):
            trace.usage_prompt_tokens = int(usage["prompt_tokens"])
        if carries_a_token(event):
            trace.chunk_times.append(now)


def carries_a_token(event: dict) -> bool:
    """Whether a stream chunk is one generated token's: a choice with `delta.content` or `text`,
    even empty. vLLM sends a chunk per token, and a token that ends inside a UTF-8 character
    has empty text until the next one completes it (a random-weight model emits such tokens
    often, max_tokens=1 can give only that). The opening chunk that only names the role
    (`delta.role`) is not a token."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") is not None or (delta.get("content") is not None and "role" not in delta):
            return True
    return False


def window_gaps(traces: Sequence[StreamTrace], window_end: float) -> tuple[list[float], float]:
    """Inter-chunk gaps (ms) that lie inside the window when every stream was decoding, and
    the mean context length (prompt + chunk index) at those gaps."""
    if not traces or any(not t.chunk_times for t in traces):
        return [], 0.0
    start = max(t.chunk_times[0] for t in traces)
    end = min([window_end] + [t.finished_at for t in traces if t.finished_at is not None])
    gaps: list[float] = []
    contexts: list[float] = []
    for t in traces:
        times = t.chunk_times
        for k in range(1, len(times)):
            if times[k - 1] >= start and times[k] <= end:
                gaps.append((times[k] - times[k - 1]) * 1000.0)
                contexts.append(t.prompt_tokens + k)
    mean_context = sum(contexts) / len(contexts) if contexts else 0.0
    return gaps, mean_context


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


async def measure_ttft(session: aiohttp.ClientSession, url: str, model: str,
                       lengths: Sequence[int], repeats: int, budget: Budget,
                       log: list[str]) -> list[tuple[int, int, float]]:
    rows: list[tuple[int, int, float]] = []
    ms_per_token = 0.0  # running estimate, to skip what would overrun the budget
    for rep in range(repeats):
        for tokens in lengths:
            expected_s = ms_per_token * tokens / 1000.0
            if budget.left() < expected_s * 1.5 + 1.0:
                log.append(f"ttft: skipped L={tokens} rep {rep} (time budget)")
                continue
            try:
                trace = await asyncio.wait_for(run_stream(session, url, model, tokens, 1),
                                               timeout=max(1.0, budget.left()))
            except TimeoutError:
                log.append(f"ttft: L={tokens} timed out at the time budget")
                return rows
            if not trace.chunk_times:
                raise CalibrationError(f"ttft: no content chunk for L={tokens}")
            ttft_ms = (trace.chunk_times[0] - trace.sent_at) * 1000.0
            rows.append((trace.prompt_tokens, 1, round(ttft_ms, 3)))
            ms_per_token = max(ms_per_token, ttft_ms / max(1, tokens))
            print(f"  ttft L={trace.prompt_tokens:5d} bs=1 {ttft_ms:9.2f} ms", flush=True)
    return rows


async def measure_tpot_once(session: aiohttp.ClientSession, url: str, model: str, tokens: int,
                            bs: int, window_tokens: int, max_tokens: int,
                            timeout_s: float) -> tuple[list[float], float, list[StreamTrace]]:
    traces = [StreamTrace(sent_at=0.0, prompt_tokens_estimate=tokens) for _ in range(bs)]
    tasks = [asyncio.create_task(run_stream(session, url, model, tokens, max_tokens, trace))
             for trace in traces]
    deadline = time.perf_counter() + timeout_s
    try:
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise CalibrationError(f"tpot stream failed: {failed[0].exception()}")
            if any(t.done() for t in tasks):
                break  # one stream ended by itself: the window closes there
            if all(tr.chunk_times for tr in traces):
                start = max(tr.chunk_times[0] for tr in traces)
                if all(sum(1 for x in tr.chunk_times if x >= start) > window_tokens
                       for tr in traces):
                    break
        window_end = time.perf_counter()
    finally:
        for task in tasks:
            task.cancel()  # closes the connections: the instance aborts the requests
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps, context = window_gaps(traces, window_end)
    return gaps, context, traces


async def measure_tpot(session: aiohttp.ClientSession, url: str, model: str,
                       batch_sizes: Sequence[int], lengths: Sequence[int], repeats: int,
                       window_tokens: int, max_tokens: int, budget: Budget,
                       ttft_rows: Sequence[tuple[int, int, float]],
                       log: list[str]) -> list[tuple[float, int, float]]:
    rows: list[tuple[float, int, float]] = []
    itl_guess_ms = 30.0
    for rep in range(repeats):
        for tokens in lengths:
            prefill_ms = _estimate_prefill_ms(ttft_rows, tokens)
            for bs in batch_sizes:
                expected_s = (bs * prefill_ms + (window_tokens + 2) * itl_guess_ms * 1.3) / 1000
                if budget.left() < expected_s * 1.5 + 1.0:
                    log.append(f"tpot: skipped L={tokens} bs={bs} rep {rep} (time budget)")
                    continue
                gaps, context, traces = await measure_tpot_once(
                    session, url, model, tokens, bs, window_tokens, max_tokens,
                    timeout_s=max(1.0, min(budget.left(), expected_s * 4 + 5)))
                if len(gaps) < max(3, bs):
                    log.append(f"tpot: L={tokens} bs={bs}: only {len(gaps)} gaps in the "
                               "all-decoding window, row dropped")
                    continue
                mean_gap = sum(gaps) / len(gaps)
                itl_guess_ms = max(itl_guess_ms, mean_gap)
                rows.append((round(context, 1), bs, round(mean_gap, 4)))
                print(f"  tpot L={traces[0].prompt_tokens:5d} bs={bs} ctx={context:8.1f} "
                      f"{mean_gap:8.3f} ms/token ({len(gaps)} gaps)", flush=True)
    return rows


def _estimate_prefill_ms(ttft_rows: Sequence[tuple[int, int, float]], tokens: int) -> float:
    """Rough prefill time for budget planning: proportional to the measured TTFT rows."""
    if not ttft_rows:
        return 0.0015 * tokens * 1000.0
    per_token = max(ms / t for t, _, ms in ttft_rows)
    return max(60.0, per_token * tokens)


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise CalibrationError(f"instance at {url} not answering /v1/models after {timeout_s}s "
                           f"({last})")


def _model_of(url: str) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=5.0) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        raise CalibrationError(f"cannot read the model name from {url}/v1/models ({exc}); "
                               "pass --model") from None


async def calibrate(args: argparse.Namespace, url: str, log: list[str],
                    ) -> tuple[list[tuple[int, int, float]], list[tuple[float, int, float]]]:
    budget = Budget(args.max_seconds)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        # Warm-up: connection setup and any lazy server initialisation stay out of the rows.
        await run_stream(session, url, args.model, 16, 2)
        print("TTFT (bs=1):", flush=True)
        ttft_rows = await measure_ttft(session, url, args.model, args.ttft_lengths,
                                       args.ttft_repeats, budget, log)
        print("TPOT:", flush=True)
        tpot_rows = await measure_tpot(session, url, args.model, args.tpot_bs, args.tpot_lengths,
                                       args.tpot_repeats, args.tpot_window_tokens,
                                       args.tpot_max_tokens, budget, ttft_rows, log)
    return ttft_rows, tpot_rows


def _int_list(text: str) -> tuple[int, ...]:
    # argparse passes defaults through unchanged (they are tuples already), strings here.
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.predictors.calibrate",
                                description="Measure TTFT and TPOT of a loopback instance into "
                                            "tables for tools/predictors/refit.py.")
    p.add_argument("--url", required=True,
                   help="base URL of a running instance on loopback, e.g. http://127.0.0.1:9001")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--out-dir", type=Path, required=True, help="writes ttft.json and tpot.json")
    p.add_argument("--ttft-lengths", type=_int_list, default=DEFAULT_TTFT_LENGTHS,
                   help="prompt lengths in tokens (default %(default)s)")
    p.add_argument("--ttft-repeats", type=int, default=2)
    p.add_argument("--tpot-bs", type=_int_list, default=DEFAULT_TPOT_BATCH_SIZES)
    p.add_argument("--tpot-lengths", type=_int_list, default=DEFAULT_TPOT_LENGTHS,
                   help="prompt lengths of the TPOT streams (default %(default)s)")
    p.add_argument("--tpot-repeats", type=int, default=2)
    p.add_argument("--tpot-window-tokens", type=int, default=40,
                   help="chunks per stream to collect while all bs streams decode")
    p.add_argument("--tpot-max-tokens", type=int, default=2048,
                   help="max_tokens of TPOT streams (they are closed once the window is full)")
    p.add_argument("--max-seconds", type=float, default=150.0,
                   help="time budget; measurements that would overrun it are skipped")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    started = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    log: list[str] = []
    url = target = args.url
    try:
        require_loopback(url)
        _wait_healthy(url, 15.0)
        args.model = args.model or _model_of(url)
        t0 = time.monotonic()
        ttft_rows, tpot_rows = asyncio.run(calibrate(args, url, log))
        elapsed = time.monotonic() - t0
    except (CalibrationError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        print(f"calibrate_instance: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for line in log:
        print(f"note: {line}", file=sys.stderr)
    if not ttft_rows and not tpot_rows:
        print("calibrate_instance: nothing measured", file=sys.stderr)
        return 1

    command = "python -m tools.predictors.calibrate " + shlex.join(argv_list)
    source = (f"Measured by tools/predictors/calibrate.py on {started} against {target} "
              f"(model {args.model!r}) in {elapsed:.0f} s; command: {command}")
    out: Path = args.out_dir
    written = []
    if ttft_rows:
        write_table(out / "ttft.json", TtftTable(
            kind="ttft", rows=ttft_rows,
            source=source + ". Streaming chat, max_tokens=1, time to the first chunk carrying a token, "
                            "bs=1, requests one at a time."))
        written.append(out / "ttft.json")
    if tpot_rows:
        write_table(out / "tpot.json", TpotTable(
            kind="tpot", rows=tpot_rows,
            source=source + ". bs concurrent streams; mean inter-chunk gap while all bs "
                            "streams decode; context = prompt + mean chunk index."))
        written.append(out / "tpot.json")
    print("wrote " + ", ".join(str(p) for p in written))
    flags = " ".join(f"--{p.stem} {p}" for p in written)
    print(f"next: python -m tools.predictors.refit --base llama3-70b-8x5090 --name NAME "
          f"--aggregate median {flags} --out proxy_workers/predictors/profiles/NAME.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
