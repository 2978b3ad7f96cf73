"""The client load: closed-loop clients, each sending one request at a time through the shared
port (one TCP connection per request) with a little think time in between: streaming and
non-streaming, plain OpenAI and Scheduler-shaped bodies, and some cancelled by the client.
Each request leaves a record (`records`): its shape, timing, status, the worker pid and the
instance that answered, and its raw `outcome` (`outcomes` judges it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Any

import aiohttp

from bench.harness.streamed import meta_of
from cacheroute_sim.scheduler.requests import scheduler_body
from bench.soak.clock import SoakClock
from bench.soak.config import SoakConfig

WORDS = ("cache", "route", "proxy", "shared", "memory", "worker", "instance", "token", "queue",
         "stream", "prefill", "decode", "latency", "timeline", "sidecar", "segment")
SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_WORDS = 400  # several blocks of PROXY_AFFINITY_BLOCK_TOKENS' default


class LoadGenerator:
    def __init__(self, cfg: SoakConfig, dp_url: str, clock: SoakClock) -> None:
        self.cfg = cfg
        self.url = f"{dp_url}/v1/chat/completions"
        self.clock = clock
        self.records: list[dict[str, Any]] = []
        self._request_id = 0
        self._system_prompts = [_system_prompt(n) for n in range(SYSTEM_PROMPTS)]

    def body(self, rng: random.Random, stream: bool, scheduler: bool) -> dict[str, Any]:
        max_tokens = rng.randint(*self.cfg.max_tokens)
        tokens = rng.randint(*self.cfg.prompt_tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(tokens))
        if not scheduler:
            messages = [{"role": "user", "content": text}]
            if self.cfg.strategy == "kv_aware" and rng.random() < self.cfg.system_prompt_share:
                messages.insert(0, {"role": "system", "content": rng.choice(self._system_prompts)})
            return {"model": "sim", "messages": messages, "stream": stream, "max_tokens": max_tokens}
        self._request_id += 1
        return scheduler_body(self._request_id, user_prompt=text, token_length=tokens,
                              max_tokens=max_tokens, stream=stream)

    async def client(self, session: aiohttp.ClientSession, index: int) -> None:
        """Client `index` (its own seeded choices) until the load ends."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000 + index)
        await asyncio.sleep(rng.uniform(0, cfg.think_max_s))
        while self.clock.load_running():
            stream = rng.random() < cfg.stream_share
            scheduler = rng.random() < cfg.scheduler_share
            cancel = None
            if rng.random() < cfg.cancel_rate:
                cancel = "mid_stream" if stream and rng.random() < 0.5 else "before_response"
            rec: dict[str, Any] = {"stream": stream, "shape": "scheduler" if scheduler else "openai",
                                   "cancel": cancel, "worker_pid": None, "instance": None,
                                   "status": None, "error_code": None}
            body = self.body(rng, stream, scheduler)
            rec["t_start"] = self.clock.now()
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
            rec["t_end"] = self.clock.now()
            rec["latency_s"] = rec["t_end"] - rec["t_start"]
            self.records.append(rec)
            await asyncio.sleep(rng.uniform(0, cfg.think_max_s))

    async def _request(self, session: aiohttp.ClientSession, body: dict[str, Any], rec: dict[str, Any]) -> None:
        t_start = time.monotonic()
        async with session.post(self.url, json=body) as response:
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
                meta = meta_of(text)
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


def _system_prompt(n: int) -> str:
    """Shared system prompt `n`: the same words in every run."""
    rng = random.Random(f"system prompt {n}")
    return " ".join(rng.choice(WORDS) for _ in range(SYSTEM_PROMPT_WORDS))
